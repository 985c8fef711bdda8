// CPU kernels of update_delayed_scaling and compute_scale_from_amax: the reference of the CUDA
// ones (csrc/cuda/kernels/scaling.cu), column by column as fp8_common.h describes.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../checks/checks.h"
#include "../prepared_update.h"

namespace transformer_fp8 {
namespace {

// One column of a history [L, n] (stride n), its scale and scale_inv.
//   cur = history[0]; cur == 0 -> nothing recorded this step: leave everything untouched.
//   Otherwise roll: rows 1..L-2 <- old rows 2..L-1, row L-1 <- cur, row 0 <- 0, and derive the
//   amax from the window {old rows 1..L-1, cur} ("max") or from cur ("most_recent"), ignoring
//   non-finite entries. A usable amax sets the scale; scale_inv is always 1/scale.
void update_column(float* history, int64_t L, int64_t n, float* scale, float* scale_inv,
                   double fp8_max, int margin, AmaxAlgo algo) {
  const float cur = history[0];
  if (cur == 0.0f) return;  // nothing recorded this step: keep the column as it is
  float window_max = -INFINITY;
  if (L >= 2) window_max = finite_max(window_max, history[n]);  // old row 1, dropped by the roll
  for (int64_t r = 1; r + 1 < L; ++r) {
    const float v = history[(r + 1) * n];
    window_max = finite_max(window_max, v);
    history[r * n] = v;
  }
  window_max = finite_max(window_max, cur);
  if (L >= 2) history[(L - 1) * n] = cur;
  history[0] = 0.0f;
  const float amax = algo == AmaxAlgo::Max ? window_max : (finite_f32(cur) ? cur : -INFINITY);
  if (amax_is_usable(amax)) *scale = scale_from_amax(amax, fp8_max, margin);
  *scale_inv = 1.0f / *scale;
}

// The update of checked tensors (see prepared_update.h).
void run_update_cpu(const UpdateTensor* tensors, size_t count, int margin, AmaxAlgo algo,
                    c10::Device) {
  for (size_t i = 0; i < count; ++i) {
    const UpdateTensor& t = tensors[i];
    for (int64_t c = 0; c < t.columns; ++c)
      update_column(t.history + c, t.history_len, t.columns, t.scale + c, t.scale_inv + c,
                    t.fp8_max, margin, algo);
  }
}

const RegisterUpdateRunner register_cpu_runner(c10::DeviceType::CPU, &run_update_cpu);

void update_delayed_scaling_cpu(at::TensorList amax_histories, at::TensorList scales,
                                at::TensorList scale_invs, at::ArrayRef<double> fp8_maxes,
                                int64_t margin, c10::string_view amax_compute_algo) {
  check_delayed_scaling_args(amax_histories, scales, scale_invs, fp8_maxes, margin);
  const AmaxAlgo algo = parse_amax_algo(amax_compute_algo);
  const auto tensors = update_tensors(amax_histories, scales, scale_invs, fp8_maxes);
  run_update_cpu(tensors.data(), tensors.size(), static_cast<int>(margin), algo,
                 amax_histories[0].device());
}

at::Tensor compute_scale_from_amax_cpu(const at::Tensor& amax, double fp8_max, int64_t margin) {
  check_compute_scale_args(amax, fp8_max, margin);
  const at::Tensor a = amax.contiguous();
  at::Tensor scale = at::empty(amax.sizes(), amax.options());
  const float* in = a.data_ptr<float>();
  float* out = scale.data_ptr<float>();
  for (int64_t i = 0; i < a.numel(); ++i)
    out[i] = amax_is_usable(in[i])
                 ? scale_from_amax(in[i], fp8_max, static_cast<int>(margin))
                 : 1.0f;
  return scale;
}

}  // namespace

TORCH_LIBRARY_IMPL(transformer_fp8, CPU, m) {
  m.impl("update_delayed_scaling", &update_delayed_scaling_cpu);
  m.impl("compute_scale_from_amax", &compute_scale_from_amax_cpu);
}

}  // namespace transformer_fp8
