// Attention mass per cached slot, optionally fused with the attention output (see
// attention_mass.h), read in place from vLLM's CPU paged KV cache.
//
// Work split: one task per (block-table row, KV head), and where that gives the cores too few
// tasks (a long prompt chunk alone in its step), the row's queries split into parts of about
// equal work, each adding its mass into a buffer of its own that is summed into the table
// afterwards. A task runs its queries (one decode token, or a prefill chunk with causal key
// counts) for the G query heads of its KV head, a block of consecutive queries at a time, so
// each page is read once for the block: their logit rows, one softmax per query head over its
// own key count, then the mass of each slot is added and, if asked, the output accumulated.
// Two tasks of different heads never touch the same mass row; two rows only meet when their
// tables share a block (prefix caching), which is detected up front and then the split is by
// KV head alone.
//
// Inner loops (tiled layouts, page_access.h): K is read tile row by tile row, 16 tokens x KP
// dims at a time into 16 * KP fp32 accumulators, which the compiler keeps in registers; V is
// read strip row by strip row (VT dims x VP tokens, contiguous) into accumulators stored in
// the same interleaved order, folded over the VP tokens at the end. Both are plain loops
// over contiguous memory with compile-time KP / VP, which GCC vectorises.
#include "attention_mass.h"

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>


#include "geometry.h"
#include "page_access.h"
#include "vec16.h"

