// FDC's attention in the reduced space: each KV head of a layer holds its own number of
// dimensions for K (its Q/K rank) and for V (its V rank), so a head of rank 20 costs 20 dims,
// not the model's head size.
//
// Cache: [num_blocks, block_size * W] (W >= the sum of all heads' K and V ranks). Inside a
// block, head h's keys are stored dims-major, key dim d of the block's token jj at
// block_size * (k_offsets[h] + d) + jj, so one dim of a whole block is contiguous and the
// logits of a block are block_size-wide FMAs with no horizontal sums; its values are stored
// token-major, dim d of token jj at block_size * v_offsets[h] + jj * v_ranks[h] + d, so a
// token's value is one contiguous vector for the weighted sum.
// Queries arrive already projected, [T, Hq, QW] (query head q uses the first k_ranks[q / G]
// dims); outputs leave reduced, [T, Hq, VW] fp32 (the first v_ranks[q / G] dims are set, the
// rest zeroed), for the caller to turn back.
//
// One task is one (sequence, KV head): its G query heads over all of the sequence's query
// tokens (causal: query i of n_q sees the first seq_len - n_q + i + 1 keys), in tiles of
// consecutive queries (about 16 rows of query x group) so a prefill reads each key once per
// tile, not once per query; up to 8 rows share every key and value vector loaded. A decode
// task (one query, a group of up to 8 rows) instead reads each block's keys and values in one
// pass with an online softmax (its key and value spans are adjacent): 13-17% faster at full
// width than a logits pass and then a value pass, about the same at half width. Heads of unequal
// rank make tasks of unequal cost, so the tasks are dealt to threads longest first, each to
// the thread with the least work so far (FDC §5.3's decode schedule, longest-processing-time
// first); `balanced = false` deals them in order, in equal-count chunks, for comparison.
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <limits>
#include <numeric>
#include <vector>

#include "reduced_attention.h"
#include "vec16.h"

namespace kvprune {
namespace {

struct Task {
  int64_t sequence;
  int64_t head;
  double cost;
};

template <typename T>
inline float to_float(T value) {
  return static_cast<float>(value);
}

// bf16 is the top half of an fp32: a shift the compiler vectorises (c10's conversion
// function does not get vectorised inside these loops).
inline float bits_to_float(uint16_t bits) {
  uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof(value));
  return value;
}

// A row's `dims` values as fp32 in `out` (vectorised).
template <typename T>
inline void load_row(const T* row, float* out, int64_t dims) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const uint16_t* raw = reinterpret_cast<const uint16_t*>(row);
#pragma omp simd
    for (int64_t d = 0; d < dims; ++d) out[d] = bits_to_float(raw[d]);
  } else {
    for (int64_t d = 0; d < dims; ++d) out[d] = to_float(row[d]);
  }
}

// exp(x) for x <= 0 (softmax after the max is taken out), in a form the compiler
// vectorises: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial
// (relative error below 2e-7 there), 2^n written into the exponent bits.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // below this e^x is under float's normal range: treat as ~0
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693147180559945309f;
  float p = 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t exponent = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &exponent, sizeof(scale));
  return p * scale;
}

// In place: scores -> softmax(scores). With Vec16 the shared vector form (GCC leaves the
// portable loop's max reduction scalar: it was a sixth of a decode step).
inline void softmax(float* scores, int64_t count) {
#if KVPRUNE_HAS_VEC16
  vsoftmax(scores, count);
#else
  float peak = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : peak)
  for (int64_t j = 0; j < count; ++j) peak = std::max(peak, scores[j]);
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t j = 0; j < count; ++j) {
    scores[j] = exp_nonpositive(scores[j] - peak);
    total += scores[j];
  }
  const float inverse = 1.f / total;
#pragma omp simd
  for (int64_t j = 0; j < count; ++j) scores[j] *= inverse;
#endif
}

