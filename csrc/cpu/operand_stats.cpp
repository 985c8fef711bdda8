// CPU kernel of fp8_operand_stats (the numerics are csrc/operand_stats.h's, shared with the CUDA
// kernels): the units' partials in parallel, then the blocks combined in order.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "../checks/stats_checks.h"

namespace transformer_fp8 {
namespace {

constexpr int64_t kChunk = 16384;  // elements per unit

template <typename XT, typename QT>
StatsPartial unit_partial(const StatsGeometry& g, int64_t unit, const XT* x, const QT* q,
                          float s, float saturation_bound) {
  const int64_t block = unit / g.chunks_per_block, k = unit % g.chunks_per_block;
  const int64_t begin = k * g.chunk, end = std::min(begin + g.chunk, g.block_elements());
  StatsPartial p = stats_empty();
  for (int64_t e = begin; e < end; ++e) {
    const int64_t i = g.element(block, e);
    if (i >= 0) stats_add_element(p, static_cast<float>(x[i]), static_cast<float>(q[i]), s,
                                  saturation_bound);
  }
  return p;
}

template <typename XT, typename QT>
StatsTotal operand_stats_typed(const StatsInputs& in) {
  const StatsGeometry& g = in.geometry;
  const XT* x = in.x.data_ptr<XT>();
  const QT* q = in.q.data_ptr<QT>();
  const float* scale = in.scale.data_ptr<float>();
  auto block_scale = [&](int64_t b) {
    return scale[(b / g.blocks_across) * in.scale_stride_down +
                 (b % g.blocks_across) * in.scale_stride_across];
  };
  std::vector<StatsPartial> partials(g.units());
  at::parallel_for(0, g.units(), 1, [&](int64_t first, int64_t last) {
    for (int64_t u = first; u < last; ++u)
      partials[u] = unit_partial(g, u, x, q, block_scale(u / g.chunks_per_block),
                                 in.saturation_bound);
  });
  StatsTotal total = total_empty();
  for (int64_t b = 0; b < g.blocks(); ++b) {
    StatsPartial block = stats_empty();
    for (int64_t k = 0; k < g.chunks_per_block; ++k)
      stats_merge(block, partials[b * g.chunks_per_block + k]);
    total_add_block(total, block, block_scale(b));
  }
  return total;
}

at::Tensor fp8_operand_stats_cpu(const at::Tensor& x, const at::Tensor& q,
                                 const at::Tensor& scale, double fp8_max, int64_t block_rows,
                                 int64_t block_cols) {
  const StatsInputs in = prepare_operand_stats(x, q, scale, fp8_max, block_rows, block_cols,
                                               kChunk);
  StatsTotal total = total_empty();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, in.x.scalar_type(),
                                  "fp8_operand_stats", [&] {
    total = in.q.scalar_type() == at::kFloat8_e4m3fn
                ? operand_stats_typed<scalar_t, c10::Float8_e4m3fn>(in)
                : operand_stats_typed<scalar_t, c10::Float8_e5m2>(in);
  });
  at::Tensor out = at::empty({kStatsFields}, x.options().dtype(at::kDouble));
  total_write(total, out.data_ptr<double>());
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(transformer_fp8, CPU, m) {
  m.impl("fp8_operand_stats", &fp8_operand_stats_cpu);
}

}  // namespace transformer_fp8