namespace kvprune {
namespace {

// Tokens of a K tile scored together (one 512-bit register of fp32 per key dim of the pack).
constexpr int64_t kTokenChunk = 16;

// Smallest amount of work (multiply-adds) one parallel task should do: a parallel region
// costs a few microseconds with idle cores and much more on a busy shared machine (see
// slot_ops.cpp), so small calls stay on the calling thread.
constexpr int64_t kMinMacsPerTask = 1 << 18;

inline float to_f32(float x) { return x; }
inline float to_f32(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_f32(c10::Half x) { return static_cast<float>(x); }

// exp(x) for x <= 0 (softmax after subtracting the max), branch-free so it vectorises:
// Cephes' expf (x = k ln2 + r, degree-6 polynomial, scaled by 2^k), ~1 ulp. Inputs below -87
// are clamped: their exp is < 2^-125, nothing next to the max's exp(0) = 1.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float k = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - k * 0.693359375f + k * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float two_k;
  std::memcpy(&two_k, &bits, sizeof(two_k));
  return p * two_k;
}

// ---- SIMD kernels ------------------------------------------------------------------------------
// The same computations as the portable loops of TiledPage, written with intrinsics: GCC does
// not keep the K accumulators in registers across the key dims on its own, nor vectorise the
// softmax reductions (float sums are not reassociated without -ffast-math). They are written
// once against Vec16 (vec16.h: 16 fp32 lanes, the tiled layouts' 16-token chunk; one AVX-512
// register or two AVX2 ones). kMaxVectors: the Vec16s of one K tile row scored per pass.
#if KVPRUNE_HAS_VEC16
#define KVPRUNE_SIMD_ATTENTION 1
constexpr int kMaxVectors = kVec16Registers == 1 ? 4 : 1;  // AVX-512: 32 registers, AVX2: 16
#else
#define KVPRUNE_SIMD_ATTENTION 0
#endif

#if KVPRUNE_SIMD_ATTENTION
// KP consecutive fp32 values (a dim pack of the query, a token pack of probabilities)
// repeated over the 16 lanes, matching the KP-interleaved order of the cache rows.
template <int KP>
inline Vec16 broadcast_pack(const float* src) {
  if constexpr (KP == 1) {
    return vset1(*src);
  } else {
    return vset_pair(src);
  }
}

// Logits of NV * 16 / KP tokens of one K tile (elements [0, NV * 16) of each tile row from
// `tile` on) for GB query heads at once, so each K vector is loaded and converted once:
// acc[g][v] += (head g's dim pack u) * (tile row u). q: head g at q + g * D;
// out: head g at out + g * ld.
template <typename elem_t, int KP, int NV, int GB>
inline void score_vectors(const elem_t* tile, int64_t row_stride, int64_t units,
                          const float* q, int64_t D, float* out, int64_t ld) {
  Vec16 acc[GB][NV];
  for (int g = 0; g < GB; ++g) {
    for (int v = 0; v < NV; ++v) acc[g][v] = vzero();
  }
  for (int64_t u = 0; u < units; ++u) {
    const elem_t* row = tile + u * row_stride;
    Vec16 k[NV];
    for (int v = 0; v < NV; ++v) k[v] = vload(row + v * 16);
    for (int g = 0; g < GB; ++g) {
      const Vec16 qu = broadcast_pack<KP>(q + g * D + u * KP);
      for (int v = 0; v < NV; ++v) acc[g][v] = vfmadd(qu, k[v], acc[g][v]);
    }
  }
  for (int g = 0; g < GB; ++g) {
    if constexpr (KP == 1) {
      for (int v = 0; v < NV; ++v) vstore(out + g * ld + v * 16, acc[g][v]);
    } else {
      float folded[NV * 16];
      for (int v = 0; v < NV; ++v) vstore(folded + v * 16, acc[g][v]);
      for (int t = 0; t < NV * 16 / KP; ++t) {
        float sum = 0.0f;
        for (int p = 0; p < KP; ++p) sum += folded[t * KP + p];
        out[g * ld + t] = sum;
      }
    }
  }
}

// All G heads, at most 4 at a time.
template <typename elem_t, int KP, int NV>
inline void score_heads(const elem_t* tile, int64_t row_stride, int64_t units, const float* q,
                        int64_t D, int64_t G, float* out, int64_t ld) {
  for (int64_t gi = 0; gi < G; gi += 4) {
    const float* qg = q + gi * D;
    float* og = out + gi * ld;
    switch (std::min<int64_t>(4, G - gi)) {
      case 1: score_vectors<elem_t, KP, NV, 1>(tile, row_stride, units, qg, D, og, ld); break;
      case 2: score_vectors<elem_t, KP, NV, 2>(tile, row_stride, units, qg, D, og, ld); break;
      case 3: score_vectors<elem_t, KP, NV, 3>(tile, row_stride, units, qg, D, og, ld); break;
      default: score_vectors<elem_t, KP, NV, 4>(tile, row_stride, units, qg, D, og, ld);
    }
  }
}

// acc (GB query heads, head g at acc + g * acc_stride; NV vectors in strip-row order) +=
// p(token pack) * V(strip row of that pack), for `packs` consecutive packs; p of head g at
// p + g * ld.
template <typename elem_t, int VP, int NV, int GB>
inline void value_vectors(const elem_t* rows, int64_t row_len, int64_t packs, const float* p,
                          int64_t ld, float* acc, int64_t acc_stride) {
  Vec16 a[GB][NV];
  for (int g = 0; g < GB; ++g) {
    for (int v = 0; v < NV; ++v) a[g][v] = vload(acc + g * acc_stride + v * 16);
  }
  for (int64_t pack = 0; pack < packs; ++pack) {
    const elem_t* row = rows + pack * row_len;
    Vec16 x[NV];
    for (int v = 0; v < NV; ++v) x[v] = vload(row + v * 16);
    for (int g = 0; g < GB; ++g) {
      const Vec16 pv = broadcast_pack<VP>(p + g * ld + pack * VP);
      for (int v = 0; v < NV; ++v) a[g][v] = vfmadd(pv, x[v], a[g][v]);
    }
  }
  for (int g = 0; g < GB; ++g) {
    for (int v = 0; v < NV; ++v) vstore(acc + g * acc_stride + v * 16, a[g][v]);
  }
}

template <typename elem_t, int VP, int NV>
inline void value_heads(const elem_t* rows, int64_t row_len, int64_t packs, const float* p,
                        int64_t ld, int64_t G, float* acc, int64_t acc_stride) {
  for (int64_t gi = 0; gi < G; gi += 4) {
    const float* pg = p + gi * ld;
    float* ag = acc + gi * acc_stride;
    switch (std::min<int64_t>(4, G - gi)) {
      case 1: value_vectors<elem_t, VP, NV, 1>(rows, row_len, packs, pg, ld, ag, acc_stride); break;
      case 2: value_vectors<elem_t, VP, NV, 2>(rows, row_len, packs, pg, ld, ag, acc_stride); break;
      case 3: value_vectors<elem_t, VP, NV, 3>(rows, row_len, packs, pg, ld, ag, acc_stride); break;
      default: value_vectors<elem_t, VP, NV, 4>(rows, row_len, packs, pg, ld, ag, acc_stride);
    }
  }
}
#endif

// ---- page kernels ------------------------------------------------------------------------------
// scores(): logits[gi * ld + o] = <q[gi], K[o]> for the G query heads and block offsets
//   o < valid (tiled: whole 16-token chunks, so up to the chunk end; those extra entries are
//   never read).
// values(): acc += p[gi * ld + o] * V[o] for o < valid, in the page's own V order
//   (value_order(d, v) below); finish() folds it into out[gi * D + d].

template <typename elem_t, int KP, int VP>
struct TiledPage {
  static constexpr int value_pack = VP;

