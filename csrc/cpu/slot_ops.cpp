// Batched slot writes, reads and moves for vLLM's CPU paged KV cache (see slot_ops.h).
#include "slot_ops.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "geometry.h"
#include "page_access.h"

namespace kvprune {
namespace {

// Smallest amount of data one parallel task should move. A single thread moves 256 KiB in
// tens of microseconds; a parallel region costs a few microseconds when every OpenMP thread
// has its core, and milliseconds when one of them has to wait for a busy core (measured on a
// shared 2-core VM), so small steps (decode of a few requests) stay on the calling thread.
constexpr int64_t kMinBytesPerTask = 256 * 1024;

// Tokens per parallel work item (one head): one run at most (see page_access.h).
constexpr int64_t kMaxRun = kMaxRunTokens;

int64_t grain_for(int64_t bytes_per_item) {
  return std::max<int64_t>(1, kMinBytesPerTask / std::max<int64_t>(1, bytes_per_item));
}

// The slots of one op call: [n] (shared by all heads) or [n, H] (one per token and head).
struct SlotView {
  const int64_t* data;
  int64_t count;
  int64_t num_heads;
  bool per_head;

  int64_t at(int64_t token, int64_t head) const {
    return per_head ? data[token * num_heads + head] : data[token];
  }
};

// Rows of a [T, H, D] key or value tensor with arbitrary token/head strides.
template <typename elem_t>
struct TokenRows {
  elem_t* base;
  int64_t token_stride;
  int64_t head_stride;

  elem_t* row(int64_t token, int64_t head) const {
    return base + token * token_stride + head * head_stride;
  }
};

template <typename elem_t>
TokenRows<elem_t> rows_of(const at::Tensor& t) {
  return {static_cast<elem_t*>(const_cast<void*>(t.const_data_ptr())), t.stride(0), t.stride(1)};
}

SlotView make_slot_view(const at::Tensor& slots, const PageGeometry& g, const char* name) {
  TORCH_CHECK(slots.device().is_cpu() && slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "kvprune: ", name, " must be a contiguous int64 CPU tensor, got ",
              slots.scalar_type());
  TORCH_CHECK(slots.dim() == 1 || (slots.dim() == 2 && slots.size(1) == g.num_heads), "kvprune: ",
              name, " must be [n] or [n, num_kv_heads=", g.num_heads, "], got shape ",
              slots.sizes());
  SlotView view{slots.const_data_ptr<int64_t>(), slots.size(0), g.num_heads, slots.dim() == 2};
  const int64_t total = slots.numel();
  for (int64_t i = 0; i < total; ++i) {
    const int64_t slot = view.data[i];
    TORCH_CHECK(slot >= -1 && slot < g.num_slots, "kvprune: ", name, " holds slot ", slot,
                " at flat index ", i, "; valid slots are -1 (skip) and 0..", g.num_slots - 1);
  }
  return view;
}

void check_token_tensor(const at::Tensor& t, const char* name, const at::Tensor& kv_cache,
                        const PageGeometry& g, int64_t num_tokens) {
  TORCH_CHECK(t.device().is_cpu(), "kvprune: ", name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 3 && t.size(0) == num_tokens && t.size(1) == g.num_heads &&
                  t.size(2) == g.head_size,
              "kvprune: ", name, " must be [T=", num_tokens, ", num_kv_heads=", g.num_heads,
              ", head_size=", g.head_size, "], got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == kv_cache.scalar_type(), "kvprune: ", name, " dtype ",
              t.scalar_type(), " differs from kv_cache dtype ", kv_cache.scalar_type());
  TORCH_CHECK(t.stride(2) == 1, "kvprune: ", name, " must have a contiguous last dimension");
}

// Calls fn(elem_tag) with an unsigned type as wide as a cache element: the ops move bits, so
// bf16 and fp16 share one instantiation.
template <typename Fn>
void dispatch_width(const at::Tensor& kv_cache, Fn&& fn) {
  switch (kv_cache.element_size()) {
    case 4:
      fn(uint32_t{});
      break;
    case 2:
      fn(uint16_t{});
      break;
    default:
      TORCH_CHECK(false, "kvprune: unsupported element size ", kv_cache.element_size());
  }
}

// Calls fn(key_unit_tag, value_pack_constant) for a tiled geometry (set_tiling vetted it).
template <typename elem_t, typename Fn>
void dispatch_tiling(const PageGeometry& g, Fn&& fn) {
  auto with_unit = [&](auto unit_tag) {
    if (g.value_pack == 1) {
      fn(unit_tag, std::integral_constant<int, 1>{});
    } else {
      fn(unit_tag, std::integral_constant<int, 2>{});
    }
  };
  switch (g.key_pack * static_cast<int64_t>(sizeof(elem_t))) {
    case 2:
      with_unit(uint16_t{});
      break;
    case 4:
      with_unit(uint32_t{});
      break;
    default:
      with_unit(uint64_t{});
  }
}

// Splits the (token, head) grid into chunks of up to kMaxRun consecutive tokens for one head
// and calls visit(head, token_begin, token_end) in parallel, heads fastest. Heads-fastest keeps
// one chunk's source rows (key[t, :, :] spans all heads) in the TLB and cache while every head
// is written; walking all tokens of one head first would touch a new 4 KiB page per token.
template <typename Visit>
void for_each_chunk(int64_t num_tokens, int64_t num_heads, int64_t bytes_per_token,
                    const Visit& visit) {
  const int64_t num_chunks = (num_tokens + kMaxRun - 1) / kMaxRun;
  const int64_t bytes_per_item = std::min(num_tokens, kMaxRun) * bytes_per_token;
  at::parallel_for(0, num_chunks * num_heads, grain_for(bytes_per_item),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t item = begin; item < end; ++item) {
                       const int64_t chunk = item / num_heads, head = item % num_heads;
                       const int64_t token_begin = chunk * kMaxRun;
                       visit(head, token_begin, std::min(num_tokens, token_begin + kMaxRun));
                     }
                   });
}

