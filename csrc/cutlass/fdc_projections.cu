// See fdc_projections.h. CUTLASS 2.x's grouped GEMM (one persistent launch walks every group's
// tiles) with SM80 tensor-op tiles, which Hopper and Blackwell run as well.
//
// Why 3xTF32 (OpMultiplyAddFastF32): FdcLayers projects in fp32 today (torch's einsum, which
// cuBLAS runs without TF32 by default). 3xTF32 splits each fp32 operand into a big and a small
// TF32 part and keeps three of the four products, which is fp32's accuracy on tensor cores, so
// this kernel can replace the einsums without changing what is cached.
// Why 64x64 tiles: a group's n is one head's rank (16 to 128 at served head sizes) and its m a
// step's tokens (a decode batch or a prefill chunk); larger tiles would mostly compute padding.
#include "fdc_projections.h"

#include <cutlass/cutlass.h>
#include <cutlass/epilogue/thread/linear_combination.h>
#include <cutlass/gemm/device/gemm_grouped.h>
#include <cutlass/gemm/kernel/default_gemm_grouped.h>

namespace kvprune_cutlass {
namespace {

// D = alpha * A B: the source C is never read (beta is not even a parameter).
using Epilogue = cutlass::epilogue::thread::LinearCombination<
    float, kAlignment, float, float, cutlass::epilogue::thread::ScaleType::OnlyAlphaScaling>;

template <typename LayoutB>
using Projection = cutlass::gemm::device::GemmGrouped<typename cutlass::gemm::kernel::DefaultGemmGrouped<
    float, cutlass::layout::RowMajor, cutlass::ComplexTransform::kNone, kAlignment,
    float, LayoutB, cutlass::ComplexTransform::kNone, kAlignment,
    float, cutlass::layout::RowMajor, float,
    cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80,
    cutlass::gemm::GemmShape<64, 64, 16>, cutlass::gemm::GemmShape<32, 32, 16>,
    cutlass::gemm::GemmShape<16, 8, 8>, Epilogue,
    cutlass::gemm::threadblock::GemmBatchedIdentityThreadblockSwizzle, 3,
    cutlass::gemm::kernel::GroupScheduleMode::kDeviceOnly,
    cutlass::arch::OpMultiplyAddFastF32>::GemmKernel>;

template <typename LayoutB>
const char* run(const GroupedGemm& gemm, cudaStream_t stream) {
  using Gemm = Projection<LayoutB>;
  // 3 stages of a 64x16 A tile and a 16x64 B tile in fp32: 24 KiB. Under 48 KiB a block needs no
  // opt-in, on every GPU from sm_80 on (the compile check compiles this for each).
  static_assert(sizeof(typename Gemm::GemmKernel::SharedStorage) <= 48 * 1024, "a block's shared memory");
  auto* sizes = reinterpret_cast<cutlass::gemm::GemmCoord*>(const_cast<int*>(gemm.problem_sizes));
  auto* host_sizes = reinterpret_cast<const cutlass::gemm::GemmCoord*>(gemm.problem_sizes_host);
  // One wave at most, and no more blocks than tiles (a decode step has few).
  const int blocks = Gemm::sufficient(host_sizes, gemm.groups);
  if (blocks <= 0) return "no thread block fits on this GPU";
  auto* a = reinterpret_cast<float**>(const_cast<int64_t*>(gemm.a));
  auto* b = reinterpret_cast<float**>(const_cast<int64_t*>(gemm.b));
  auto* d = reinterpret_cast<float**>(const_cast<int64_t*>(gemm.d));
  auto* lda = const_cast<int64_t*>(gemm.lda);
  auto* ldb = const_cast<int64_t*>(gemm.ldb);
  auto* ldd = const_cast<int64_t*>(gemm.ldd);
  typename Gemm::Arguments arguments(sizes, gemm.groups, blocks, typename Epilogue::Params(1.0f), a, b, d, d,
                                     lda, ldb, ldd, ldd, const_cast<cutlass::gemm::GemmCoord*>(host_sizes));
  Gemm op;
  // kDeviceOnly schedules on the device: no workspace.
  if (op.initialize(arguments, nullptr, stream) != cutlass::Status::kSuccess) return "CUTLASS refused the arguments";
  if (op.run(stream) != cutlass::Status::kSuccess) return "the CUTLASS launch failed";
  return nullptr;
}

}  // namespace

size_t shared_bytes(bool b_column_major) {
  return b_column_major ? sizeof(typename Projection<cutlass::layout::ColumnMajor>::GemmKernel::SharedStorage)
                        : sizeof(typename Projection<cutlass::layout::RowMajor>::GemmKernel::SharedStorage);
}

const char* grouped_gemm_fp32(const GroupedGemm& gemm, cudaStream_t stream) {
  if (gemm.groups <= 0) return nullptr;
  return gemm.b_column_major ? run<cutlass::layout::ColumnMajor>(gemm, stream)
                             : run<cutlass::layout::RowMajor>(gemm, stream);
}

}  // namespace kvprune_cutlass
