// Slot ops on vLLM's GPU paged KV cache as CUDA (HIP through torch's hipify), registered as
// torch.ops.kvprune_cuda.{write_slots, read_slots, copy_slots}.
//
// The cache is the logical tensor [num_blocks, H, block_size, 2 * D] with any strides (HND,
// NHD, ...): K of (slot s, head h, dim d) is at
//   (s / block_size) * stride0 + h * stride1 + (s % block_size) * stride2 + d * stride3,
// V at the same place plus D * stride3. Slots are integer [n] (one slot for all heads) or
// [n, H] (per head); slot -1 is skipped on write and reads as zeros. The ops check shapes,
// dtypes and devices but not the slot range (that needs a device sync): the Python wrappers in
// benchmarks/cuda_ops.py do; here a slot outside [0, num_slots) is treated like -1 so a bad slot
// can never address memory outside the cache.
// copy_slots reads every source into temporaries before writing, so overlapping source and
// destination sets (compaction) are safe; pairs with destination -1 are skipped.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>

namespace kvprune_cuda {
namespace {

constexpr int kThreads = 256;

// Where the ops find things; all strides in elements.
struct CacheGeometry {
  int64_t num_heads;
  int64_t head_size;
  int64_t block_size;
  int64_t num_slots;
  int64_t stride_block, stride_head, stride_offset, stride_dim;
};

struct TokenStrides {  // of a [n, H, D] key or value tensor
  int64_t token, head, dim;
};

struct SlotStrides {  // of [n] (head = 0) or [n, H] slots
  int64_t token, head;
};

struct CheckedSlots {  // int64 slots on the cache's device, [n] or [n, H]
  at::Tensor slots;
  SlotStrides strides;
};

// Element offset of K[slot, head, dim = 0]; -1 when the slot is skipped or out of range.
__device__ __forceinline__ int64_t key_offset(const CacheGeometry& cache, int64_t slot, int64_t head) {
  if (slot < 0 || slot >= cache.num_slots) return -1;
  return (slot / cache.block_size) * cache.stride_block + head * cache.stride_head +
         (slot % cache.block_size) * cache.stride_offset;
}

// Block t writes token t: its H * D (head, dim) elements, K and V, strided over the threads.
template <typename scalar_t>
__global__ void write_slots_kernel(const scalar_t* __restrict__ key, const scalar_t* __restrict__ value,
                                   scalar_t* __restrict__ kv_cache, const int64_t* __restrict__ slots,
                                   CacheGeometry cache, TokenStrides key_strides, TokenStrides value_strides,
                                   SlotStrides slot_strides) {
  const int64_t token = blockIdx.x;
  const int64_t elems = cache.num_heads * cache.head_size;
  for (int64_t i = threadIdx.x; i < elems; i += blockDim.x) {
    const int64_t head = i / cache.head_size;
    const int64_t dim = i % cache.head_size;
    const int64_t base = key_offset(cache, slots[token * slot_strides.token + head * slot_strides.head], head);
    if (base < 0) continue;
    const int64_t at = base + dim * cache.stride_dim;
    kv_cache[at] = key[token * key_strides.token + head * key_strides.head + dim * key_strides.dim];
    kv_cache[at + cache.head_size * cache.stride_dim] =
        value[token * value_strides.token + head * value_strides.head + dim * value_strides.dim];
  }
}

// Block t fills row t of the contiguous [n, H, D] outputs; skipped slots give zeros.
template <typename scalar_t>
__global__ void read_slots_kernel(const scalar_t* __restrict__ kv_cache, const int64_t* __restrict__ slots,
                                  scalar_t* __restrict__ key, scalar_t* __restrict__ value,
                                  CacheGeometry cache, SlotStrides slot_strides) {
  const int64_t token = blockIdx.x;
  const int64_t elems = cache.num_heads * cache.head_size;
  for (int64_t i = threadIdx.x; i < elems; i += blockDim.x) {
    const int64_t head = i / cache.head_size;
    const int64_t dim = i % cache.head_size;
    const int64_t base = key_offset(cache, slots[token * slot_strides.token + head * slot_strides.head], head);
    const int64_t out = token * elems + i;
    if (base < 0) {
      key[out] = static_cast<scalar_t>(0.0f);
      value[out] = static_cast<scalar_t>(0.0f);
      continue;
    }
    const int64_t at = base + dim * cache.stride_dim;
    key[out] = kv_cache[at];
    value[out] = kv_cache[at + cache.head_size * cache.stride_dim];
  }
}

CacheGeometry check_cache(const at::Tensor& kv_cache) {
  TORCH_CHECK(kv_cache.is_cuda(), "kvprune_cuda: kv_cache must be a CUDA tensor");
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.size(3) % 2 == 0,
              "kvprune_cuda: kv_cache must be [num_blocks, num_kv_heads, block_size, 2*head_size], got ",
              kv_cache.sizes());
  const auto dtype = kv_cache.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
              "kvprune_cuda: unsupported kv_cache dtype ", dtype);
  CacheGeometry cache;
  cache.num_heads = kv_cache.size(1);
  cache.block_size = kv_cache.size(2);
  cache.head_size = kv_cache.size(3) / 2;
  cache.num_slots = kv_cache.size(0) * cache.block_size;
  cache.stride_block = kv_cache.stride(0);
  cache.stride_head = kv_cache.stride(1);
  cache.stride_offset = kv_cache.stride(2);
  cache.stride_dim = kv_cache.stride(3);
  return cache;
}