// Register blocking: 32 lanes (two AVX-512 vectors of fp32, a whole cache line of bf16
// keys) times up to 8 query rows (4 on AVX2, whose 16 registers hold 4 rows of 32 lanes),
// accumulated over a whole reduction before anything is stored: each key or value vector
// loaded serves that many rows.
constexpr int64_t kLanes = 32;
#if KVPRUNE_HAS_VEC16
constexpr int64_t kRowsPerPass = kVec16Registers == 1 ? 8 : 4;
#else
constexpr int64_t kRowsPerPass = 8;
#endif
// Query rows a task handles together in a prefill: consecutive queries x the group, so a
// sequence's keys are read once per tile instead of once per query.
constexpr int64_t kTileRows = 16;

// Blocks read ahead of the one being computed. A task reads one head's slice of each block
// (a few KB, then a jump over the other heads'), which the hardware prefetcher does not follow
// far enough: without this, loads waiting on memory were most of a decode step's time.
constexpr int64_t kPrefetchBlocks = 2;

// Asks for the `count` elements at `src` to be brought into cache, one request per line.
template <typename T>
inline void prefetch_span(const T* src, int64_t count) {
  const char* bytes = reinterpret_cast<const char*>(src);
  for (int64_t offset = 0; offset < count * static_cast<int64_t>(sizeof(T)); offset += 64)
    __builtin_prefetch(bytes + offset);
}

// The first `count` (<= kLanes) lanes are the values at `src`. Lanes past `count` hold
// whatever follows in the cache (the next token or head): every lane is independent and only
// the first `count` are ever stored, so a whole vector is loaded unless it would run past the
// cache's `end`.
template <typename T>
inline void load_lanes(const T* src, int64_t count, const T* end, float* lanes) {
  if (src + kLanes <= end) {
    load_row(src, lanes, kLanes);
    return;
  }
  for (int64_t l = 0; l < kLanes; ++l) lanes[l] = l < count ? to_float(src[l]) : 0.f;
}

#if KVPRUNE_HAS_VEC16
// The passes below with their accumulators in registers: 32 lanes as two Vec16 per row (GCC
// keeps the portable loops' float arrays on the stack, a load and a store around every FMA).
// Every cache dtype but double.
template <typename T>
constexpr bool kVectorPasses = !std::is_same_v<T, double>;

struct Lanes {
  Vec16 lo, hi;
};

template <typename T>
inline Lanes load_vectors(const T* src, int64_t count, const T* end) {
  if (src + kLanes <= end) return {vload(src), vload(src + 16)};
  float lanes[kLanes];
  load_lanes(src, count, end, lanes);
  return {vload(lanes), vload(lanes + 16)};
}

// The first `count` lanes of `acc` at `dst`.
inline void store_lanes(const Vec16* acc, int64_t count, float* dst) {
  if (count == kLanes) {
    vstore(dst, acc[0]);
    vstore(dst + 16, acc[1]);
    return;
  }
  float lanes[kLanes];
  vstore(lanes, acc[0]);
  vstore(lanes + 16, acc[1]);
  std::memcpy(dst, lanes, count * sizeof(float));
}
#else
template <typename T>
constexpr bool kVectorPasses = false;
#endif