  static void scores(const elem_t* page, const PageGeometry& g, const float* q, int64_t G,
                     int64_t valid, float* logits, int64_t ld) {
    const int64_t D = g.head_size, KT = g.key_tile, units = D / KP;
#if KVPRUNE_SIMD_ATTENTION
    // A tile row holds KT * KP elements (a multiple of 16: KT % 16 == 0); up to kMaxVectors
    // vectors (64 elements on AVX-512) are scored per pass over the key dims.
    const int64_t row_stride = KT * KP;
    for (int64_t tile_start = 0; tile_start < valid; tile_start += KT) {
      const elem_t* tile = page + tile_start * D;
      const int64_t row_used = std::min(KT, valid - tile_start) * KP;  // elements to cover
      int64_t first = 0;
      if constexpr (kMaxVectors >= 4) {
        for (; first + 64 <= row_used; first += 64) {
          score_heads<elem_t, KP, 4>(tile + first, row_stride, units, q, D, G, logits + tile_start + first / KP, ld);
        }
      }
      if constexpr (kMaxVectors >= 2) {
        for (; first + 32 <= row_used; first += 32) {
          score_heads<elem_t, KP, 2>(tile + first, row_stride, units, q, D, G, logits + tile_start + first / KP, ld);
        }
      }
      for (; first < row_used; first += 16) {
        score_heads<elem_t, KP, 1>(tile + first, row_stride, units, q, D, G, logits + tile_start + first / KP, ld);
      }
    }
    return;
#endif
    for (int64_t tile_start = 0; tile_start < valid; tile_start += KT) {
      const elem_t* tile = page + tile_start * D;
      for (int64_t chunk = 0; chunk < KT && tile_start + chunk < valid; chunk += kTokenChunk) {
        for (int64_t gi = 0; gi < G; ++gi) {
          const float* qg = q + gi * D;
          float acc[kTokenChunk * KP] = {};
          for (int64_t u = 0; u < units; ++u) {
            const elem_t* src = tile + u * KT * KP + chunk * KP;
            float qu[KP];
            for (int p = 0; p < KP; ++p) qu[p] = qg[u * KP + p];
            for (int64_t t = 0; t < kTokenChunk; ++t) {
              for (int p = 0; p < KP; ++p) acc[t * KP + p] += qu[p] * to_f32(src[t * KP + p]);
            }
          }
          float* out = logits + gi * ld + tile_start + chunk;
          for (int64_t t = 0; t < kTokenChunk; ++t) {
            float sum = 0.0f;
            for (int p = 0; p < KP; ++p) sum += acc[t * KP + p];
            out[t] = sum;
          }
        }
      }
    }
  }

  // acc holds, per query head, the D * VP products in strip order: strip s, dim j of the
  // strip, token v of the pack at (s * VT + j) * VP + v.
  static void values(const elem_t* page, const PageGeometry& g, const float* p, int64_t ld,
                     int64_t G, int64_t valid, float* acc) {
    const int64_t D = g.head_size, VT = g.value_tile, bs = g.block_size;
    const int64_t row_len = VT * VP;
    const int64_t packs = valid / VP, rest = valid % VP;
    const elem_t* values_start = page + bs * D;
    for (int64_t strip = 0; strip < D / VT; ++strip) {
      const elem_t* strip_start = values_start + strip * VT * bs;
#if KVPRUNE_SIMD_ATTENTION
      if (row_len % 16 == 0) {
        const int64_t acc_stride = D * VP;
        float* a = acc + strip * row_len;
        int64_t first = 0;
        if constexpr (kMaxVectors >= 4) {
          for (; first + 64 <= row_len; first += 64) {
            value_heads<elem_t, VP, 4>(strip_start + first, row_len, packs, p, ld, G, a + first, acc_stride);
          }
        }
        if constexpr (kMaxVectors >= 2) {
          for (; first + 32 <= row_len; first += 32) {
            value_heads<elem_t, VP, 2>(strip_start + first, row_len, packs, p, ld, G, a + first, acc_stride);
          }
        }
        for (; first < row_len; first += 16) {
          value_heads<elem_t, VP, 1>(strip_start + first, row_len, packs, p, ld, G, a + first, acc_stride);
        }
      } else
#endif
      for (int64_t pack = 0; pack < packs; ++pack) {
        const elem_t* row = strip_start + pack * row_len;
        for (int64_t gi = 0; gi < G; ++gi) {
          float pv[VP];
          for (int v = 0; v < VP; ++v) pv[v] = p[gi * ld + pack * VP + v];
          float* a = acc + gi * D * VP + strip * row_len;
          for (int64_t j = 0; j < row_len; j += VP) {
            for (int v = 0; v < VP; ++v) a[j + v] += pv[v] * to_f32(row[j + v]);
          }
        }
      }
      if (rest > 0) {  // a partial pack: the other tokens' V may be anything (even NaN)
        const elem_t* row = strip_start + packs * row_len;
        for (int64_t gi = 0; gi < G; ++gi) {
          float* a = acc + gi * D * VP + strip * row_len;
          for (int v = 0; v < rest; ++v) {
            const float pv = p[gi * ld + packs * VP + v];
            for (int64_t j = 0; j < row_len; j += VP) a[j + v] += pv * to_f32(row[j + v]);
          }
        }
      }
    }
  }

  static void finish(const PageGeometry& g, const float* acc, float* out) {
    const int64_t D = g.head_size, VT = g.value_tile;
    for (int64_t d = 0; d < D; ++d) {
      const float* a = acc + ((d / VT) * VT + d % VT) * VP;
      float sum = 0.0f;
      for (int v = 0; v < VP; ++v) sum += a[v];
      out[d] = sum;
    }
  }
};

// Any layout, element by element through the probed index maps.
template <typename elem_t>
struct MappedPage {
  static constexpr int value_pack = 1;

