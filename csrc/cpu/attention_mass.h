// Attention probability mass per cached slot (H2O "heavy hitters"), optionally fused with
// the attention output, read straight from vLLM's CPU paged KV cache.
//
// For query i (block-table row query_rows[i]) and query head q, with KV head h = q / (Hq / H):
//   p = softmax_s(cap(scale * <query[i, q], K[s, h]>)) over the row's slots s < key_counts[i],
//   with cap(x) = softcap * tanh(x / softcap) when softcap > 0 (logit soft-capping), else x,
//   mass[h, global_slot(s)] += sum over the query heads of h's group of p_s,
//   output[i, q] = sum_s p_s V[s, h]                        (only when output is given),
// where global_slot(s) = block_table[row, s / block_size] * block_size + s % block_size.
// Everything is computed in fp32. A query with key_counts[i] == 0 adds nothing and gets a
// zero output.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <optional>

namespace kvprune {

// query [N, Hq, D] (fp32/bf16/fp16, last dim contiguous); kv_cache one layer's cache;
// block_table [rows, max_blocks] int32 or int64; query_rows, key_counts [N] int64;
// mass [H, num_blocks * block_size] fp32 contiguous (accumulated); output [N, Hq, D] fp32 or
// the query dtype, last dim contiguous. key_offsets/value_offsets/tiling: the probed layout,
// as for the slot ops.
void attention_mass(const at::Tensor& query, const at::Tensor& kv_cache,
                    const at::Tensor& block_table, const at::Tensor& query_rows,
                    const at::Tensor& key_counts, double scale, const at::Tensor& mass,
                    const std::optional<at::Tensor>& output, const at::Tensor& key_offsets,
                    const at::Tensor& value_offsets, c10::IntArrayRef tiling, double softcap);

// H2O's victims: for every layer l and KV head h, the `count` indices i into `slots` [n]
// (a request's global slots) whose tokens, at positions logical[l, h, i], are evicted first:
// lowest mass[l, h, slots[i]], ties to the lower position, never a position below `sinks`
// or at/after next_position - recent. Returns [layers, heads, count] int64, best first.
at::Tensor lowest_mass_slots(const at::Tensor& mass, const at::Tensor& slots,
                             const at::Tensor& logical, int64_t count, int64_t next_position,
                             int64_t sinks, int64_t recent);

}  // namespace kvprune
