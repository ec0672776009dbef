// Slot-level moves of K/V tokens inside vLLM's CPU paged KV cache.
//
// A layer cache is [num_blocks, num_kv_heads, block_size, 2 * head_size]. Each (block, head)
// "page" of 2 * block_size * head_size elements stores K and V for block_size tokens in an
// ISA-dependent order that Python probes from vLLM (vllm_kvprune/kernels/layout.py) and hands
// over as two index maps, key_offsets[o, d] and value_offsets[o, d], plus `tiling`: [] or the
// four parameters of the tiled formula (page_access.h) that every x86 layout of vLLM 0.32
// follows, which selects the fast kernels. The ops copy elements bit for bit (no arithmetic on
// values), so one template per element width covers fp32, bf16 and fp16.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <string>
#include <tuple>

namespace kvprune {

// Writes key/value [T, H, D] into the slots given by `slots` ([T], one slot shared by all
// heads, as vLLM's slot_mapping; or [T, H], one slot per token and KV head). Slot -1 is
// skipped. Duplicate slots leave an unspecified one of the writers.
void write_slots(const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
                 const at::Tensor& slots, const at::Tensor& key_offsets,
                 const at::Tensor& value_offsets, c10::IntArrayRef tiling);

// Moves whole tokens (K and V) from src_slots to dst_slots ([n] or [n, H]) within one layer
// cache. Every source is read before any destination is written, so the two sets may
// overlap. Pairs whose destination is -1 are skipped; a valid destination needs a valid
// source. Destinations must be distinct.
void copy_slots(const at::Tensor& kv_cache, const at::Tensor& src_slots,
                const at::Tensor& dst_slots, const at::Tensor& key_offsets,
                const at::Tensor& value_offsets, c10::IntArrayRef tiling);

// Gathers K and V [n, H, D] of the given slots ([n] or [n, H]); rows of slot -1 are zero.
std::tuple<at::Tensor, at::Tensor> read_slots(const at::Tensor& kv_cache, const at::Tensor& slots,
                                              const at::Tensor& key_offsets,
                                              const at::Tensor& value_offsets, c10::IntArrayRef tiling);

// The instruction set the extension was compiled for ("avx512", "avx2" or "generic").
std::string build_isa();

}  // namespace kvprune