// ROWS rows of logits: logits[r][l] = q_r . key_l for `count` keys whose dim d sits at
// keys[d * stride + l]; queries [ROWS, k_rank].
template <int ROWS, typename T>
inline void logits_pass(const float* queries, int64_t k_rank, const T* keys, int64_t stride, int64_t count,
                        const T* end, float* logits, int64_t logits_stride) {
#if KVPRUNE_HAS_VEC16
  if constexpr (kVectorPasses<T>) {
    Vec16 acc[ROWS][2];
    for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = vzero();
    for (int64_t d = 0; d < k_rank; ++d) {
      const Lanes key = load_vectors(keys + d * stride, count, end);
      for (int r = 0; r < ROWS; ++r) {
        const Vec16 q = vset1(queries[r * k_rank + d]);
        acc[r][0] = vfmadd(q, key.lo, acc[r][0]);
        acc[r][1] = vfmadd(q, key.hi, acc[r][1]);
      }
    }
    for (int r = 0; r < ROWS; ++r) store_lanes(acc[r], count, logits + r * logits_stride);
    return;
  }
#endif
  float acc[ROWS][kLanes] = {};
  float lanes[kLanes];
  for (int64_t d = 0; d < k_rank; ++d) {
    load_lanes(keys + d * stride, count, end, lanes);
    for (int r = 0; r < ROWS; ++r) {
      const float q = queries[r * k_rank + d];
#pragma omp simd
      for (int64_t l = 0; l < kLanes; ++l) acc[r][l] += q * lanes[l];
    }
  }
  for (int r = 0; r < ROWS; ++r) std::memcpy(logits + r * logits_stride, acc[r], count * sizeof(float));
}

// ROWS rows of outputs: out_r[d] = sum_j weights[r][j] value_j[d] over `num_keys` keys, `dims`
// (<= kLanes) dims. Key j sits in block blocks[j / block_size] at `first_value` + its place in
// the block times `value_stride`: the keys are walked block by block, so no key costs a
// division (one per key was a measurable share of a decode step).
template <int ROWS, typename T>
inline void values_pass(const float* weights, int64_t weights_stride, int64_t num_keys, int64_t dims, const T* cache,
                        const int32_t* blocks, int64_t block_size, int64_t block_stride, int64_t first_value,
                        int64_t value_stride, const T* end, float* const* out) {
  float acc[ROWS][kLanes] = {};
  float lanes[kLanes];
#if KVPRUNE_HAS_VEC16
  Vec16 vector_acc[ROWS][2];
  for (int r = 0; r < ROWS; ++r) vector_acc[r][0] = vector_acc[r][1] = vzero();
#endif
  const int64_t num_blocks = (num_keys + block_size - 1) / block_size;
  for (int64_t block_start = 0; block_start < num_keys; block_start += block_size) {
    const int64_t block = block_start / block_size;
    if (block + kPrefetchBlocks < num_blocks)
      prefetch_span(cache + static_cast<int64_t>(blocks[block + kPrefetchBlocks]) * block_stride + first_value,
                    block_size * value_stride);
    const T* value = cache + static_cast<int64_t>(blocks[block]) * block_stride + first_value;
    const int64_t block_end = std::min(num_keys, block_start + block_size);
#if KVPRUNE_HAS_VEC16
    if constexpr (kVectorPasses<T>) {
      for (int64_t j = block_start; j < block_end; ++j, value += value_stride) {
        const Lanes lanes_j = load_vectors(value, dims, end);
        for (int r = 0; r < ROWS; ++r) {
          const Vec16 weight = vset1(weights[r * weights_stride + j]);
          vector_acc[r][0] = vfmadd(weight, lanes_j.lo, vector_acc[r][0]);
          vector_acc[r][1] = vfmadd(weight, lanes_j.hi, vector_acc[r][1]);
        }
      }
      continue;
    }
#endif
    for (int64_t j = block_start; j < block_end; ++j, value += value_stride) {
      load_lanes(value, dims, end, lanes);
      for (int r = 0; r < ROWS; ++r) {
        const float weight = weights[r * weights_stride + j];
#pragma omp simd
        for (int64_t l = 0; l < kLanes; ++l) acc[r][l] += weight * lanes[l];
      }
    }
  }
#if KVPRUNE_HAS_VEC16
  if constexpr (kVectorPasses<T>) {
    for (int r = 0; r < ROWS; ++r) store_lanes(vector_acc[r], dims, out[r]);
    return;
  }
#endif
  for (int r = 0; r < ROWS; ++r) std::memcpy(out[r], acc[r], dims * sizeof(float));
}

