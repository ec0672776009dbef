// Per-token access to one (block, head) page of the CPU paged KV cache.
//
// Two ways to find K[o, d] / V[o, d] inside a page:
//  * tiled: every layout vLLM 0.32 uses on x86 is one formula with four parameters,
//      K[o, d] at (o / KT) * KT * D + (d / KP) * KT * KP + (o % KT) * KP + d % KP
//      V[o, d] at bs * D + (d / VT) * bs * VT + (o / VP) * VT * VP + (d % VT) * VP + o % VP
//    vec/vec16: KT = bs, KP = 1, VT = D, VP = 1 (K transposed, V row-major);
//    amx (bf16): KT = 16, KP = 2, VT = 16, VP = 2 (VNNI tiles). Python detects the
//    parameters from the probed maps; the kernels below exploit them for contiguous moves.
//  * tables: any other layout, element by element through the probed index maps.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "simd_transpose.h"

namespace kvprune {

// Most tokens written as one run (bounds the callers' stack arrays).
constexpr int64_t kMaxRunTokens = 64;

struct PageGeometry {
  int64_t num_heads;
  int64_t block_size;
  int64_t head_size;
  int64_t page_elems;            // 2 * block_size * head_size
  int64_t num_slots;             // num_blocks * block_size
  const int64_t* key_offsets;    // [block_size, head_size]
  const int64_t* value_offsets;  // [block_size, head_size]
  bool tiled;                    // the four parameters below are valid
  int64_t key_tile;              // KT: tokens per K tile
  int64_t key_pack;              // KP: dims stored together per token
  int64_t value_tile;            // VT: dims per V strip
  int64_t value_pack;            // VP: tokens interleaved per V row
};

// Start of the page that holds `slot` for `head`.
template <typename elem_t>
inline elem_t* page_of(elem_t* cache, const PageGeometry& g, int64_t slot, int64_t head) {
  const int64_t block = slot / g.block_size;
  return cache + (block * g.num_heads + head) * g.page_elems;
}

// Unaligned-safe moves of one "unit" (KP consecutive elements); compile to a single mov.
template <typename unit_t>
inline unit_t load_unit(const void* src) {
  unit_t unit;
  std::memcpy(&unit, src, sizeof(unit_t));
  return unit;
}

template <typename unit_t>
inline void store_unit(void* dst, unit_t unit) {
  std::memcpy(dst, &unit, sizeof(unit_t));
}

// ---- tiled layouts --------------------------------------------------------------------------

// Start of the K tile (in elements) that holds block offset `offset_in_block`.
template <typename elem_t>
inline elem_t* key_tile_of(elem_t* page, const PageGeometry& g, int64_t offset_in_block) {
  return page + (offset_in_block / g.key_tile) * g.key_tile * g.head_size;
}

// Length of the stretch of consecutive offsets starting at `first`.
inline int64_t consecutive_from(const int64_t* offsets, int64_t first, int64_t count) {
  int64_t last = first + 1;
  while (last < count && offsets[last] == offsets[last - 1] + 1) ++last;
  return last - first;
}

// GCC 12 cannot see that `leftover` only holds indices below `count`, all of whose sources
// the caller filled, and warns about the caller's array; the warning is a false positive.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
// Writes K of `count` tokens that share one K tile: a transpose (token rows become tile rows).
// Stretches of consecutive slots go through register transposes, whole blocks at a time; the
// tokens left over (stretch tails, scattered slots) are moved unit by unit, dimension-major,
// so each tile row is filled in one burst while their few source rows stay in L1.
template <typename elem_t, typename key_unit_t>
inline void store_key_run(elem_t* tile, const PageGeometry& g, const elem_t* const* sources,
                          const int64_t* offsets_in_tile, int64_t count) {
  constexpr int64_t unit_bytes = sizeof(key_unit_t);
  const int64_t units = g.head_size / g.key_pack;
  const int64_t row_bytes = g.key_tile * unit_bytes;
  char* tile_bytes = reinterpret_cast<char*>(tile);
  const char* const* source_bytes = reinterpret_cast<const char* const*>(sources);
  int64_t leftover[kMaxRunTokens];  // indices into sources/offsets_in_tile
  int64_t num_leftover = 0;
  for (int64_t first = 0; first < count;) {
    const int64_t stretch = consecutive_from(offsets_in_tile, first, count);
    int64_t transposed = 0;
#if KVPRUNE_HAS_SIMD_TRANSPOSE
    if constexpr (transpose_block<key_unit_t>() > 0) {
      constexpr int64_t block = transpose_block<key_unit_t>();
      if (units % block == 0) {
        transposed = stretch / block * block;
        if (transposed > 0) {
          transpose_run<key_unit_t>(source_bytes + first, transposed, units,
                                    tile_bytes + offsets_in_tile[first] * unit_bytes, row_bytes);
        }
      }
    }
#endif
    for (int64_t j = first + transposed; j < first + stretch; ++j) leftover[num_leftover++] = j;
    first += stretch;
  }
  for (int64_t u = 0; u < units; ++u) {
    char* row = tile_bytes + u * row_bytes;
    for (int64_t i = 0; i < num_leftover; ++i) {
      const int64_t j = leftover[i];
      store_unit(row + offsets_in_tile[j] * unit_bytes,
                 load_unit<key_unit_t>(source_bytes[j] + u * unit_bytes));
    }
  }
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

template <typename elem_t, typename key_unit_t>
inline void load_key_tiled(const elem_t* page, const PageGeometry& g, int64_t offset_in_block,
                           elem_t* key) {
  const char* tile = reinterpret_cast<const char*>(key_tile_of(page, g, offset_in_block));
  const int64_t in_tile = offset_in_block % g.key_tile;
  const int64_t units = g.head_size / g.key_pack;
  char* dst = reinterpret_cast<char*>(key);
  for (int64_t u = 0; u < units; ++u) {
    const char* src = tile + (u * g.key_tile + in_tile) * sizeof(key_unit_t);
    store_unit(dst + u * sizeof(key_unit_t), load_unit<key_unit_t>(src));
  }
}

// V strips: VT dims of one token, interleaved with VP - 1 neighbour tokens.
template <typename elem_t, int value_pack>
inline void store_value_tiled(elem_t* page, const PageGeometry& g, int64_t offset_in_block,
                              const elem_t* value) {
  const int64_t strip = g.value_tile, bs = g.block_size;
  elem_t* base = page + bs * g.head_size + (offset_in_block / value_pack) * strip * value_pack +
                 offset_in_block % value_pack;
  for (int64_t first_dim = 0; first_dim < g.head_size; first_dim += strip) {
    elem_t* dst = base + first_dim * bs;
    const elem_t* src = value + first_dim;
    // A plain loop, not memcpy: the strip is a few hundred bytes, which the compiler moves in
    // a few vector instructions instead of a libc call.
    for (int64_t d = 0; d < strip; ++d) dst[d * value_pack] = src[d];
  }
}

// Writes V of a run. In the amx layout (16-bit, VP = 2, strips of 16 dims) the two tokens of
// a pair share every strip row, so a run holding both is written a row at a time, interleaved
// in registers, instead of with 2-byte stores.
template <typename elem_t, int value_pack>
inline void store_value_run(elem_t* page, const PageGeometry& g, const elem_t* const* sources,
                            const int64_t* offsets_in_block, int64_t count) {
  for (int64_t j = 0; j < count; ++j) {
#if KVPRUNE_HAS_SIMD_TRANSPOSE
    if constexpr (value_pack == 2 && sizeof(elem_t) == 2) {
      const int64_t offset = offsets_in_block[j];
      if (g.value_tile == 16 && offset % 2 == 0 && j + 1 < count &&
          offsets_in_block[j + 1] == offset + 1) {
        uint16_t* base = reinterpret_cast<uint16_t*>(page + g.block_size * g.head_size) +
                         offset * g.value_tile;
        for (int64_t first_dim = 0; first_dim < g.head_size; first_dim += 16) {
          interleave_pair_16(reinterpret_cast<const uint16_t*>(sources[j]) + first_dim,
                             reinterpret_cast<const uint16_t*>(sources[j + 1]) + first_dim,
                             base + first_dim * g.block_size);
        }
        ++j;
        continue;
      }
    }
#endif
    store_value_tiled<elem_t, value_pack>(page, g, offsets_in_block[j], sources[j]);
  }
}

template <typename elem_t, int value_pack>
inline void load_value_tiled(const elem_t* page, const PageGeometry& g, int64_t offset_in_block,
                             elem_t* value) {
  const int64_t strip = g.value_tile, bs = g.block_size;
  const elem_t* base = page + bs * g.head_size +
                       (offset_in_block / value_pack) * strip * value_pack +
                       offset_in_block % value_pack;
  for (int64_t first_dim = 0; first_dim < g.head_size; first_dim += strip) {
    const elem_t* src = base + first_dim * bs;
    elem_t* dst = value + first_dim;
    for (int64_t d = 0; d < strip; ++d) dst[d] = src[d * value_pack];
  }
}

// ---- any layout, through the index maps ------------------------------------------------------

template <typename elem_t>
inline void store_token_mapped(elem_t* page, const PageGeometry& g, int64_t offset_in_block,
                               const elem_t* key, const elem_t* value) {
  const int64_t dims = g.head_size;
  const int64_t* key_map = g.key_offsets + offset_in_block * dims;
  const int64_t* value_map = g.value_offsets + offset_in_block * dims;
  for (int64_t d = 0; d < dims; ++d) page[key_map[d]] = key[d];
  for (int64_t d = 0; d < dims; ++d) page[value_map[d]] = value[d];
}

template <typename elem_t>
inline void load_token_mapped(const elem_t* page, const PageGeometry& g, int64_t offset_in_block,
                              elem_t* key, elem_t* value) {
  const int64_t dims = g.head_size;
  const int64_t* key_map = g.key_offsets + offset_in_block * dims;
  const int64_t* value_map = g.value_offsets + offset_in_block * dims;
  for (int64_t d = 0; d < dims; ++d) key[d] = page[key_map[d]];
  for (int64_t d = 0; d < dims; ++d) value[d] = page[value_map[d]];
}

}  // namespace kvprune