// Source rows are 8 KiB apart (key[t, h] for fixed h), so the hardware prefetcher cannot
// follow them and every row is a cache miss; issuing the next head's rows while this head is
// written overlaps those misses with useful work.
template <typename elem_t>
inline void prefetch_rows(TokenRows<elem_t> rows, int64_t head, int64_t token_begin,
                          int64_t token_end, int64_t row_bytes) {
  for (int64_t token = token_begin; token < token_end; ++token) {
    const char* row = reinterpret_cast<const char*>(rows.row(token, head));
    for (int64_t byte = 0; byte < row_bytes; byte += 64) __builtin_prefetch(row + byte, 0, 3);
  }
}

// Consecutive tokens whose slots share a K tile (an EQUIP ring segment, a prefill chunk) form
// a run, whose K is written tile row by tile row.
template <typename elem_t, typename key_unit_t, int value_pack>
void write_tiled(TokenRows<elem_t> keys, TokenRows<elem_t> values, elem_t* cache,
                 const SlotView& slots, const PageGeometry& g) {
  const int64_t bytes_per_token = 2 * g.head_size * static_cast<int64_t>(sizeof(elem_t));
  for_each_chunk(slots.count, g.num_heads, bytes_per_token,
                 [&](int64_t head, int64_t token, int64_t token_end) {
    if (head + 1 < g.num_heads) {
      const int64_t row_bytes = g.head_size * static_cast<int64_t>(sizeof(elem_t));
      prefetch_rows(keys, head + 1, token, token_end, row_bytes);
      prefetch_rows(values, head + 1, token, token_end, row_bytes);
    }
    const elem_t* run_keys[kMaxRun];
    const elem_t* run_values[kMaxRun];
    int64_t run_offsets[kMaxRun];       // offsets in the block
    int64_t run_tile_offsets[kMaxRun];  // offsets in the K tile
    while (token < token_end) {
      const int64_t first_slot = slots.at(token, head);
      if (first_slot < 0) {
        ++token;
        continue;
      }
      const int64_t tile_index = first_slot / g.key_tile;
      int64_t count = 0;
      for (; token < token_end; ++token) {
        const int64_t slot = slots.at(token, head);
        if (slot < 0) continue;
        if (slot / g.key_tile != tile_index) break;
        run_keys[count] = keys.row(token, head);
        run_values[count] = values.row(token, head);
        run_offsets[count] = slot % g.block_size;
        run_tile_offsets[count] = slot % g.key_tile;
        ++count;
      }
      elem_t* page = page_of(cache, g, first_slot, head);
      store_value_run<elem_t, value_pack>(page, g, run_values, run_offsets, count);
      store_key_run<elem_t, key_unit_t>(key_tile_of(page, g, first_slot % g.block_size), g,
                                        run_keys, run_tile_offsets, count);
    }
  });
}

