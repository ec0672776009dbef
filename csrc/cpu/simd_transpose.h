// In-register transposes for the K tiles of the CPU paged KV cache.
//
// Writing K for a run of consecutive slots is a transpose: token rows of the source become tile
// rows of the cache. Element by element, that is one scalar load and store per element and is
// several times slower than a memcpy of the same bytes; with 16x16 (16-bit units) and 8x8
// (32-bit units) register transposes it is a handful of shuffles per 32 bytes. Only AVX2 is
// used, so the same code runs on AVX-512 machines (a superset) and on AVX2-only ones; without
// AVX2 the callers keep their scalar loops.
#pragma once

#include <cstdint>

#if defined(__AVX2__)
#include <immintrin.h>
#define KVPRUNE_HAS_SIMD_TRANSPOSE 1
#else
#define KVPRUNE_HAS_SIMD_TRANSPOSE 0
#endif

namespace kvprune {

#if KVPRUNE_HAS_SIMD_TRANSPOSE

// rows[i] holds 16 16-bit elements of row i; afterwards rows[k] holds column k.
inline void transpose_16x16_epi16(__m256i rows[16]) {
  __m256i pairs[16], quads[16], octs[16];
  for (int i = 0; i < 16; i += 2) {  // interleave rows (2i, 2i+1): 16-bit pairs
    pairs[i] = _mm256_unpacklo_epi16(rows[i], rows[i + 1]);
    pairs[i + 1] = _mm256_unpackhi_epi16(rows[i], rows[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // 4 rows per 64-bit group
    quads[i] = _mm256_unpacklo_epi32(pairs[i], pairs[i + 2]);
    quads[i + 1] = _mm256_unpackhi_epi32(pairs[i], pairs[i + 2]);
    quads[i + 2] = _mm256_unpacklo_epi32(pairs[i + 1], pairs[i + 3]);
    quads[i + 3] = _mm256_unpackhi_epi32(pairs[i + 1], pairs[i + 3]);
  }
  for (int half = 0; half < 16; half += 8) {  // 8 rows per 128-bit lane
    for (int q = 0; q < 4; ++q) {
      octs[half + 2 * q] = _mm256_unpacklo_epi64(quads[half + q], quads[half + 4 + q]);
      octs[half + 2 * q + 1] = _mm256_unpackhi_epi64(quads[half + q], quads[half + 4 + q]);
    }
  }
  // octs[k] (k < 8) = column k of rows 0-7 | column k+8 of rows 0-7; octs[8+k] same, rows 8-15.
  for (int k = 0; k < 8; ++k) {
    rows[k] = _mm256_permute2x128_si256(octs[k], octs[8 + k], 0x20);
    rows[k + 8] = _mm256_permute2x128_si256(octs[k], octs[8 + k], 0x31);
  }
}

// rows[i] holds 8 32-bit elements of row i; afterwards rows[k] holds column k.
inline void transpose_8x8_epi32(__m256i rows[8]) {
  __m256i pairs[8], quads[8];
  for (int i = 0; i < 8; i += 2) {
    pairs[i] = _mm256_unpacklo_epi32(rows[i], rows[i + 1]);
    pairs[i + 1] = _mm256_unpackhi_epi32(rows[i], rows[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    quads[i] = _mm256_unpacklo_epi64(pairs[i], pairs[i + 2]);
    quads[i + 1] = _mm256_unpackhi_epi64(pairs[i], pairs[i + 2]);
    quads[i + 2] = _mm256_unpacklo_epi64(pairs[i + 1], pairs[i + 3]);
    quads[i + 3] = _mm256_unpackhi_epi64(pairs[i + 1], pairs[i + 3]);
  }
  // quads[k] (k < 4) = column k of rows 0-3 | column k+4 of rows 0-3; quads[4+k]: rows 4-7.
  for (int k = 0; k < 4; ++k) {
    rows[k] = _mm256_permute2x128_si256(quads[k], quads[4 + k], 0x20);
    rows[k + 4] = _mm256_permute2x128_si256(quads[k], quads[4 + k], 0x31);
  }
}

// Tokens (and units) per register block for a unit width: 16 for 16-bit, 8 for 32-bit.
template <typename unit_t>
constexpr int64_t transpose_block() {
  return sizeof(unit_t) == 2 ? 16 : (sizeof(unit_t) == 4 ? 8 : 0);
}

// Transposes `count` tokens x `units` units (both multiples of the block) from token rows
// `sources[j]` into tile rows `first_column + u * row_bytes`, token j at unit column j.
template <typename unit_t>
inline void transpose_run(const char* const* sources, int64_t count, int64_t units,
                          char* first_column, int64_t row_bytes) {
  constexpr int64_t block = transpose_block<unit_t>();
  static_assert(block > 0, "no register transpose for this unit width");
  constexpr int64_t unit_bytes = sizeof(unit_t);
  __m256i regs[block];
  // Units outermost: the tile rows of one unit block are completed (all tokens) before the
  // next block, so each destination line is filled by back-to-back stores.
  for (int64_t unit0 = 0; unit0 < units; unit0 += block) {
    for (int64_t token0 = 0; token0 < count; token0 += block) {
      for (int64_t i = 0; i < block; ++i) {
        regs[i] = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(sources[token0 + i] + unit0 * unit_bytes));
      }
      if constexpr (block == 16) {
        transpose_16x16_epi16(regs);
      } else {
        transpose_8x8_epi32(regs);
      }
      char* dst = first_column + unit0 * row_bytes + token0 * unit_bytes;
      for (int64_t k = 0; k < block; ++k) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k * row_bytes), regs[k]);
      }
    }
  }
}

// Interleaves V of two tokens (16-bit elements) into VNNI pairs: dst[2d] = a[d],
// dst[2d + 1] = b[d] for d < 16. One 64-byte strip row of the amx layout.
inline void interleave_pair_16(const uint16_t* a, const uint16_t* b, uint16_t* dst) {
  const __m256i first = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
  const __m256i second = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
  const __m256i low = _mm256_unpacklo_epi16(first, second);   // d 0-3 | 8-11
  const __m256i high = _mm256_unpackhi_epi16(first, second);  // d 4-7 | 12-15
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_permute2x128_si256(low, high, 0x20));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16),
                      _mm256_permute2x128_si256(low, high, 0x31));
}

#endif  // KVPRUNE_HAS_SIMD_TRANSPOSE

}  // namespace kvprune