  static void scores(const elem_t* page, const PageGeometry& g, const float* q, int64_t G,
                     int64_t valid, float* logits, int64_t ld) {
    const int64_t D = g.head_size;
    for (int64_t o = 0; o < valid; ++o) {
      const int64_t* key_map = g.key_offsets + o * D;
      for (int64_t gi = 0; gi < G; ++gi) {
        float sum = 0.0f;
        for (int64_t d = 0; d < D; ++d) sum += q[gi * D + d] * to_f32(page[key_map[d]]);
        logits[gi * ld + o] = sum;
      }
    }
  }

  static void values(const elem_t* page, const PageGeometry& g, const float* p, int64_t ld,
                     int64_t G, int64_t valid, float* acc) {
    const int64_t D = g.head_size;
    for (int64_t o = 0; o < valid; ++o) {
      const int64_t* value_map = g.value_offsets + o * D;
      for (int64_t gi = 0; gi < G; ++gi) {
        const float pv = p[gi * ld + o];
        for (int64_t d = 0; d < D; ++d) acc[gi * D + d] += pv * to_f32(page[value_map[d]]);
      }
    }
  }

  static void finish(const PageGeometry& g, const float* acc, float* out) {
    std::copy(acc, acc + g.head_size, out);
  }
};

// ---- problem description -----------------------------------------------------------------------

struct Problem {
  PageGeometry g;
  int64_t num_queries;
  int64_t group;  // query heads per KV head
  float scale;
  float softcap;  // > 0: logits become softcap * tanh(logits / softcap) (Gemma 2 style)
  // query [N, Hq, D]
  const char* query;
  at::ScalarType query_type;
  int64_t query_stride0, query_stride1;  // elements
  // output [N, Hq, D] or null
  char* output;
  at::ScalarType output_type;
  int64_t output_stride0, output_stride1;
  // block table [rows, max_blocks]
  const char* table;
  bool table_is_long;
  int64_t table_stride0, table_stride1;
  const int64_t* counts;
  float* mass;  // [H, num_slots]

  int64_t block_at(int64_t row, int64_t index) const {
    const int64_t at = row * table_stride0 + index * table_stride1;
    return table_is_long ? reinterpret_cast<const int64_t*>(table)[at]
                         : reinterpret_cast<const int32_t*>(table)[at];
  }

  // scale * query[i, head * G + gi, :] into q[gi * D + d], fp32.
  void load_query(int64_t i, int64_t head, float* q) const {
    const int64_t D = g.head_size;
    for (int64_t gi = 0; gi < group; ++gi) {
      const int64_t at = i * query_stride0 + (head * group + gi) * query_stride1;
      float* dst = q + gi * D;
      switch (query_type) {
        case at::kFloat: {
          const float* src = reinterpret_cast<const float*>(query) + at;
          for (int64_t d = 0; d < D; ++d) dst[d] = scale * src[d];
          break;
        }
        case at::kBFloat16: {
          const c10::BFloat16* src = reinterpret_cast<const c10::BFloat16*>(query) + at;
          for (int64_t d = 0; d < D; ++d) dst[d] = scale * to_f32(src[d]);
          break;
        }
        default: {
          const c10::Half* src = reinterpret_cast<const c10::Half*>(query) + at;
          for (int64_t d = 0; d < D; ++d) dst[d] = scale * to_f32(src[d]);
        }
      }
    }
  }

