// FDC attention over a paged cache whose KV heads each keep their own number of dimensions.
#pragma once

#include <ATen/core/Tensor.h>

namespace kvprune {

void reduced_attention(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table,
                       const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                       const at::Tensor& k_ranks, const at::Tensor& v_ranks, const at::Tensor& k_offsets,
                       const at::Tensor& v_offsets, int64_t block_size, double scale, at::Tensor& output,
                       bool balanced);

}  // namespace kvprune
