// FDC's projections as one CUTLASS grouped GEMM: every KV head's (or query head's) product with
// its own rotation cut to its own rank, in one launch, on tensor cores at fp32 accuracy (3xTF32).
// Torch-free on purpose: this file and fdc_projections.cu compile with nvcc and CUTLASS's headers
// alone (the compile check, tools/cutlass_check.py); fdc_projections_op.cu is the
// torch binding that the GPU build adds.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace kvprune_cutlass {

// Group g computes D_g[m, n] = sum_k A_g[m, k] * B_g[k, n], row-major A and D (leading dimension
// in elements), B row-major or, with `b_column_major`, column-major (an output rotation read
// transposed). Every array lives on the device except `problem_sizes_host`, which sizes the launch.
struct GroupedGemm {
  int groups = 0;
  const int* problem_sizes = nullptr;       // [groups][3]: m, n, k (cutlass::gemm::GemmCoord)
  const int* problem_sizes_host = nullptr;  // the same on the host
  const int64_t* a = nullptr;               // [groups] device addresses of fp32 A_g
  const int64_t* b = nullptr;
  const int64_t* d = nullptr;
  const int64_t* lda = nullptr;             // [groups] leading dimensions, in elements
  const int64_t* ldb = nullptr;
  const int64_t* ldd = nullptr;
  bool b_column_major = false;
};

// Elements a vector access covers: every n, k, leading dimension and address (in elements) must be
// a multiple of it (pad ranks with zero columns).
constexpr int kAlignment = 4;

// A block's (dynamic) shared memory, in bytes: host code, runs without a GPU (the compile check
// links it into a small program and reports it).
size_t shared_bytes(bool b_column_major);

// Launches on `stream`. Returns nullptr on success, else why CUTLASS refused (a static string).
const char* grouped_gemm_fp32(const GroupedGemm& gemm, cudaStream_t stream);

}  // namespace kvprune_cutlass