// Slots as int64 on the cache's device ([n] or [n, H]), with their strides.
CheckedSlots check_slots(const at::Tensor& slots, const at::Tensor& kv_cache, const char* name) {
  TORCH_CHECK(slots.device() == kv_cache.device(), "kvprune_cuda: ", name, " must be on the cache's device");
  TORCH_CHECK(!at::isFloatingType(slots.scalar_type()) && slots.scalar_type() != at::kBool,
              "kvprune_cuda: ", name, " must be an integer tensor");
  TORCH_CHECK(slots.dim() == 1 || (slots.dim() == 2 && slots.size(1) == kv_cache.size(1)),
              "kvprune_cuda: ", name, " must be [n] or [n, num_kv_heads], got ", slots.sizes());
  at::Tensor as_long = slots.to(at::kLong);
  const SlotStrides strides{as_long.stride(0), as_long.dim() == 2 ? as_long.stride(1) : 0};
  return CheckedSlots{as_long, strides};
}

TokenStrides check_tokens(const at::Tensor& tokens, const at::Tensor& kv_cache, int64_t num_tokens,
                          const char* name) {
  TORCH_CHECK(tokens.device() == kv_cache.device(), "kvprune_cuda: ", name, " must be on the cache's device");
  TORCH_CHECK(tokens.scalar_type() == kv_cache.scalar_type(), "kvprune_cuda: ", name, " dtype ",
              tokens.scalar_type(), " differs from kv_cache dtype ", kv_cache.scalar_type());
  TORCH_CHECK(tokens.dim() == 3 && tokens.size(0) == num_tokens && tokens.size(1) == kv_cache.size(1) &&
                  tokens.size(2) == kv_cache.size(3) / 2,
              "kvprune_cuda: ", name, " must be [", num_tokens, ", num_kv_heads, head_size], got ",
              tokens.sizes());
  return TokenStrides{tokens.stride(0), tokens.stride(1), tokens.stride(2)};
}

int threads_for(const CacheGeometry& cache) {
  const int64_t elems = cache.num_heads * cache.head_size;
  // A multiple of the warp size, at most kThreads.
  return static_cast<int>(std::min<int64_t>(kThreads, std::max<int64_t>(32, (elems + 31) / 32 * 32)));
}

}  // namespace

void write_slots(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                 const at::Tensor& slots) {
  const CacheGeometry cache = check_cache(kv_cache);
  const CheckedSlots checked = check_slots(slots, kv_cache, "slots");
  const int64_t num_tokens = checked.slots.size(0);
  const TokenStrides key_strides = check_tokens(key, kv_cache, num_tokens, "key");
  const TokenStrides value_strides = check_tokens(value, kv_cache, num_tokens, "value");
  if (num_tokens == 0 || cache.num_heads * cache.head_size == 0) return;
  const at::cuda::OptionalCUDAGuard device_guard(kv_cache.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::Half, at::ScalarType::BFloat16, kv_cache.scalar_type(),
                                  "kvprune_cuda_write_slots", [&] {
                                    write_slots_kernel<scalar_t>
                                        <<<static_cast<unsigned int>(num_tokens), threads_for(cache), 0, stream>>>(
                                            key.data_ptr<scalar_t>(), value.data_ptr<scalar_t>(),
                                            kv_cache.data_ptr<scalar_t>(), checked.slots.data_ptr<int64_t>(),
                                            cache, key_strides, value_strides, checked.strides);
                                  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::tuple<at::Tensor, at::Tensor> read_slots(const at::Tensor& kv_cache, const at::Tensor& slots) {
  const CacheGeometry cache = check_cache(kv_cache);
  const CheckedSlots checked = check_slots(slots, kv_cache, "slots");
  const int64_t num_tokens = checked.slots.size(0);
  at::Tensor key = at::empty({num_tokens, cache.num_heads, cache.head_size}, kv_cache.options());
  at::Tensor value = at::empty_like(key);
  if (num_tokens == 0 || cache.num_heads * cache.head_size == 0) return {key, value};
  const at::cuda::OptionalCUDAGuard device_guard(kv_cache.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::Half, at::ScalarType::BFloat16, kv_cache.scalar_type(),
                                  "kvprune_cuda_read_slots", [&] {
                                    read_slots_kernel<scalar_t>
                                        <<<static_cast<unsigned int>(num_tokens), threads_for(cache), 0, stream>>>(
                                            kv_cache.data_ptr<scalar_t>(), checked.slots.data_ptr<int64_t>(),
                                            key.data_ptr<scalar_t>(), value.data_ptr<scalar_t>(), cache,
                                            checked.strides);
                                  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {key, value};
}

void copy_slots(at::Tensor& kv_cache, const at::Tensor& src_slots, const at::Tensor& dst_slots) {
  TORCH_CHECK(src_slots.sizes() == dst_slots.sizes(), "kvprune_cuda: src_slots ", src_slots.sizes(),
              " and dst_slots ", dst_slots.sizes(), " differ in shape");
  // Staged: all reads finish (same stream) before any write starts. A pair with dst -1 is
  // skipped by the write; a valid dst with src -1 would write zeros (the Python wrapper
  // rejects it, as the reference does).
  const std::tuple<at::Tensor, at::Tensor> staged = read_slots(kv_cache, src_slots);
  write_slots(std::get<0>(staged), std::get<1>(staged), kv_cache, dst_slots);
}

}  // namespace kvprune_cuda

TORCH_LIBRARY(kvprune_cuda, m) {
  m.def("write_slots(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slots) -> ()");
  m.def("read_slots(Tensor kv_cache, Tensor slots) -> (Tensor, Tensor)");
  m.def("copy_slots(Tensor(a!) kv_cache, Tensor src_slots, Tensor dst_slots) -> ()");
}

TORCH_LIBRARY_IMPL(kvprune_cuda, CUDA, m) {
  m.impl("write_slots", &kvprune_cuda::write_slots);
  m.impl("read_slots", &kvprune_cuda::read_slots);
  m.impl("copy_slots", &kvprune_cuda::copy_slots);
}