  void store_output(int64_t i, int64_t head, int64_t gi, const float* src) const {
    const int64_t D = g.head_size;
    const int64_t at = i * output_stride0 + (head * group + gi) * output_stride1;
    switch (output_type) {
      case at::kFloat:
        std::copy(src, src + D, reinterpret_cast<float*>(output) + at);
        break;
      case at::kBFloat16: {
        c10::BFloat16* dst = reinterpret_cast<c10::BFloat16*>(output) + at;
        for (int64_t d = 0; d < D; ++d) dst[d] = c10::BFloat16(src[d]);
        break;
      }
      default: {
        c10::Half* dst = reinterpret_cast<c10::Half*>(output) + at;
        for (int64_t d = 0; d < D; ++d) dst[d] = c10::Half(src[d]);
      }
    }
  }
};

// Queries sharing one block-table row, as a range of `order` (query indices sorted by row).
struct RowGroup {
  int64_t row;
  int64_t begin, end;
  int64_t macs;  // work estimate: sum of key counts * Hq * D
  int64_t max_count;
};

// One task's queries: a range of a row group's, for one KV head. A row whose queries are split
// over several parts (a long prompt chunk: more tasks than KV heads for the cores) adds its
// mass into a buffer of its own per part and head, indexed by key position, summed into the
// table after the parallel region; an unsplit row adds to the table directly.
struct Part {
  int64_t group;
  int64_t begin, end;
  float* buffer;  // [num_heads, span] of this part, or null: add to the table
  int64_t span;   // the row's blocks * block_size
};

// Consecutive queries of one row scored together, so each K and V page is read once for all
// of them (a prompt chunk's queries; a decode row has one).
// About 12 logit rows (4 queries of SmolLM2's 3 query heads per KV head; a trial of 3, 6, 12
// and 24 rows on a 4K-token chunk, 2 cores, was fastest at 12); at most 8 queries.
inline int64_t query_block(int64_t group) {
  return std::max<int64_t>(1, std::min<int64_t>(8, 12 / group));
}

// Softmax over l[0..n), in place.
inline void softmax(float* l, int64_t n) {
#if KVPRUNE_SIMD_ATTENTION
  vsoftmax(l, n);
#else
  float max_logit = -std::numeric_limits<float>::infinity();
  for (int64_t o = 0; o < n; ++o) max_logit = std::max(max_logit, l[o]);
  float sum = 0.0f;
  for (int64_t o = 0; o < n; ++o) {
    l[o] = exp_nonpositive(l[o] - max_logit);
    sum += l[o];
  }
  const float inverse = 1.0f / sum;
  for (int64_t o = 0; o < n; ++o) l[o] *= inverse;
#endif
}

// Per-thread scratch, reused across the tasks of one parallel chunk.
struct Scratch {
  std::vector<float> query, logits, acc, out;
};

// Queries order[begin..end) of row `row`, KV head `head`, QB at a time: their G query heads'
// logits over the block's largest key count (rows with fewer keys: the rest is masked out of
// their softmax and their probabilities there are 0), one softmax per query head over its own
// keys, the mass of each key added (to `buffer` by position, or to the table by slot), and the
// output if asked.
template <typename elem_t, typename Page>
void run_queries(const Problem& P, const elem_t* cache, int64_t row, const int64_t* order, int64_t begin,
                 int64_t end, int64_t head, float* buffer, Scratch& s) {
  const PageGeometry& g = P.g;
  const int64_t D = g.head_size, bs = g.block_size, G = P.group, QB = query_block(G);
  s.out.resize(D);
  float* mass_row = P.mass + head * g.num_slots;
  for (int64_t k0 = begin; k0 < end;) {
    // The block: up to QB consecutive queries; a query with no keys gets a zero output alone.
    if (P.counts[order[k0]] == 0) {
      if (P.output != nullptr) {
        std::fill(s.out.begin(), s.out.end(), 0.0f);
        for (int64_t gi = 0; gi < G; ++gi) P.store_output(order[k0], head, gi, s.out.data());
      }
      ++k0;
      continue;
    }
    int64_t k1 = k0, n = 0;
    for (; k1 < end && k1 - k0 < QB && P.counts[order[k1]] > 0; ++k1) n = std::max(n, P.counts[order[k1]]);
    const int64_t rows_in_block = (k1 - k0) * G;
    const int64_t num_blocks = (n + bs - 1) / bs;
    const int64_t ld = num_blocks * bs;
    s.query.resize(rows_in_block * D);
    s.logits.resize(rows_in_block * ld);
    float* logits = s.logits.data();
    for (int64_t k = k0; k < k1; ++k) P.load_query(order[k], head, s.query.data() + (k - k0) * G * D);

    for (int64_t b = 0; b < num_blocks; ++b) {
      const elem_t* page = cache + (P.block_at(row, b) * g.num_heads + head) * g.page_elems;
      Page::scores(page, g, s.query.data(), rows_in_block, std::min(bs, n - b * bs), logits + b * bs, ld);
    }

    for (int64_t r = 0; r < rows_in_block; ++r) {
      float* l = logits + r * ld;
      const int64_t count = P.counts[order[k0 + r / G]];
      if (P.softcap > 0.0f) {  // soft-capping, as vLLM's kernel applies it: after the scale
        const float cap = P.softcap, inverse_cap = 1.0f / P.softcap;
        for (int64_t o = 0; o < count; ++o) l[o] = cap * std::tanh(l[o] * inverse_cap);
      }
      softmax(l, count);
      std::fill(l + count, l + n, 0.0f);  // keys past this query's: no probability
    }

    for (int64_t b = 0; b < num_blocks; ++b) {
      float* m = buffer != nullptr ? buffer + b * bs : mass_row + P.block_at(row, b) * bs;
      const int64_t valid = std::min(bs, n - b * bs);
      for (int64_t r = 0; r < rows_in_block; ++r) {
        const float* p = logits + r * ld + b * bs;
        for (int64_t o = 0; o < valid; ++o) m[o] += p[o];
      }
    }

    if (P.output != nullptr) {
      const int64_t acc_per_head = D * Page::value_pack;
      s.acc.assign(rows_in_block * acc_per_head, 0.0f);
      for (int64_t b = 0; b < num_blocks; ++b) {
        const elem_t* page = cache + (P.block_at(row, b) * g.num_heads + head) * g.page_elems;
        Page::values(page, g, logits + b * bs, ld, rows_in_block, std::min(bs, n - b * bs), s.acc.data());
      }
      for (int64_t r = 0; r < rows_in_block; ++r) {
        Page::finish(g, s.acc.data() + r * acc_per_head, s.out.data());
        P.store_output(order[k0 + r / G], head, r % G, s.out.data());
      }
    }
    k0 = k1;
  }
}

// A row group's queries in `parts` ranges of about equal work (a causal chunk's later queries
// attend to more keys), each at least a query block.
std::vector<std::pair<int64_t, int64_t>> split_queries(const Problem& P, const RowGroup& rg,
                                                       const int64_t* order, int64_t parts) {
  std::vector<std::pair<int64_t, int64_t>> ranges;
  const int64_t min_len = query_block(P.group);
  int64_t total = 0;
  for (int64_t k = rg.begin; k < rg.end; ++k) total += P.counts[order[k]] + 1;
  int64_t start = rg.begin, done = 0;
  for (int64_t k = rg.begin; k < rg.end; ++k) {
    done += P.counts[order[k]] + 1;
    const int64_t next_cut = total * (static_cast<int64_t>(ranges.size()) + 1) / parts;
    if (done >= next_cut && k + 1 - start >= min_len && k + 1 < rg.end &&
        static_cast<int64_t>(ranges.size()) + 1 < parts) {
      ranges.emplace_back(start, k + 1);
      start = k + 1;
    }
  }
  ranges.emplace_back(start, rg.end);
  return ranges;
}

template <typename elem_t, typename Page>
void run(const Problem& P, const elem_t* cache, const std::vector<RowGroup>& groups,
         const std::vector<int64_t>& order, bool rows_share_blocks) {
  const int64_t H = P.g.num_heads, bs = P.g.block_size;
  const int64_t num_rows = static_cast<int64_t>(groups.size());
  int64_t total_macs = 0;
  for (const RowGroup& rg : groups) total_macs += rg.macs;
  if (rows_share_blocks) {  // one task per KV head: it alone adds to its mass row
    const int64_t per_task = std::max<int64_t>(1, total_macs / H);
    at::parallel_for(0, H, std::max<int64_t>(1, kMinMacsPerTask / per_task),
                     [&](int64_t begin, int64_t end) {
                       Scratch s;
                       for (int64_t head = begin; head < end; ++head) {
                         for (const RowGroup& rg : groups) {
                           run_queries<elem_t, Page>(P, cache, rg.row, order.data(), rg.begin, rg.end, head,
                                                     nullptr, s);
                         }
                       }
                     });
    return;
  }
  // Fewer (row, KV head) tasks than a few per thread (a long prompt alone in its step): its
  // rows' queries are split so that every thread has work of about the same size.
  const int64_t threads = at::get_num_threads();
  const int64_t wanted_tasks = 4 * threads;
  std::vector<Part> parts;
  std::vector<float> buffers;
  std::vector<std::pair<int64_t, int64_t>> buffer_at;  // (part index, offset) of split parts
  int64_t buffer_floats = 0;
  for (int64_t gi = 0; gi < num_rows; ++gi) {
    const RowGroup& rg = groups[gi];
    int64_t split = 1;
    if (num_rows * H < wanted_tasks && total_macs >= threads * kMinMacsPerTask) {
      // Enough parts for the wanted tasks, as a whole number of tasks per thread.
      split = (wanted_tasks + num_rows * H - 1) / (num_rows * H);
      while ((num_rows * H * split) % threads != 0) ++split;
      split = std::min<int64_t>(split, (rg.end - rg.begin) / query_block(P.group));
      split = std::max<int64_t>(1, split);
    }
    const int64_t span = (rg.max_count + bs - 1) / bs * bs;
    const auto ranges = split_queries(P, rg, order.data(), split);
    for (const auto& range : ranges) {
      if (ranges.size() > 1) {  // parts of one row share its keys: each adds into its own buffer
        buffer_at.emplace_back(static_cast<int64_t>(parts.size()), buffer_floats);
        buffer_floats += H * span;
      }
      parts.push_back(Part{gi, range.first, range.second, nullptr, span});
    }
  }
  buffers.assign(buffer_floats, 0.0f);
  for (const auto& [k, offset] : buffer_at) parts[k].buffer = buffers.data() + offset;

  const int64_t num_tasks = static_cast<int64_t>(parts.size()) * H;
  const int64_t per_task = std::max<int64_t>(1, total_macs / std::max<int64_t>(1, num_tasks));
  at::parallel_for(0, num_tasks, std::max<int64_t>(1, kMinMacsPerTask / per_task),
                   [&](int64_t begin, int64_t end) {
                     Scratch s;
                     for (int64_t task = begin; task < end; ++task) {
                       const Part& part = parts[task / H];
                       const int64_t head = task % H;
                       float* buffer = part.buffer == nullptr ? nullptr : part.buffer + head * part.span;
                       run_queries<elem_t, Page>(P, cache, groups[part.group].row, order.data(), part.begin,
                                                 part.end, head, buffer, s);
                     }
                   });
  // The split rows' mass, part by part, into the table (each head's row by one thread).
  if (buffer_at.empty()) return;
  at::parallel_for(0, H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t head = begin; head < end; ++head) {
      float* mass_row = P.mass + head * P.g.num_slots;
      for (const auto& [k, offset] : buffer_at) {
        const Part& part = parts[k];
        const RowGroup& rg = groups[part.group];
        const float* added = part.buffer + head * part.span;
        for (int64_t b = 0; b * bs < rg.max_count; ++b) {
          float* m = mass_row + P.block_at(rg.row, b) * bs;
          const int64_t valid = std::min(bs, rg.max_count - b * bs);
          for (int64_t o = 0; o < valid; ++o) m[o] += added[b * bs + o];
        }
      }
    }
  });
}