template <typename elem_t>
void write_mapped(TokenRows<elem_t> keys, TokenRows<elem_t> values, elem_t* cache,
                  const SlotView& slots, const PageGeometry& g) {
  const int64_t bytes_per_token = 2 * g.head_size * static_cast<int64_t>(sizeof(elem_t));
  for_each_chunk(slots.count, g.num_heads, bytes_per_token,
                 [&](int64_t head, int64_t token_begin, int64_t token_end) {
    for (int64_t token = token_begin; token < token_end; ++token) {
      const int64_t slot = slots.at(token, head);
      if (slot < 0) continue;
      store_token_mapped(page_of(cache, g, slot, head), g, slot % g.block_size,
                         keys.row(token, head), values.row(token, head));
    }
  });
}

template <typename elem_t>
void write_any(const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
               const SlotView& slots, const PageGeometry& g) {
  elem_t* cache = static_cast<elem_t*>(kv_cache.data_ptr());
  if (!g.tiled) {
    write_mapped<elem_t>(rows_of<elem_t>(key), rows_of<elem_t>(value), cache, slots, g);
    return;
  }
  dispatch_tiling<elem_t>(g, [&](auto unit_tag, auto value_pack) {
    write_tiled<elem_t, decltype(unit_tag), decltype(value_pack)::value>(
        rows_of<elem_t>(key), rows_of<elem_t>(value), cache, slots, g);
  });
}

template <typename elem_t, typename key_unit_t, int value_pack>
void load_token_tiled(const elem_t* page, const PageGeometry& g, int64_t offset_in_block,
                      elem_t* key, elem_t* value) {
  load_key_tiled<elem_t, key_unit_t>(page, g, offset_in_block, key);
  load_value_tiled<elem_t, value_pack>(page, g, offset_in_block, value);
}