#if KVPRUNE_HAS_VEC16
// A decode task (one query token, ROWS = its GQA group's query heads) in one pass over the
// blocks: each block's keys, then at once its values, with a running max and sum per row
// (online softmax), so a block's key and value spans are read together (they are adjacent:
// PackedHeads packs each head's keys, then its values) and no logits row is kept.
// `acc` holds ROWS x `width` fp32 (v_rank rounded up to kLanes).
template <int ROWS, typename T>
void decode_one_pass(const float* queries, int64_t k_rank, int64_t v_rank, const T* cache, const int32_t* blocks,
                     int64_t block_size, int64_t block_stride, int64_t key_base, int64_t value_base,
                     int64_t num_keys, const T* end, float* const* out, std::vector<float>& scratch) {
  const int64_t width = (v_rank + kLanes - 1) / kLanes * kLanes;
  scratch.assign(ROWS * width, 0.f);
  float* acc = scratch.data();
  float running_max[ROWS];
  Vec16 running_sum[ROWS];  // per lane: summed over the rows' chunks, reduced once at the end
  for (int r = 0; r < ROWS; ++r) running_max[r] = -std::numeric_limits<float>::infinity(), running_sum[r] = vzero();
  alignas(64) float weights[ROWS][kLanes];
  const int64_t num_blocks = (num_keys + block_size - 1) / block_size;
  for (int64_t block = 0; block < num_blocks; ++block) {
    if (block + kPrefetchBlocks < num_blocks) {
      const T* ahead = cache + static_cast<int64_t>(blocks[block + kPrefetchBlocks]) * block_stride;
      prefetch_span(ahead + key_base, k_rank * block_size);
      prefetch_span(ahead + value_base, v_rank * block_size);
    }
    const T* block_start = cache + static_cast<int64_t>(blocks[block]) * block_stride;
    const int64_t block_end = std::min(num_keys, (block + 1) * block_size);
    for (int64_t start = block * block_size; start < block_end; start += kLanes) {
      const int64_t count = std::min(kLanes, block_end - start), in_block = start - block * block_size;
      logits_pass<ROWS>(queries, k_rank, block_start + key_base + in_block, block_size, count, end, &weights[0][0],
                        kLanes);
      for (int r = 0; r < ROWS; ++r) {
        if (count < kLanes) std::fill(weights[r] + count, weights[r] + kLanes, -std::numeric_limits<float>::infinity());
        Vec16 lo = vload(weights[r]), hi = vload(weights[r] + 16);
        const float new_max = std::max(running_max[r], vreduce_max(vmax(lo, hi)));
        // ~1e-38 on the first chunk, where the sums are still 0.
        const float rescale = exp_nonpositive(running_max[r] - new_max);
        const Vec16 shift = vset1(new_max);
        lo = vexp_nonpositive(vsub(lo, shift));
        hi = vexp_nonpositive(vsub(hi, shift));
        vstore(weights[r], lo);
        vstore(weights[r] + 16, hi);
        if (count < kLanes) {
          std::fill(weights[r] + count, weights[r] + kLanes, 0.f);
          lo = vload(weights[r]), hi = vload(weights[r] + 16);
        }
        running_sum[r] = vfmadd(running_sum[r], vset1(rescale), vadd(lo, hi));
        running_max[r] = new_max;
        if (rescale != 1.f) {
          const Vec16 factor = vset1(rescale);
          for (int64_t d = 0; d < width; d += 16) vstore(acc + r * width + d, vmul(vload(acc + r * width + d), factor));
        }
      }
      const T* values = block_start + value_base + in_block * v_rank;
      for (int64_t d0 = 0; d0 < v_rank; d0 += kLanes) {
        const int64_t dims = std::min(kLanes, v_rank - d0);
        Vec16 sums[ROWS][2];
        for (int r = 0; r < ROWS; ++r) {
          sums[r][0] = vload(acc + r * width + d0);
          sums[r][1] = vload(acc + r * width + d0 + 16);
        }
        const T* value = values + d0;
        for (int64_t j = 0; j < count; ++j, value += v_rank) {
          const Lanes lanes_j = load_vectors(value, dims, end);
          for (int r = 0; r < ROWS; ++r) {
            const Vec16 weight = vset1(weights[r][j]);
            sums[r][0] = vfmadd(weight, lanes_j.lo, sums[r][0]);
            sums[r][1] = vfmadd(weight, lanes_j.hi, sums[r][1]);
          }
        }
        for (int r = 0; r < ROWS; ++r) {
          vstore(acc + r * width + d0, sums[r][0]);
          vstore(acc + r * width + d0 + 16, sums[r][1]);
        }
      }
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    const float inverse = 1.f / vreduce_add(running_sum[r]);
    for (int64_t d = 0; d < v_rank; ++d) out[r][d] = acc[r * width + d] * inverse;
  }
}
#endif

// Runs `pass<ROWS>()` for ROWS = rows (1..kRowsPerPass), unrolled at compile time.
template <typename Pass>
inline void with_rows(int64_t rows, const Pass& pass) {
  switch (rows) {
    case 1: pass(std::integral_constant<int, 1>{}); break;
    case 2: pass(std::integral_constant<int, 2>{}); break;
    case 3: pass(std::integral_constant<int, 3>{}); break;
    case 4: pass(std::integral_constant<int, 4>{}); break;
    case 5: pass(std::integral_constant<int, 5>{}); break;
    case 6: pass(std::integral_constant<int, 6>{}); break;
    case 7: pass(std::integral_constant<int, 7>{}); break;
    default: pass(std::integral_constant<int, 8>{}); break;
  }
}

// Each thread's task list: longest first to the least loaded (balanced), or in order.
std::vector<std::vector<Task>> deal(std::vector<Task> tasks, int64_t threads, bool balanced) {
  std::vector<std::vector<Task>> lists(threads);
  if (!balanced) {
    const int64_t per_thread = (static_cast<int64_t>(tasks.size()) + threads - 1) / threads;
    for (size_t i = 0; i < tasks.size(); ++i) lists[i / per_thread].push_back(tasks[i]);
    return lists;
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  std::vector<double> load(threads, 0.0);
  for (const Task& task : tasks) {
    const int64_t least = std::min_element(load.begin(), load.end()) - load.begin();
    lists[least].push_back(task);
    load[least] += task.cost;
  }
  // The deal fixes each thread's load; its order is free. Sequence by sequence, a thread reads
  // the KV heads of one block one after another: the same pages, in a row, for the prefetcher.
  for (auto& list : lists) {
    std::sort(list.begin(), list.end(), [](const Task& a, const Task& b) {
      return a.sequence != b.sequence ? a.sequence < b.sequence : a.head < b.head;
    });
  }
  return lists;
}

template <typename T>
void run_task(const Task& task, const T* cache, int64_t block_size, int64_t block_stride, const int32_t* block_table,
              int64_t table_width, const int32_t* query_start_loc, const int32_t* seq_lens, const int32_t* k_ranks,
              const int32_t* v_ranks, const int64_t* k_offsets, const int64_t* v_offsets, const T* query,
              const T* cache_end, int64_t num_q_heads, int64_t query_width, float* output, int64_t output_width,
              int64_t group, float scale,
              std::vector<float>& logits, std::vector<float>& query_row) {
  const int64_t s = task.sequence, h = task.head;
  const int64_t first = query_start_loc[s], num_queries = query_start_loc[s + 1] - first;
  const int64_t seq_len = seq_lens[s], k_rank = k_ranks[h], v_rank = v_ranks[h];
  const int64_t key_base = block_size * k_offsets[h], value_base = block_size * v_offsets[h];
  const int32_t* blocks = block_table + s * table_width;
  std::vector<float*> outputs;
  // Rows r of queries i0.. (query i0 + r / group, group member r % group): scaled queries in
  // `query_row`, their zeroed outputs in `outputs`.
  auto prepare_rows = [&](int64_t i0, int64_t rows) {
    query_row.resize(rows * k_rank);
    outputs.resize(rows);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t t = first + i0 + r / group, q_head = h * group + r % group;
      const T* q = query + (t * num_q_heads + q_head) * query_width;
      for (int64_t d = 0; d < k_rank; ++d) query_row[r * k_rank + d] = to_float(q[d]) * scale;
      outputs[r] = output + (t * num_q_heads + q_head) * output_width;
      std::fill(outputs[r], outputs[r] + output_width, 0.f);
    }
  };
#if KVPRUNE_HAS_VEC16
  // A decode (one query) whose group fits one pass's rows: keys and values in one pass.
  if constexpr (kVectorPasses<T>) {
    if (num_queries == 1 && group <= kRowsPerPass) {
      prepare_rows(0, group);
      with_rows(group, [&](auto rows_here) {
        decode_one_pass<decltype(rows_here)::value>(query_row.data(), k_rank, v_rank, cache, blocks, block_size,
                                                    block_stride, key_base, value_base, seq_len, cache_end,
                                                    outputs.data(), logits);
      });
      return;
    }
  }
#endif
  const int64_t tile = std::max<int64_t>(1, kTileRows / group);
  for (int64_t i0 = 0; i0 < num_queries; i0 += tile) {
    // A tile of consecutive queries. Query i sees seq_len - num_queries + i + 1 keys; the tile
    // reads as many as its last.
    const int64_t tile_queries = std::min(tile, num_queries - i0), rows = tile_queries * group;
    const int64_t first_visible = seq_len - num_queries + i0 + 1, num_keys = first_visible + tile_queries - 1;
    logits.assign(rows * num_keys, 0.f);
    prepare_rows(i0, rows);
    // Logits, kLanes keys of a block at a time: a dim of those keys, times up to 8 rows' dim.
    const int64_t num_blocks = (num_keys + block_size - 1) / block_size;
    for (int64_t start = 0; start < num_keys; start += kLanes) {
      const int64_t block = start / block_size;
      if (start % block_size == 0 && block + kPrefetchBlocks < num_blocks)
        prefetch_span(cache + static_cast<int64_t>(blocks[block + kPrefetchBlocks]) * block_stride + key_base,
                      k_rank * block_size);
      const T* keys = cache + static_cast<int64_t>(blocks[block]) * block_stride + key_base + start % block_size;
      const int64_t count = std::min(kLanes, num_keys - start);
      for (int64_t r0 = 0; r0 < rows; r0 += kRowsPerPass) {
        with_rows(std::min(kRowsPerPass, rows - r0), [&](auto rows_here) {
          logits_pass<decltype(rows_here)::value>(&query_row[r0 * k_rank], k_rank, keys, block_size, count, cache_end,
                                                  &logits[r0 * num_keys + start], num_keys);
        });
      }
    }
    // Each row's softmax over the keys it sees; the keys past them weigh 0 in the sum.
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t visible = first_visible + r / group;
      softmax(&logits[r * num_keys], visible);
      std::fill(&logits[r * num_keys + visible], &logits[(r + 1) * num_keys], 0.f);
    }
    // The weighted sum, kLanes value dims at a time over every key, for up to 8 rows.
    for (int64_t d0 = 0; d0 < v_rank; d0 += kLanes) {
      const int64_t dims = std::min(kLanes, v_rank - d0);
      std::vector<float*> shifted(rows);
      for (int64_t r = 0; r < rows; ++r) shifted[r] = outputs[r] + d0;
      for (int64_t r0 = 0; r0 < rows; r0 += kRowsPerPass) {
        with_rows(std::min(kRowsPerPass, rows - r0), [&](auto rows_here) {
          values_pass<decltype(rows_here)::value, T>(&logits[r0 * num_keys], num_keys, num_keys, dims, cache, blocks,
                                                     block_size, block_stride, value_base + d0, v_rank, cache_end,
                                                     &shifted[r0]);
        });
      }
    }
  }
}

}  // namespace

