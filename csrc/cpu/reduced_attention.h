// FDC attention over a paged cache whose KV heads each keep their own number of dimensions.
#pragma once

#include <torch/all.h>

namespace kvprune {

void reduced_attention(const torch::Tensor& query, const torch::Tensor& kv_cache, const torch::Tensor& block_table,
                       const torch::Tensor& query_start_loc, const torch::Tensor& seq_lens,
                       const torch::Tensor& k_ranks, const torch::Tensor& v_ranks, const torch::Tensor& k_offsets,
                       const torch::Tensor& v_offsets, int64_t block_size, double scale, torch::Tensor& output,
                       bool balanced);

}  // namespace kvprune
