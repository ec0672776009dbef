// torch.ops.kvprune_cutlass.grouped_gemm: the torch binding of fdc_projections.cu, built into
// vllm_kvprune._cutlass_C by setup.py when torch has CUDA, nvcc is found and CUTLASS's headers
// are (`pip install vllm-kvprune[gpu]`, or CUTLASS_INCLUDE_DIR). The groups are described by
// vllm_kvprune/kernels/grouped_gemm.py, which checks shapes, strides and alignment first.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <Python.h>

#include "fdc_projections.h"

namespace {

// `problem_sizes` [G, 3] int32 on the device and `problem_sizes_host` the same on the CPU;
// `addresses` [3, G] int64 on the device (A, B, D) and `leading` [3, G] int64 (lda, ldb, ldd).
void grouped_gemm(const at::Tensor& problem_sizes, const at::Tensor& problem_sizes_host, const at::Tensor& addresses,
                  const at::Tensor& leading, bool b_column_major) {
  const int64_t groups = problem_sizes.size(0);
  TORCH_CHECK(problem_sizes.is_cuda() && problem_sizes.scalar_type() == at::kInt && problem_sizes.is_contiguous() &&
                  problem_sizes.dim() == 2 && problem_sizes.size(1) == 3,
              "problem_sizes: a contiguous [G, 3] int32 CUDA tensor");
  TORCH_CHECK(!problem_sizes_host.is_cuda() && problem_sizes_host.scalar_type() == at::kInt &&
                  problem_sizes_host.is_contiguous() && problem_sizes_host.sizes() == problem_sizes.sizes(),
              "problem_sizes_host: problem_sizes on the CPU");
  for (const auto* table : {&addresses, &leading}) {
    TORCH_CHECK(table->is_cuda() && table->scalar_type() == at::kLong && table->is_contiguous() && table->dim() == 2 &&
                    table->size(0) == 3 && table->size(1) == groups,
                "addresses and leading: contiguous [3, G] int64 CUDA tensors");
  }
  const c10::cuda::CUDAGuard guard(problem_sizes.device());
  const int64_t* address = addresses.data_ptr<int64_t>();
  const int64_t* ld = leading.data_ptr<int64_t>();
  kvprune_cutlass::GroupedGemm gemm;
  gemm.groups = static_cast<int>(groups);
  gemm.problem_sizes = problem_sizes.data_ptr<int>();
  gemm.problem_sizes_host = problem_sizes_host.data_ptr<int>();
  gemm.a = address, gemm.b = address + groups, gemm.d = address + 2 * groups;
  gemm.lda = ld, gemm.ldb = ld + groups, gemm.ldd = ld + 2 * groups;
  gemm.b_column_major = b_column_major;
  const char* error = kvprune_cutlass::grouped_gemm_fp32(gemm, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(error == nullptr, "kvprune_cutlass.grouped_gemm: ", error == nullptr ? "" : error);
}

}  // namespace

TORCH_LIBRARY(kvprune_cutlass, m) {
  m.def("grouped_gemm(Tensor problem_sizes, Tensor problem_sizes_host, Tensor addresses, Tensor leading, "
        "bool b_column_major) -> ()");
}

TORCH_LIBRARY_IMPL(kvprune_cutlass, CUDA, m) { m.impl("grouped_gemm", &grouped_gemm); }

// `import vllm_kvprune._cutlass_C` loads the registrations above; the module exposes nothing.
static struct PyModuleDef cutlass_module = {PyModuleDef_HEAD_INIT, "_cutlass_C",
                                            "vllm_kvprune's CUTLASS ops (see torch.ops.kvprune_cutlass)", -1, nullptr};

PyMODINIT_FUNC PyInit__cutlass_C(void) { return PyModule_Create(&cutlass_module); }
