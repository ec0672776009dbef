// Validation of a layer cache and its probed layout, shared by every op (see geometry.h).
#include "geometry.h"

#include <c10/util/Exception.h>

namespace kvprune {
namespace {

void check_cache(const at::Tensor& kv_cache) {
  TORCH_CHECK(kv_cache.device().is_cpu(), "kvprune: kv_cache must be a CPU tensor, got ",
              kv_cache.device());
  TORCH_CHECK(kv_cache.dim() == 4,
              "kvprune: kv_cache must be [num_blocks, num_kv_heads, block_size, 2*head_size], "
              "got shape ",
              kv_cache.sizes());
  const auto dtype = kv_cache.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "kvprune: kv_cache dtype must be float32, bfloat16 or float16, got ", dtype);
  TORCH_CHECK(kv_cache.is_contiguous(),
              "kvprune: kv_cache must be contiguous (vLLM's per-layer CPU cache is)");
  TORCH_CHECK(kv_cache.size(3) % 2 == 0, "kvprune: kv_cache last dim must be 2*head_size, got ",
              kv_cache.size(3));
}

void check_offsets(const at::Tensor& offsets, const char* name, int64_t block_size,
                   int64_t head_size) {
  TORCH_CHECK(offsets.device().is_cpu() && offsets.scalar_type() == at::kLong &&
                  offsets.is_contiguous(),
              "kvprune: ", name, " must be a contiguous int64 CPU tensor");
  TORCH_CHECK(offsets.dim() == 2 && offsets.size(0) == block_size && offsets.size(1) == head_size,
              "kvprune: ", name, " must be [block_size=", block_size, ", head_size=", head_size,
              "], got ", offsets.sizes(), " (layout probed for another cache shape?)");
}

// Takes the tiling Python detected; keeps the tables as the path when the slot kernels are
// not instantiated for it. A tiling that does not divide the page is refused: it could write
// outside the page.
void set_tiling(PageGeometry& g, c10::IntArrayRef tiling, int64_t element_size) {
  g.tiled = false;
  g.key_tile = g.key_pack = g.value_tile = g.value_pack = 1;
  if (tiling.empty()) return;
  TORCH_CHECK(tiling.size() == 4,
              "kvprune: tiling must be [] or [key_tile, key_pack, value_tile, value_pack], got ",
              tiling);
  g.key_tile = tiling[0];
  g.key_pack = tiling[1];
  g.value_tile = tiling[2];
  g.value_pack = tiling[3];
  const bool divides = g.key_tile > 0 && g.block_size % g.key_tile == 0 && g.key_pack > 0 &&
                       g.head_size % g.key_pack == 0 && g.value_tile > 0 &&
                       g.head_size % g.value_tile == 0 && g.value_pack > 0 &&
                       g.block_size % g.value_pack == 0;
  TORCH_CHECK(divides, "kvprune: tiling ", tiling, " does not divide block_size=", g.block_size,
              ", head_size=", g.head_size);
  const int64_t key_unit_bytes = g.key_pack * element_size;
  g.tiled = (key_unit_bytes == 2 || key_unit_bytes == 4 || key_unit_bytes == 8) &&
            (g.value_pack == 1 || g.value_pack == 2);
}

}  // namespace

PageGeometry make_geometry(const at::Tensor& kv_cache, const at::Tensor& key_offsets,
                           const at::Tensor& value_offsets, c10::IntArrayRef tiling) {
  check_cache(kv_cache);
  PageGeometry g;
  g.num_heads = kv_cache.size(1);
  g.block_size = kv_cache.size(2);
  g.head_size = kv_cache.size(3) / 2;
  g.page_elems = 2 * g.block_size * g.head_size;
  g.num_slots = kv_cache.size(0) * g.block_size;
  check_offsets(key_offsets, "key_offsets", g.block_size, g.head_size);
  check_offsets(value_offsets, "value_offsets", g.block_size, g.head_size);
  g.key_offsets = key_offsets.const_data_ptr<int64_t>();
  g.value_offsets = value_offsets.const_data_ptr<int64_t>();
  set_tiling(g, tiling, kv_cache.element_size());
  return g;
}

}  // namespace kvprune
