// Registers the ops as torch.ops.kvprune.* (usable from Python, TorchScript and
// torch.compile graphs) and gives the shared object a module init so that
// `import vllm_kvprune._C` loads it; the module itself exposes nothing.
#include <Python.h>
#include <torch/library.h>

#include "attention_mass.h"
#include "reduced_attention.h"
#include "slot_ops.h"

TORCH_LIBRARY(kvprune, m) {
  m.def(
      "write_slots(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slots, "
      "Tensor key_offsets, Tensor value_offsets, int[] tiling) -> ()");
  m.def(
      "copy_slots(Tensor(a!) kv_cache, Tensor src_slots, Tensor dst_slots, "
      "Tensor key_offsets, Tensor value_offsets, int[] tiling) -> ()");
  m.def(
      "read_slots(Tensor kv_cache, Tensor slots, Tensor key_offsets, Tensor value_offsets, "
      "int[] tiling) -> (Tensor, Tensor)");
  m.def(
      "attention_mass(Tensor query, Tensor kv_cache, Tensor block_table, Tensor query_rows, "
      "Tensor key_counts, float scale, Tensor(a!) mass, Tensor(b!)? output, "
      "Tensor key_offsets, Tensor value_offsets, int[] tiling, float softcap=0.0) -> ()");
  m.def(
      "lowest_mass_slots(Tensor mass, Tensor slots, Tensor logical, int count, int next_position, "
      "int sinks, int recent) -> Tensor");
  m.def(
      "reduced_attention(Tensor query, Tensor kv_cache, Tensor block_table, Tensor query_start_loc, "
      "Tensor seq_lens, Tensor k_ranks, Tensor v_ranks, Tensor k_offsets, Tensor v_offsets, int block_size, "
      "float scale, "
      "Tensor(a!) output, bool balanced=True) -> ()");
  m.def("build_isa() -> str", &kvprune::build_isa);
}

TORCH_LIBRARY_IMPL(kvprune, CPU, m) {
  m.impl("write_slots", &kvprune::write_slots);
  m.impl("copy_slots", &kvprune::copy_slots);
  m.impl("read_slots", &kvprune::read_slots);
  m.impl("attention_mass", &kvprune::attention_mass);
  m.impl("lowest_mass_slots", &kvprune::lowest_mass_slots);
  m.impl("reduced_attention", &kvprune::reduced_attention);
}

static struct PyModuleDef kvprune_module = {PyModuleDef_HEAD_INIT, "_C",
                                            "vllm_kvprune C++ ops (see torch.ops.kvprune)", -1,
                                            nullptr};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&kvprune_module); }