// Reads are per token: scorers read scattered survivors, so there are no runs to exploit.
template <typename elem_t, typename LoadToken>
void read_kernel(const at::Tensor& kv_cache, const SlotView& slots, const PageGeometry& g,
                 const at::Tensor& key_out, const at::Tensor& value_out, LoadToken load_token) {
  const elem_t* cache = static_cast<const elem_t*>(kv_cache.const_data_ptr());
  elem_t* key_base = static_cast<elem_t*>(key_out.data_ptr());
  elem_t* value_base = static_cast<elem_t*>(value_out.data_ptr());
  const int64_t dims = g.head_size;
  const int64_t bytes_per_token = 2 * dims * static_cast<int64_t>(sizeof(elem_t));
  for_each_chunk(slots.count, g.num_heads, bytes_per_token,
                 [&](int64_t head, int64_t token_begin, int64_t token_end) {
    for (int64_t token = token_begin; token < token_end; ++token) {
      const int64_t slot = slots.at(token, head);
      elem_t* key_dst = key_base + (token * g.num_heads + head) * dims;
      elem_t* value_dst = value_base + (token * g.num_heads + head) * dims;
      if (slot < 0) {
        std::fill(key_dst, key_dst + dims, elem_t{0});
        std::fill(value_dst, value_dst + dims, elem_t{0});
        continue;
      }
      load_token(page_of(cache, g, slot, head), g, slot % g.block_size, key_dst, value_dst);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> read_with_view(const at::Tensor& kv_cache,
                                                  const SlotView& slots, const PageGeometry& g) {
  auto key_out = at::empty({slots.count, g.num_heads, g.head_size}, kv_cache.options());
  auto value_out = at::empty({slots.count, g.num_heads, g.head_size}, kv_cache.options());
  dispatch_width(kv_cache, [&](auto elem_tag) {
    using elem_t = decltype(elem_tag);
    if (!g.tiled) {
      read_kernel<elem_t>(kv_cache, slots, g, key_out, value_out,
                          load_token_mapped<elem_t>);
      return;
    }
    dispatch_tiling<elem_t>(g, [&](auto unit_tag, auto value_pack) {
      read_kernel<elem_t>(
          kv_cache, slots, g, key_out, value_out,
          load_token_tiled<elem_t, decltype(unit_tag), decltype(value_pack)::value>);
    });
  });
  return {key_out, value_out};
}

}  // namespace

void write_slots(const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
                 const at::Tensor& slots, const at::Tensor& key_offsets,
                 const at::Tensor& value_offsets, c10::IntArrayRef tiling) {
  const PageGeometry g = make_geometry(kv_cache, key_offsets, value_offsets, tiling);
  const SlotView view = make_slot_view(slots, g, "slots");
  check_token_tensor(key, "key", kv_cache, g, view.count);
  check_token_tensor(value, "value", kv_cache, g, view.count);
  dispatch_width(kv_cache, [&](auto elem_tag) {
    write_any<decltype(elem_tag)>(key, value, kv_cache, view, g);
  });
}

std::tuple<at::Tensor, at::Tensor> read_slots(const at::Tensor& kv_cache, const at::Tensor& slots,
                                              const at::Tensor& key_offsets,
                                              const at::Tensor& value_offsets,
                                              c10::IntArrayRef tiling) {
  const PageGeometry g = make_geometry(kv_cache, key_offsets, value_offsets, tiling);
  return read_with_view(kv_cache, make_slot_view(slots, g, "slots"), g);
}

void copy_slots(const at::Tensor& kv_cache, const at::Tensor& src_slots,
                const at::Tensor& dst_slots, const at::Tensor& key_offsets,
                const at::Tensor& value_offsets, c10::IntArrayRef tiling) {
  const PageGeometry g = make_geometry(kv_cache, key_offsets, value_offsets, tiling);
  TORCH_CHECK(src_slots.sizes() == dst_slots.sizes(),
              "kvprune: src_slots and dst_slots must have the same shape, got ",
              src_slots.sizes(), " and ", dst_slots.sizes());
  const SlotView src = make_slot_view(src_slots, g, "src_slots");
  const SlotView dst = make_slot_view(dst_slots, g, "dst_slots");
  for (int64_t i = 0; i < src_slots.numel(); ++i) {
    TORCH_CHECK(dst.data[i] < 0 || src.data[i] >= 0, "kvprune: dst slot ", dst.data[i],
                " at flat index ", i, " has source -1; only pairs with dst -1 are skipped");
  }
  // Staging every source first is what makes overlapping src/dst sets (compaction) safe.
  auto [key_staged, value_staged] = read_with_view(kv_cache, src, g);
  dispatch_width(kv_cache, [&](auto elem_tag) {
    write_any<decltype(elem_tag)>(key_staged, value_staged, kv_cache, dst, g);
  });
}

std::string build_isa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "generic";
#endif
}

}  // namespace kvprune
