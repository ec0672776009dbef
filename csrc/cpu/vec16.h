// Vec16: 16 fp32 lanes as one AVX-512 register or two AVX2 ones (AVX2 with FMA and F16C), so a
// kernel is written once for both; each operation is the single AVX-512 intrinsic, or the same
// on each AVX2 half. Tail: the first n lanes (masked loads and stores, max and add that leave
// the other lanes of the accumulator as they were). Loads convert bf16 and fp16 to fp32.
// Without either ISA, KVPRUNE_HAS_VEC16 is 0 and callers keep their portable loops.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX512F__) || defined(__AVX2__)
// GCC 12's AVX-512 headers initialise vectors from themselves (`__m512 __Y = __Y;`) and warn
// about it in every function that inlines them (false positives, reported at the header's
// lines, so a push/pop around the include does not reach them): off for the including file.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>
#endif

namespace kvprune {

#if defined(__AVX512F__)
#define KVPRUNE_HAS_VEC16 1
constexpr int kVec16Registers = 1;

struct Vec16 {
  __m512 v;
};
struct Tail {
  __mmask16 m;
};
inline Tail make_tail(int64_t n) { return {static_cast<__mmask16>((1u << n) - 1)}; }
inline Vec16 vzero() { return {_mm512_setzero_ps()}; }
inline Vec16 vset1(float x) { return {_mm512_set1_ps(x)}; }
inline Vec16 vload(const float* src) { return {_mm512_loadu_ps(src)}; }
inline Vec16 vload(const c10::BFloat16* src) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16))};
}
inline Vec16 vload(const c10::Half* src) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)))};
}
inline void vstore(float* dst, Vec16 x) { _mm512_storeu_ps(dst, x.v); }
inline Vec16 vload_tail(const float* src, Tail t) { return {_mm512_maskz_loadu_ps(t.m, src)}; }
inline void vstore_tail(float* dst, Vec16 x, Tail t) { _mm512_mask_storeu_ps(dst, t.m, x.v); }
inline Vec16 vmax_tail(Vec16 acc, Vec16 x, Tail t) { return {_mm512_mask_max_ps(acc.v, t.m, acc.v, x.v)}; }
inline Vec16 vadd_tail(Vec16 acc, Vec16 x, Tail t) { return {_mm512_mask_add_ps(acc.v, t.m, acc.v, x.v)}; }
inline Vec16 vfmadd(Vec16 a, Vec16 b, Vec16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec16 vfnmadd(Vec16 a, Vec16 b, Vec16 c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }
inline Vec16 vadd(Vec16 a, Vec16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vec16 vsub(Vec16 a, Vec16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Vec16 vmul(Vec16 a, Vec16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vec16 vmax(Vec16 a, Vec16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline float vreduce_add(Vec16 x) { return _mm512_reduce_add_ps(x.v); }
inline float vreduce_max(Vec16 x) { return _mm512_reduce_max_ps(x.v); }
inline Vec16 vfloor(Vec16 x) { return {_mm512_roundscale_ps(x.v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)}; }
// 2^k for whole-valued k (the exponent field of each lane).
inline Vec16 vexp2_int(Vec16 k) {
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k.v), _mm512_set1_epi32(127)), 23))};
}
// A pair of fp32 values repeated over the lanes.
inline Vec16 vset_pair(const float* src) {
  double pair;
  std::memcpy(&pair, src, sizeof(pair));
  return {_mm512_castpd_ps(_mm512_set1_pd(pair))};
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVPRUNE_HAS_VEC16 1
constexpr int kVec16Registers = 2;

struct Vec16 {
  __m256 lo, hi;
};
struct Tail {
  __m256i lo, hi;  // lane i active: all ones
};
inline Tail make_tail(int64_t n) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i count = _mm256_set1_epi32(static_cast<int>(n));
  return {_mm256_cmpgt_epi32(count, lane), _mm256_cmpgt_epi32(count, _mm256_add_epi32(lane, _mm256_set1_epi32(8)))};
}
inline Vec16 vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Vec16 vset1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline Vec16 vload(const float* src) { return {_mm256_loadu_ps(src), _mm256_loadu_ps(src + 8)}; }
inline __m256 bf16x8(const c10::BFloat16* src) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline Vec16 vload(const c10::BFloat16* src) { return {bf16x8(src), bf16x8(src + 8)}; }
inline Vec16 vload(const c10::Half* src) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 8)))};
}
inline void vstore(float* dst, Vec16 x) {
  _mm256_storeu_ps(dst, x.lo);
  _mm256_storeu_ps(dst + 8, x.hi);
}
inline Vec16 vload_tail(const float* src, Tail t) {
  return {_mm256_maskload_ps(src, t.lo), _mm256_maskload_ps(src + 8, t.hi)};
}
inline void vstore_tail(float* dst, Vec16 x, Tail t) {
  _mm256_maskstore_ps(dst, t.lo, x.lo);
  _mm256_maskstore_ps(dst + 8, t.hi, x.hi);
}
inline Vec16 vmax_tail(Vec16 acc, Vec16 x, Tail t) {
  return {_mm256_blendv_ps(acc.lo, _mm256_max_ps(acc.lo, x.lo), _mm256_castsi256_ps(t.lo)),
          _mm256_blendv_ps(acc.hi, _mm256_max_ps(acc.hi, x.hi), _mm256_castsi256_ps(t.hi))};
}
inline Vec16 vadd_tail(Vec16 acc, Vec16 x, Tail t) {
  return {_mm256_blendv_ps(acc.lo, _mm256_add_ps(acc.lo, x.lo), _mm256_castsi256_ps(t.lo)),
          _mm256_blendv_ps(acc.hi, _mm256_add_ps(acc.hi, x.hi), _mm256_castsi256_ps(t.hi))};
}
inline Vec16 vfmadd(Vec16 a, Vec16 b, Vec16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline Vec16 vfnmadd(Vec16 a, Vec16 b, Vec16 c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline Vec16 vadd(Vec16 a, Vec16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline Vec16 vsub(Vec16 a, Vec16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline Vec16 vmul(Vec16 a, Vec16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Vec16 vmax(Vec16 a, Vec16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline float vreduce_add(Vec16 x) {
  const __m256 s = _mm256_add_ps(x.lo, x.hi);
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}
inline float vreduce_max(Vec16 x) {
  const __m256 s = _mm256_max_ps(x.lo, x.hi);
  __m128 q = _mm_max_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  q = _mm_max_ps(q, _mm_movehl_ps(q, q));
  q = _mm_max_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}
inline Vec16 vfloor(Vec16 x) {
  return {_mm256_round_ps(x.lo, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC),
          _mm256_round_ps(x.hi, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)};
}
inline __m256 exp2_int8(__m256 k) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23));
}
inline Vec16 vexp2_int(Vec16 k) { return {exp2_int8(k.lo), exp2_int8(k.hi)}; }
inline Vec16 vset_pair(const float* src) {
  double pair;
  std::memcpy(&pair, src, sizeof(pair));
  const __m256 v = _mm256_castpd_ps(_mm256_set1_pd(pair));
  return {v, v};
}
#else
#define KVPRUNE_HAS_VEC16 0
#endif

#if KVPRUNE_HAS_VEC16
// Written once against the operations above, for every kernel's softmax.
// exp(x) for x <= 0 (softmax after the max is taken out): x = k ln2 + r, e^r by a degree-7
// polynomial, 2^k written into the exponent bits.
inline Vec16 vexp_nonpositive(Vec16 x) {
  x = vmax(x, vset1(-87.0f));
  const Vec16 k = vfloor(vfmadd(x, vset1(1.44269504088896341f), vset1(0.5f)));
  Vec16 r = vfnmadd(k, vset1(0.693359375f), x);
  r = vfmadd(k, vset1(2.12194440e-4f), r);
  Vec16 p = vset1(1.9875691500e-4f);
  p = vfmadd(p, r, vset1(1.3981999507e-3f));
  p = vfmadd(p, r, vset1(8.3334519073e-3f));
  p = vfmadd(p, r, vset1(4.1665795894e-2f));
  p = vfmadd(p, r, vset1(1.6666665459e-1f));
  p = vfmadd(p, r, vset1(5.0000001201e-1f));
  p = vfmadd(vmul(p, r), r, vadd(r, vset1(1.0f)));
  return vmul(p, vexp2_int(k));
}

// In-place softmax of l[0..n).
inline void vsoftmax(float* l, int64_t n) {
  const int64_t full = n / 16 * 16;
  const bool has_tail = n > full;
  const Tail tail = make_tail(n - full);
  Vec16 vmax_logit = vset1(-std::numeric_limits<float>::infinity());
  for (int64_t o = 0; o < full; o += 16) vmax_logit = vmax(vmax_logit, vload(l + o));
  if (has_tail) vmax_logit = vmax_tail(vmax_logit, vload_tail(l + full, tail), tail);
  const Vec16 max_logit = vset1(vreduce_max(vmax_logit));
  Vec16 vsum = vzero();
  for (int64_t o = 0; o < full; o += 16) {
    const Vec16 e = vexp_nonpositive(vsub(vload(l + o), max_logit));
    vstore(l + o, e);
    vsum = vadd(vsum, e);
  }
  if (has_tail) {
    const Vec16 e = vexp_nonpositive(vsub(vload_tail(l + full, tail), max_logit));
    vstore_tail(l + full, e, tail);
    vsum = vadd_tail(vsum, e, tail);
  }
  const Vec16 inverse = vset1(1.0f / vreduce_add(vsum));
  for (int64_t o = 0; o < full; o += 16) vstore(l + o, vmul(vload(l + o), inverse));
  if (has_tail) vstore_tail(l + full, vmul(vload_tail(l + full, tail), inverse), tail);
}
#endif

}  // namespace kvprune