void reduced_attention(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table,
                       const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                       const at::Tensor& k_ranks, const at::Tensor& v_ranks, const at::Tensor& k_offsets,
                       const at::Tensor& v_offsets, int64_t block_size, double scale, at::Tensor& output,
                       bool balanced) {
  TORCH_CHECK(query.dim() == 3 && kv_cache.dim() == 2 && output.dim() == 3, "reduced_attention: query [T, Hq, QW], "
              "kv_cache [blocks, block_size * W], output [T, Hq, VW]");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type(), "reduced_attention: query and cache dtypes differ");
  TORCH_CHECK(output.scalar_type() == at::kFloat, "reduced_attention: output must be float32");
  TORCH_CHECK(query.is_contiguous() && kv_cache.is_contiguous() && output.is_contiguous(),
              "reduced_attention: query, cache and output must be contiguous");
  TORCH_CHECK(block_size % kLanes == 0, "reduced_attention: block_size must be a multiple of ", kLanes);
  const int64_t num_sequences = seq_lens.size(0), num_heads = k_ranks.size(0);
  const int64_t num_q_heads = query.size(1);
  TORCH_CHECK(num_q_heads % num_heads == 0, "reduced_attention: query heads must be a multiple of KV heads");
  const int64_t group = num_q_heads / num_heads;
  auto table = block_table.to(at::kInt).contiguous();
  auto starts = query_start_loc.to(at::kInt).contiguous();
  auto lengths = seq_lens.to(at::kInt).contiguous();
  auto kr = k_ranks.to(at::kInt).contiguous(), vr = v_ranks.to(at::kInt).contiguous();
  auto ko = k_offsets.to(at::kLong).contiguous(), vo = v_offsets.to(at::kLong).contiguous();
  TORCH_CHECK(kr.max().item<int64_t>() <= query.size(2) && vr.max().item<int64_t>() <= output.size(2),
              "reduced_attention: a rank exceeds the query or output width");

  const int32_t *start_of = starts.data_ptr<int32_t>(), *length_of = lengths.data_ptr<int32_t>();
  const int32_t *k_rank_of = kr.data_ptr<int32_t>(), *v_rank_of = vr.data_ptr<int32_t>();
  std::vector<Task> tasks;
  tasks.reserve(num_sequences * num_heads);
  for (int64_t s = 0; s < num_sequences; ++s) {
    // Cost: query tokens x their mean key count x the head's cached width.
    const int64_t num_queries = start_of[s + 1] - start_of[s];
    const double keys = length_of[s] - (num_queries - 1) / 2.0;
    for (int64_t h = 0; h < num_heads; ++h) {
      const double width = k_rank_of[h] + v_rank_of[h];
      tasks.push_back({s, h, num_queries * keys * width});
    }
  }
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks.size()));
  const auto lists = deal(std::move(tasks), threads, balanced);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "reduced_attention", [&] {
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> logits, query_row;  // per-thread scratch
      for (int64_t thread = begin; thread < end; ++thread)
        for (const Task& task : lists[thread])
          run_task<scalar_t>(task, kv_cache.data_ptr<scalar_t>(), block_size, kv_cache.size(1),
                             table.data_ptr<int32_t>(), table.size(1), starts.data_ptr<int32_t>(),
                             lengths.data_ptr<int32_t>(), kr.data_ptr<int32_t>(), vr.data_ptr<int32_t>(),
                             ko.data_ptr<int64_t>(), vo.data_ptr<int64_t>(), query.data_ptr<scalar_t>(),
                             kv_cache.data_ptr<scalar_t>() + kv_cache.numel(), num_q_heads,
                             query.size(2), output.data_ptr<float>(), output.size(2), group,
                             static_cast<float>(scale), logits, query_row);
    });
  });
}

}  // namespace kvprune