template <typename elem_t>
void dispatch_layout(const Problem& P, const at::Tensor& kv_cache,
                     const std::vector<RowGroup>& groups, const std::vector<int64_t>& order,
                     bool rows_share_blocks) {
  const elem_t* cache = static_cast<const elem_t*>(kv_cache.const_data_ptr());
  const PageGeometry& g = P.g;
  if (g.tiled) {
    const int64_t kp = g.key_pack, vp = g.value_pack;
    if (kp == 1 && vp == 1) {
      return run<elem_t, TiledPage<elem_t, 1, 1>>(P, cache, groups, order, rows_share_blocks);
    }
    if (kp == 2 && vp == 2) {
      return run<elem_t, TiledPage<elem_t, 2, 2>>(P, cache, groups, order, rows_share_blocks);
    }
    if (kp == 1 && vp == 2) {
      return run<elem_t, TiledPage<elem_t, 1, 2>>(P, cache, groups, order, rows_share_blocks);
    }
    if (kp == 2 && vp == 1) {
      return run<elem_t, TiledPage<elem_t, 2, 1>>(P, cache, groups, order, rows_share_blocks);
    }
  }
  run<elem_t, MappedPage<elem_t>>(P, cache, groups, order, rows_share_blocks);
}

// ---- validation --------------------------------------------------------------------------------

