// The page geometry of one layer cache, checked once per op call: the cache tensor, the
// probed index maps and the tiling parameters (see page_access.h for what they mean).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include "page_access.h"

namespace kvprune {

// Refuses, with a message naming the argument, a cache that is not a contiguous CPU
// [num_blocks, num_kv_heads, block_size, 2 * head_size] float32/bf16/fp16 tensor, maps of
// another shape, and a tiling that does not divide the page (it could write outside it).
// `tiled` is set only where the slot kernels are instantiated for the tiling.
PageGeometry make_geometry(const at::Tensor& kv_cache, const at::Tensor& key_offsets,
                           const at::Tensor& value_offsets, c10::IntArrayRef tiling);

}  // namespace kvprune
