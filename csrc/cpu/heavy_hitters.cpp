// The victims of H2O: per layer and KV head, the cached tokens of lowest attention mass
// outside the sinks and the recent window (see attention_mass.h for where the mass comes
// from). One pass over each head's slots keeps the `count` best candidates in a small sorted
// array, instead of masking, sorting or top-k'ing whole tensors.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "attention_mass.h"

namespace kvprune {
namespace {

// Work (slots scanned) below which one thread does it all: a parallel region costs more. A
// request at h2o's usual size (30 layers x 3 KV heads x 512 slots, 46K slots) is split over
// the threads: 32 such requests one after another take 8.7 ms on one thread, 4.5-5.8 ms on
// two (`bench attention-mass`, 2-core Xeon, 2026-11-27); at 1 << 16 each ran on one thread.
constexpr int64_t kMinSlotsPerTask = 1 << 12;

// Eviction order: lower mass first; among equal masses the older token (lower position).
inline bool evicted_before(float mass, int64_t position, float other_mass, int64_t other_position) {
  return mass < other_mass || (mass == other_mass && position < other_position);
}

}  // namespace

at::Tensor lowest_mass_slots(const at::Tensor& mass, const at::Tensor& slots,
                             const at::Tensor& logical, int64_t count, int64_t next_position,
                             int64_t sinks, int64_t recent) {
  TORCH_CHECK(mass.device().is_cpu() && mass.scalar_type() == at::kFloat && mass.dim() == 3 &&
                  mass.is_contiguous(),
              "kvprune.lowest_mass_slots: mass must be a contiguous float32 CPU tensor "
              "[layers, heads, num_slots], got ",
              mass.scalar_type(), " ", mass.sizes());
  const int64_t num_layers = mass.size(0), num_heads = mass.size(1), num_slots = mass.size(2);
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(),
              "kvprune.lowest_mass_slots: slots must be a contiguous int64 tensor [n], got ",
              slots.scalar_type(), " ", slots.sizes());
  const int64_t n = slots.size(0);
  TORCH_CHECK(logical.scalar_type() == at::kLong && logical.dim() == 3 &&
                  logical.size(0) == num_layers && logical.size(1) == num_heads &&
                  logical.size(2) == n && logical.stride(2) == 1,
              "kvprune.lowest_mass_slots: logical must be int64 [layers=", num_layers,
              ", heads=", num_heads, ", n=", n, "] with a contiguous last dim, got ",
              logical.scalar_type(), " ", logical.sizes());
  TORCH_CHECK(count >= 1, "kvprune.lowest_mass_slots: count must be positive, got ", count);
  const int64_t* slot = slots.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(slot[i] >= 0 && slot[i] < num_slots, "kvprune.lowest_mass_slots: slots[", i,
                "] = ", slot[i], " is outside the mass table's ", num_slots, " slots");
  }
  auto victims = at::empty({num_layers, num_heads, count}, slots.options());
  const float* table = mass.const_data_ptr<float>();
  const int64_t* positions = logical.const_data_ptr<int64_t>();
  int64_t* out = victims.data_ptr<int64_t>();
  const int64_t recent_from = next_position - recent;
  const int64_t grain = std::max<int64_t>(1, kMinSlotsPerTask / std::max<int64_t>(1, n));
  at::parallel_for(0, num_layers * num_heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> best_mass(count);
    std::vector<int64_t> best_position(count), best_index(count);
    for (int64_t cache = begin; cache < end; ++cache) {
      const int64_t layer = cache / num_heads, head = cache % num_heads;
      const float* head_mass = table + cache * num_slots;
      const int64_t* held = positions + layer * logical.stride(0) + head * logical.stride(1);
      int64_t found = 0;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t position = held[i];
        if (position < sinks || position >= recent_from) continue;  // never evicted
        const float value = head_mass[slot[i]];
        if (found == count &&
            !evicted_before(value, position, best_mass[count - 1], best_position[count - 1])) {
          continue;
        }
        int64_t j = found < count ? found++ : count - 1;
        for (; j > 0 && evicted_before(value, position, best_mass[j - 1], best_position[j - 1]); --j) {
          best_mass[j] = best_mass[j - 1];
          best_position[j] = best_position[j - 1];
          best_index[j] = best_index[j - 1];
        }
        best_mass[j] = value;
        best_position[j] = position;
        best_index[j] = i;
      }
      TORCH_CHECK(found == count, "kvprune.lowest_mass_slots: layer ", layer, " head ", head,
                  " has ", found, " evictable tokens, fewer than ", count);
      std::copy(best_index.begin(), best_index.end(), out + cache * count);
    }
  });
  return victims;
}

}  // namespace kvprune