bool is_float_type(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

// The shared checks, then the tiled kernels here need whole 16-token chunks of a K tile.
PageGeometry attention_geometry(const at::Tensor& kv_cache, const at::Tensor& key_offsets,
                                const at::Tensor& value_offsets, c10::IntArrayRef tiling) {
  PageGeometry g = make_geometry(kv_cache, key_offsets, value_offsets, tiling);
  g.tiled = g.tiled && g.key_tile % kTokenChunk == 0 && g.key_pack <= 2 && g.value_pack <= 2;
  return g;
}

void check_rows_tensor(const at::Tensor& t, const char* name, int64_t n) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.is_contiguous() &&
                  t.dim() == 1 && t.size(0) == n,
              "kvprune.attention_mass: ", name, " must be a contiguous int64 CPU tensor [N=", n,
              "], got ", t.scalar_type(), " ", t.sizes());
}

}  // namespace

void attention_mass(const at::Tensor& query, const at::Tensor& kv_cache,
                    const at::Tensor& block_table, const at::Tensor& query_rows,
                    const at::Tensor& key_counts, double scale, const at::Tensor& mass,
                    const std::optional<at::Tensor>& output, const at::Tensor& key_offsets,
                    const at::Tensor& value_offsets, c10::IntArrayRef tiling, double softcap) {
  Problem P;
  P.g = attention_geometry(kv_cache, key_offsets, value_offsets, tiling);
  const PageGeometry& g = P.g;
  const int64_t H = g.num_heads, D = g.head_size, bs = g.block_size;

  TORCH_CHECK(query.device().is_cpu() && query.dim() == 3 && query.size(2) == D,
              "kvprune.attention_mass: query must be a CPU tensor [N, num_heads, head_size=", D,
              "], got ", query.sizes());
  TORCH_CHECK(is_float_type(query.scalar_type()),
              "kvprune.attention_mass: query dtype must be float32, bfloat16 or float16, got ",
              query.scalar_type());
  TORCH_CHECK(query.stride(2) == 1 || D == 1,
              "kvprune.attention_mass: query must have a contiguous last dimension");
  const int64_t N = query.size(0), Hq = query.size(1);
  TORCH_CHECK(Hq > 0 && Hq % H == 0, "kvprune.attention_mass: query heads (", Hq,
              ") must be a positive multiple of the cache's KV heads (", H, ")");
  P.num_queries = N;
  P.group = Hq / H;
  P.scale = static_cast<float>(scale);
  TORCH_CHECK(softcap >= 0.0, "kvprune.attention_mass: softcap must be >= 0 (0: none), got ", softcap);
  P.softcap = static_cast<float>(softcap);
  P.query = static_cast<const char*>(query.const_data_ptr());
  P.query_type = query.scalar_type();
  P.query_stride0 = query.stride(0);
  P.query_stride1 = query.stride(1);

  TORCH_CHECK(block_table.device().is_cpu() && block_table.dim() == 2 &&
                  (block_table.scalar_type() == at::kInt || block_table.scalar_type() == at::kLong),
              "kvprune.attention_mass: block_table must be an int32 or int64 CPU tensor "
              "[rows, max_blocks], got ",
              block_table.scalar_type(), " ", block_table.sizes());
  const int64_t num_rows = block_table.size(0), max_blocks = block_table.size(1);
  P.table = static_cast<const char*>(block_table.const_data_ptr());
  P.table_is_long = block_table.scalar_type() == at::kLong;
  P.table_stride0 = block_table.stride(0);
  P.table_stride1 = block_table.stride(1);

  check_rows_tensor(query_rows, "query_rows", N);
  check_rows_tensor(key_counts, "key_counts", N);
  const int64_t* rows = query_rows.const_data_ptr<int64_t>();
  P.counts = key_counts.const_data_ptr<int64_t>();

  TORCH_CHECK(mass.device().is_cpu() && mass.scalar_type() == at::kFloat &&
                  mass.is_contiguous() && mass.dim() == 2 && mass.size(0) == H &&
                  mass.size(1) == g.num_slots,
              "kvprune.attention_mass: mass must be a contiguous float32 CPU tensor "
              "[num_kv_heads=", H, ", num_blocks*block_size=", g.num_slots, "], got ",
              mass.scalar_type(), " ", mass.sizes());
  P.mass = mass.data_ptr<float>();

  P.output = nullptr;
  P.output_type = at::kFloat;
  P.output_stride0 = P.output_stride1 = 0;
  if (output.has_value()) {
    const at::Tensor& out = *output;
    TORCH_CHECK(out.device().is_cpu() && out.dim() == 3 && out.size(0) == N &&
                    out.size(1) == Hq && out.size(2) == D,
                "kvprune.attention_mass: output must be a CPU tensor [N=", N, ", num_heads=", Hq,
                ", head_size=", D, "], got ", out.sizes());
    TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == query.scalar_type(),
                "kvprune.attention_mass: output dtype must be float32 or the query dtype (",
                query.scalar_type(), "), got ", out.scalar_type());
    TORCH_CHECK(out.stride(2) == 1 || D == 1,
                "kvprune.attention_mass: output must have a contiguous last dimension");
    P.output = static_cast<char*>(out.data_ptr());
    P.output_type = out.scalar_type();
    P.output_stride0 = out.stride(0);
    P.output_stride1 = out.stride(1);
  }

  // Group the queries by row (stable: a row's queries run in their given order).
  std::vector<int64_t> order(N);
  for (int64_t i = 0; i < N; ++i) {
    TORCH_CHECK(rows[i] >= 0 && rows[i] < num_rows, "kvprune.attention_mass: query_rows[", i,
                "] = ", rows[i], " is not a row of block_table (", num_rows, " rows)");
    TORCH_CHECK(P.counts[i] >= 0 && P.counts[i] <= max_blocks * bs,
                "kvprune.attention_mass: key_counts[", i, "] = ", P.counts[i],
                " is outside 0..max_blocks*block_size = ", max_blocks * bs);
    order[i] = i;
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return rows[a] < rows[b]; });
  std::vector<RowGroup> groups;
  std::vector<std::pair<int64_t, int64_t>> used;  // (block, row) of every block a row reads
  for (int64_t k = 0; k < N;) {
    RowGroup rg{rows[order[k]], k, k, 0, 0};
    int64_t max_count = 0;
    for (; k < N && rows[order[k]] == rg.row; ++k) {
      max_count = std::max(max_count, P.counts[order[k]]);
      rg.macs += P.counts[order[k]] * Hq * D;
    }
    rg.end = k;
    rg.max_count = max_count;
    for (int64_t b = 0; b < (max_count + bs - 1) / bs; ++b) {
      const int64_t block = P.block_at(rg.row, b);
      TORCH_CHECK(block >= 0 && block < kv_cache.size(0), "kvprune.attention_mass: block_table[",
                  rg.row, ", ", b, "] = ", block, " is not a cache block (", kv_cache.size(0),
                  " blocks)");
      used.emplace_back(block, rg.row);
    }
    groups.push_back(rg);
  }
  std::sort(used.begin(), used.end());
  bool rows_share_blocks = false;
  for (size_t k = 1; k < used.size() && !rows_share_blocks; ++k) {
    rows_share_blocks = used[k].first == used[k - 1].first && used[k].second != used[k - 1].second;
  }
  if (groups.empty()) return;

  switch (kv_cache.scalar_type()) {
    case at::kFloat:
      dispatch_layout<float>(P, kv_cache, groups, order, rows_share_blocks);
      break;
    case at::kBFloat16:
      dispatch_layout<c10::BFloat16>(P, kv_cache, groups, order, rows_share_blocks);
      break;
    default:
      dispatch_layout<c10::Half>(P, kv_cache, groups, order, rows_share_blocks);
  }
}

}  // namespace kvprune
