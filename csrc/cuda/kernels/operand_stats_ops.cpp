// CUDA operator fp8_operand_stats: argument checks, workspace, device guard and stream; the
// kernels are in operand_stats.cu.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <climits>

#include "../../checks/stats_checks.h"
#include "../cuda_checks.h"
#include "kernels.h"

namespace transformer_fp8 {
namespace {

constexpr int64_t kChunk = 16384;  // elements per unit (one thread block each)

at::Tensor fp8_operand_stats_cuda(const at::Tensor& x, const at::Tensor& q,
                                  const at::Tensor& scale, double fp8_max, int64_t block_rows,
                                  int64_t block_cols) {
  check_cuda_tensor(x, "x");
  const c10::cuda::CUDAGuard guard(x.device());
  const StatsInputs in = prepare_operand_stats(x, q, scale, fp8_max, block_rows, block_cols,
                                               kChunk);
  const StatsGeometry& g = in.geometry;
  TORCH_CHECK(g.units() <= INT_MAX, "transformer_fp8: fp8_operand_stats: x of ", x.numel(),
              " elements in ", block_rows, " x ", block_cols, " blocks needs ", g.units(),
              " thread blocks, more than a CUDA grid holds");
  at::Tensor partials = at::empty({g.units() * static_cast<int64_t>(sizeof(StatsPartial))},
                                  x.options().dtype(at::kByte));
  at::Tensor out = at::empty({kStatsFields}, x.options().dtype(at::kDouble));
  const auto status = cuda::launch_operand_stats(
      in.x.data_ptr(), hp_type_of(in.x.scalar_type()),
      static_cast<const uint8_t*>(in.q.data_ptr()), check_fp8_dtype(in.q.scalar_type(), "q"),
      in.scale.data_ptr<float>(), in.scale_stride_down, in.scale_stride_across, g,
      in.saturation_bound,
      reinterpret_cast<StatsPartial*>(partials.data_ptr()), out.data_ptr<double>(),
      c10::cuda::getCurrentCUDAStream());
  TFP8_CHECK_LAUNCH(status, "fp8_operand_stats");
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(transformer_fp8, CUDA, m) {
  m.impl("fp8_operand_stats", &fp8_operand_stats_cuda);
}

}  // namespace transformer_fp8
