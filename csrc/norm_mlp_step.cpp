// LayerNormMLP's step, forward and backward, as one operator with its autograd in C++ (any
// device: it calls the other operators' kernels through the dispatcher):
//   fp8_norm_mlp_delayed  DelayedScaling: the stored scales, amaxes recorded into history row 0
//                         (forward columns: fc1 input, fc1 weight, fc2 input, fc2 weight;
//                         backward columns: fc1's and fc2's grad_output);
//   fp8_norm_mlp_current  Float8CurrentScaling in one process.
// It makes the same operator calls, with the same arguments, as layernorm_mlp.py's
// _LayerNormMLPFunction with the quantizers of quantization/roles.py, so its results and the
// amaxes it records are bit for bit that path's (tests/test_norm_mlp_fused_step.py).
//
// Forward: norm (+ cast of its output) -> fc1 -> activation (+ cast) -> fc2.
// Backward: grad_output cast (+ fc2's bias gradient) -> fc2 wgrad and dgrad -> activation
// backward (+ cast, + fc1's bias gradient) -> fc1 wgrad and dgrad -> the norm's backward.
#include <torch/extension.h>

#include <array>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "checks/fused_checks.h"
#include "python_module.h"
#include "step_ops.h"

namespace transformer_fp8 {
namespace {

using namespace step;  // NOLINT: the shared operator calls (step_ops.h)
using torch::autograd::AutogradContext;

// Delayed scaling's state, one tensor per entry (1 element each, views of the state buffers,
// but fwd_scale_inv: the 4 forward scale_invs). The scale_invs are checked with the rest; the
// casts take 1 / scale of the scale they use (scale_invs_of in step_ops.h, grad_state).
enum Slot : size_t {
  kIn1Amax, kW1Amax, kIn2Amax, kW2Amax,
  kIn1Scale, kW1Scale, kIn2Scale, kW2Scale,
  kFwdScaleInv,
  kG1Amax, kG2Amax, kG1Scale, kG2Scale, kG1ScaleInv, kG2ScaleInv,
  kSlots
};

// The non-tensor arguments of the step.
struct MlpSpec {
  at::ScalarType fwd_dtype, bwd_dtype, out_dtype;
  NormSpec norm;
  std::string activation;
  // Whether each of input, norm_weight, norm_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias
  // will take a gradient (as ctx.needs_input_grad in the Python path).
  std::array<bool, 7> grads;
};

// Tensor arguments of forward (an absent optional counts), then the state, then the spec.
constexpr size_t kTensorArgs = 7;
constexpr size_t kMaxForwardInputs = kTensorArgs + 2;

// What backward needs besides its saved variables, in one saved_data entry.
std::vector<int64_t> pack_meta(const MlpSpec& spec, const Tensor& input,
                               const std::array<at::ScalarType, 4>& param_dtypes,
                               const std::array<bool, 3>& present, bool delayed) {
  std::vector<int64_t> meta{static_cast<int64_t>(spec.bwd_dtype),
                            static_cast<int64_t>(spec.norm.kind),
                            spec.norm.zero_centered_gamma ? 1 : 0, delayed ? 1 : 0};
  for (auto dtype : param_dtypes) meta.push_back(static_cast<int64_t>(dtype));
  for (bool p : present) meta.push_back(p ? 1 : 0);
  for (bool wanted : spec.grads) meta.push_back(wanted ? 1 : 0);
  meta.insert(meta.end(), input.sizes().begin(), input.sizes().end());
  return meta;
}
constexpr size_t kMetaGradsStart = 11;
constexpr size_t kMetaShapeStart = kMetaGradsStart + kTensorArgs;

struct Fp8NormMlpStep : public torch::autograd::Function<Fp8NormMlpStep> {
  static Tensor forward(AutogradContext* ctx, const Tensor& input, const Tensor& norm_weight,
                        const std::optional<Tensor>& norm_bias, const Tensor& fc1_weight,
                        const std::optional<Tensor>& fc1_bias, const Tensor& fc2_weight,
                        const std::optional<Tensor>& fc2_bias, const Tensor* state,
                        const MlpSpec& spec) {
    // state: delayed scaling's kSlots tensors (Slot), or null for current scaling (a pointer:
    // autograd would record tensor arguments as inputs of the node, a host cost per call).
    // The input as [rows, hidden], saved for the norm's backward: made before autograd is
    // dispatched past, a view of the input that shares its version counter, so that an
    // in-place change of the input before backward is refused, as the Python path's.
    const int64_t hidden = input.size(-1);
    const Tensor x = input.dim() == 2 ? input : input.reshape({-1, hidden});
    at::AutoDispatchBelowADInplaceOrView below_autograd;  // (this node is the operators')
    const bool delayed = state != nullptr;
    const auto& g = spec.grads;
    const bool needs_norm_grad = g[0] || g[1] || g[2];
    const bool needs_fc1_dgrad = needs_norm_grad;  // fc1's dgrad feeds only the norm's backward
    const bool needs_fc2_dgrad = needs_norm_grad || g[3] || g[4];
    const int64_t rows = x.size(0);

    // The forward casts' states, with their scale_invs (scale_invs_of).
    std::array<CastState, 4> fwd;  // fc1 input, fc1 weight, fc2 input, fc2 weight
    if (delayed) {
      const std::vector<Tensor> scale_inv = scale_invs_of(
          {state[kIn1Scale], state[kW1Scale], state[kIn2Scale], state[kW2Scale]});
      for (size_t i = 0; i < 4; ++i) {
        fwd[i] = {state[kIn1Scale + i], scale_inv[i], state[kIn1Amax + i]};
      }
    }
    const at::ScalarType dtype = spec.fwd_dtype;
    const auto cast_weight = [&](const Tensor& w, const CastState& s, bool with_transpose) {
      return s.delayed() ? cast(w, s.scale, s.scale_inv, s.amax, dtype, with_transpose)
                         : cast_current(w, dtype, with_transpose);
    };
    const auto gemm_bias = [&](const std::optional<Tensor>& bias) -> std::optional<Tensor> {
      if (!bias.has_value()) return std::nullopt;
      return bias->scalar_type() == spec.out_dtype ? *bias : bias->to(spec.out_dtype);
    };

    // norm (+ cast) -> fc1
    Operand ln_q;
    Tensor stat0, stat1;
    if (delayed) {
      ln_q.scale_inv = fwd[0].scale_inv;
      Tensor y_t;
      std::tie(ln_q.data, y_t, stat0, stat1) = norm_fp8(
          spec.norm, x, norm_weight, norm_bias, fwd[0].scale, dtype, fwd[0].amax, g[3]);
      if (g[3]) ln_q.data_t = y_t;
    } else {
      Tensor y;
      std::tie(y, stat0, stat1) = norm_hp(spec.norm, x, norm_weight, norm_bias);
      ln_q = cast_current(pad_rows(y), dtype, g[3]);
    }
    const Operand w1_q = cast_weight(fc1_weight, fwd[1], needs_fc1_dgrad);
    const Tensor fc1_out = fp8_gemm(ln_q.data, ln_q.scale_inv, w1_q.data, w1_q.scale_inv,
                                    spec.out_dtype, gemm_bias(fc1_bias), /*fast_accum=*/true)
                               .narrow(0, 0, rows);
    // activation (+ cast) -> fc2
    const Operand act_q = cast_activation(fc1_out, spec.activation, fwd[2], dtype, g[5]);
    const Operand w2_q = cast_weight(fc2_weight, fwd[3], needs_fc2_dgrad);
    const Tensor out = fp8_gemm(act_q.data, act_q.scale_inv, w2_q.data, w2_q.scale_inv,
                                spec.out_dtype, gemm_bias(fc2_bias), /*fast_accum=*/true);
    if (delayed) {
      for (size_t i : {kIn1Amax, kW1Amax, kIn2Amax, kW2Amax}) bump_version(state[i]);
    }

    // (In the Python path's order: a non-reentrant checkpoint matches these with the tensors
    // its recomputation, on the Python path, saves.)
    ctx->save_for_backward({x, norm_weight, fc1_out, ln_q.data_t, ln_q.scale_inv, w1_q.data_t,
                            w1_q.scale_inv, act_q.data_t, act_q.scale_inv, w2_q.data_t,
                            w2_q.scale_inv, stat0, stat1});
    if (delayed) {  // read (and the amaxes written) when backward runs: values, not saved
      ctx->saved_data["g1_amax"] = state[kG1Amax];
      ctx->saved_data["g2_amax"] = state[kG2Amax];
      ctx->saved_data["g1_scale"] = state[kG1Scale];
      ctx->saved_data["g2_scale"] = state[kG2Scale];
    }
    ctx->saved_data["activation"] = spec.activation;
    ctx->saved_data["meta"] = pack_meta(
        spec, input,
        {fc1_weight.scalar_type(), fc1_bias ? fc1_bias->scalar_type() : spec.out_dtype,
         fc2_weight.scalar_type(), fc2_bias ? fc2_bias->scalar_type() : spec.out_dtype},
        {norm_bias.has_value(), fc1_bias.has_value(), fc2_bias.has_value()}, delayed);
    return function_output(out, rows, with_last(input.sizes().slice(0, input.dim() - 1),
                                                fc2_weight.size(0)));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();  // (before autograd is skipped)
    variable_list grads;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      grads = gradients(ctx, saved, grad_outputs[0]);
    }
    return once_differentiable(std::move(grads), "LayerNormMLP");
  }

  // A grad_output's state at backward; its scale_inv 1 / scale (as the forward's, see
  // scale_invs_of in step_ops.h), not the scale_inv buffer.
  static CastState grad_state(AutogradContext* ctx, const char* which) {
    const std::string w(which);
    const Tensor scale = ctx->saved_data[w + "_scale"].toTensor();
    return {scale, scale.reciprocal(), ctx->saved_data[w + "_amax"].toTensor()};
  }

  static variable_list gradients(AutogradContext* ctx, const variable_list& saved,
                                 const Tensor& grad_out) {
    const Tensor &x = saved[0], &norm_weight = saved[1], &fc1_out = saved[2];
    const Tensor &ln_t = saved[3], &ln_scale_inv = saved[4], &w1_t = saved[5],
                 &w1_scale_inv = saved[6], &act_t = saved[7], &act_scale_inv = saved[8],
                 &w2_t = saved[9], &w2_scale_inv = saved[10];
    const std::vector<int64_t> meta = ctx->saved_data["meta"].toIntVector();
    const auto bwd_dtype = static_cast<at::ScalarType>(meta[0]);
    const NormSpec norm{static_cast<NormSpec::Kind>(meta[1]), 0.0, meta[2] != 0};
    const bool delayed = meta[3] != 0;
    const auto w1_dtype = static_cast<at::ScalarType>(meta[4]);
    const auto b1_dtype = static_cast<at::ScalarType>(meta[5]);
    const auto w2_dtype = static_cast<at::ScalarType>(meta[6]);
    const auto b2_dtype = static_cast<at::ScalarType>(meta[7]);
    const std::array<bool, 3> present{meta[8] != 0, meta[9] != 0, meta[10] != 0};
    const std::vector<int64_t> input_shape(meta.begin() + kMetaShapeStart, meta.end());
    const std::string activation = ctx->saved_data["activation"].toStringRef();

    // Whether each tensor argument takes a gradient: output edges are numbered over the
    // tensor arguments given (an absent bias has none).
    std::array<bool, kTensorArgs> g{};
    const std::array<bool, kTensorArgs> given{true, true, present[0], true, present[1], true,
                                              present[2]};
    for (size_t arg = 0, edge = 0; arg < kTensorArgs; ++arg) {
      if (given[arg]) g[arg] = ctx->needs_input_grad(edge++);
    }
    const bool needs_norm_grad = g[0] || g[1] || g[2];
    // fc2's dgrad and the activation's backward run (recording fc1's grad_output amax) when a
    // tensor before fc2 took a gradient at forward, as the Python path decides from
    // ctx.needs_input_grad; not from what this backward call asks for (a backward limited to
    // fc2's parameters, inputs=...), which would leave that amax unrecorded.
    bool fc2_dgrad_at_forward = false;
    for (size_t arg = 0; arg < 5; ++arg) fc2_dgrad_at_forward |= meta[kMetaGradsStart + arg] != 0;
    const int64_t rows = x.size(0);

    const Tensor g_2d = grad_out.reshape({-1, grad_out.size(-1)});
    const CastState g2_state = delayed ? grad_state(ctx, "g2") : CastState{};
    auto [g_q, grad_fc2_bias] = cast_grad_output(g_2d, g2_state, bwd_dtype, g[5], g[6]);
    variable_list grads(kMaxForwardInputs);
    if (g[5]) {
      // fc2 wgrad [H, F] = grad_out^T [H, M] @ act [M, F]; the b operand is act^T.
      grads[5] = fp8_gemm(g_q.data_t, g_q.scale_inv, act_t, act_scale_inv, w2_dtype,
                          std::nullopt, false);
    }
    if (fc2_dgrad_at_forward) {
      // fc2 dgrad [M, F] = grad_out [M, H] @ fc2_weight [H, F], then the activation's backward.
      const Tensor grad_act = fp8_gemm(g_q.data, g_q.scale_inv, w2_t, w2_scale_inv,
                                       fc1_out.scalar_type(), std::nullopt, false)
                                  .narrow(0, 0, rows);
      const CastState g1_state = delayed ? grad_state(ctx, "g1") : CastState{};
      auto [d1_q, grad_fc1_bias] =
          cast_activation_grad(grad_act, fc1_out, activation, g1_state, bwd_dtype, g[3], g[4]);
      if (g[3]) {
        // fc1 wgrad [F', H] = d1^T [F', M] @ ln_out [M, H]; the b operand is ln_out^T.
        grads[3] = fp8_gemm(d1_q.data_t, d1_q.scale_inv, ln_t, ln_scale_inv, w1_dtype,
                            std::nullopt, false);
      }
      if (needs_norm_grad) {
        const Tensor grad_ln = fp8_gemm(d1_q.data, d1_q.scale_inv, w1_t, w1_scale_inv,
                                        x.scalar_type(), std::nullopt, false)
                                   .narrow(0, 0, rows);
        Tensor grad_x;
        std::tie(grad_x, grads[1], grads[2]) =
            norm_backward(norm, grad_ln, x, saved[11], saved[12], norm_weight);
        grads[0] = grad_x.reshape(input_shape);
        if (!present[0]) grads[2] = Tensor();
      }
      if (grad_fc1_bias.defined()) grads[4] = grad_fc1_bias.to(b1_dtype);
    }
    if (grad_fc2_bias.defined()) grads[6] = grad_fc2_bias.to(b2_dtype);
    return grads;
  }
};

MlpSpec mlp_spec(const char* op, const Tensor& input, const Tensor& norm_weight,
                 const std::optional<Tensor>& norm_bias, const std::string& normalization,
                 double eps, bool zero_centered_gamma, const Tensor& fc1_weight,
                 const std::optional<Tensor>& fc1_bias, const Tensor& fc2_weight,
                 const std::optional<Tensor>& fc2_bias, const std::string& activation,
                 at::ScalarType fwd_dtype, at::ScalarType bwd_dtype, at::ScalarType out_dtype) {
  check_shapes(op, input, fc1_weight, fc1_bias);
  check_step_dtypes(op, fwd_dtype, bwd_dtype, out_dtype);
  check_step_tensor(op, fc2_weight, "fc2_weight", fc1_weight);
  if (fc2_bias.has_value()) check_step_tensor(op, *fc2_bias, "fc2_bias", fc1_weight);
  // fc2 takes the activation's output: fc1's output features, or half of them when gated.
  const Activation act = parse_activation(activation);
  const int64_t fc1_out = fc1_weight.size(0);
  TORCH_CHECK(!is_gated(act) || fc1_out % 2 == 0, "transformer_fp8: argument 'fc1_weight' of ",
              op, " must have an even number of rows for the gated activation '", activation,
              "', got shape ", fc1_weight.sizes());
  const int64_t ffn = is_gated(act) ? fc1_out / 2 : fc1_out;
  TORCH_CHECK(fc2_weight.dim() == 2 && fc2_weight.size(0) == input.size(-1) &&
              fc2_weight.size(1) == ffn,
              "transformer_fp8: argument 'fc2_weight' of ", op, " must be 2-D [", input.size(-1),
              ", ", ffn, "] (the input's features, the activation's output features), got shape ",
              fc2_weight.sizes());
  TORCH_CHECK(!fc2_bias.has_value() || (fc2_bias->dim() == 1 &&
                                        fc2_bias->size(0) == fc2_weight.size(0)),
              "transformer_fp8: argument 'fc2_bias' of ", op, " must have shape [",
              fc2_weight.size(0), "], got ", fc2_bias->sizes());
  const NormSpec norm = norm_spec(op, input, norm_weight, norm_bias, normalization, eps,
                                  zero_centered_gamma);
  const bool grad_mode = at::GradMode::is_enabled();
  const auto wants = [&](const std::optional<Tensor>& t) {
    return grad_mode && t.has_value() && t->requires_grad();
  };
  return MlpSpec{fwd_dtype, bwd_dtype, out_dtype, norm, activation,
                 {wants(input), wants(norm_weight), wants(norm_bias), wants(fc1_weight),
                  wants(fc1_bias), wants(fc2_weight), wants(fc2_bias)}};
}

Tensor norm_mlp_step(const Tensor& input, const Tensor& norm_weight,
                     const std::optional<Tensor>& norm_bias, const Tensor& fc1_weight,
                     const std::optional<Tensor>& fc1_bias, const Tensor& fc2_weight,
                     const std::optional<Tensor>& fc2_bias, const Tensor* state,
                     const MlpSpec& spec) {
  return Fp8NormMlpStep::apply(input, norm_weight, norm_bias, fc1_weight, fc1_bias, fc2_weight,
                               fc2_bias, state, spec);
}

// The delayed state slots from the state buffers' views: history row 0 [4] / [2], scales,
// scale_invs; checked.
std::array<Tensor, kSlots> slots_of(const char* op, const Tensor& weight, const Tensor& fwd_amax,
                                    const Tensor& fwd_scale, const Tensor& fwd_scale_inv,
                                    const Tensor& bwd_amax, const Tensor& bwd_scale,
                                    const Tensor& bwd_scale_inv) {
  check_state(op, fwd_amax, "fwd_amax", 4, weight);
  check_state(op, fwd_scale, "fwd_scale", 4, weight);
  check_state(op, fwd_scale_inv, "fwd_scale_inv", 4, weight);
  check_state(op, bwd_amax, "bwd_amax", 2, weight);
  check_state(op, bwd_scale, "bwd_scale", 2, weight);
  check_state(op, bwd_scale_inv, "bwd_scale_inv", 2, weight);
  std::array<Tensor, kSlots> slots;
  for (int64_t i = 0; i < 4; ++i) {
    slots[kIn1Amax + i] = fwd_amax.narrow(0, i, 1);
    slots[kIn1Scale + i] = fwd_scale.narrow(0, i, 1);
  }
  slots[kFwdScaleInv] = fwd_scale_inv;
  for (int64_t i = 0; i < 2; ++i) {
    slots[kG1Amax + i] = bwd_amax.narrow(0, i, 1);
    slots[kG1Scale + i] = bwd_scale.narrow(0, i, 1);
    slots[kG1ScaleInv + i] = bwd_scale_inv.narrow(0, i, 1);
  }
  return slots;
}

Tensor fp8_norm_mlp_delayed(const Tensor& input, const Tensor& norm_weight,
                            const std::optional<Tensor>& norm_bias,
                            const std::string& normalization, double eps,
                            bool zero_centered_gamma, const Tensor& fc1_weight,
                            const std::optional<Tensor>& fc1_bias, const Tensor& fc2_weight,
                            const std::optional<Tensor>& fc2_bias, const std::string& activation,
                            const Tensor& fwd_amax, const Tensor& fwd_scale,
                            const Tensor& fwd_scale_inv, const Tensor& bwd_amax,
                            const Tensor& bwd_scale, const Tensor& bwd_scale_inv,
                            at::ScalarType fwd_dtype, at::ScalarType bwd_dtype,
                            at::ScalarType out_dtype) {
  constexpr const char* op = "fp8_norm_mlp_delayed";
  const MlpSpec spec = mlp_spec(op, input, norm_weight, norm_bias, normalization, eps,
                                zero_centered_gamma, fc1_weight, fc1_bias, fc2_weight, fc2_bias,
                                activation, fwd_dtype, bwd_dtype, out_dtype);
  const auto slots = slots_of(op, fc1_weight, fwd_amax, fwd_scale, fwd_scale_inv, bwd_amax,
                              bwd_scale, bwd_scale_inv);
  return norm_mlp_step(input, norm_weight, norm_bias, fc1_weight, fc1_bias, fc2_weight,
                       fc2_bias, slots.data(), spec);
}

Tensor fp8_norm_mlp_current(const Tensor& input, const Tensor& norm_weight,
                            const std::optional<Tensor>& norm_bias,
                            const std::string& normalization, double eps,
                            bool zero_centered_gamma, const Tensor& fc1_weight,
                            const std::optional<Tensor>& fc1_bias, const Tensor& fc2_weight,
                            const std::optional<Tensor>& fc2_bias, const std::string& activation,
                            at::ScalarType fwd_dtype, at::ScalarType bwd_dtype,
                            at::ScalarType out_dtype) {
  const MlpSpec spec = mlp_spec("fp8_norm_mlp_current", input, norm_weight, norm_bias,
                                normalization, eps, zero_centered_gamma, fc1_weight, fc1_bias,
                                fc2_weight, fc2_bias, activation, fwd_dtype, bwd_dtype,
                                out_dtype);
  return norm_mlp_step(input, norm_weight, norm_bias, fc1_weight, fc1_bias, fc2_weight,
                       fc2_bias, nullptr, spec);
}

}  // namespace

TORCH_LIBRARY_IMPL(transformer_fp8, CompositeImplicitAutograd, m) {
  m.impl("fp8_norm_mlp_delayed", &fp8_norm_mlp_delayed);
  m.impl("fp8_norm_mlp_current", &fp8_norm_mlp_current);
}

// The Python entry of the eager step (modules/linear_fused_step.py): the delayed state as the
// 15 slots, sliced once by the caller and kept (Slot's order), then backward_step, whose
// on_backward runs before the node does (None: nothing attached). Empty slots: current
// scaling.
void bind_norm_mlp_step(pybind11::module_& module) {
  namespace py = pybind11;
  module.def(
      "norm_mlp",
      [](const Tensor& input, const Tensor& norm_weight, const std::optional<Tensor>& norm_bias,
         const std::string& normalization, double eps, bool zero_centered_gamma,
         const Tensor& fc1_weight, const std::optional<Tensor>& fc1_bias,
         const Tensor& fc2_weight, const std::optional<Tensor>& fc2_bias,
         const std::string& activation, const std::vector<Tensor>& slots,
         at::ScalarType fwd_dtype, at::ScalarType bwd_dtype, at::ScalarType out_dtype,
         py::object backward_step) {
        const bool delayed = !slots.empty();
        constexpr const char* op = "fp8_norm_mlp_delayed";
        const MlpSpec spec = mlp_spec(delayed ? op : "fp8_norm_mlp_current", input, norm_weight,
                                      norm_bias, normalization, eps, zero_centered_gamma,
                                      fc1_weight, fc1_bias, fc2_weight, fc2_bias, activation,
                                      fwd_dtype, bwd_dtype, out_dtype);
        if (delayed) {
          TORCH_CHECK(slots.size() == kSlots, "transformer_fp8: argument 'slots' of norm_mlp "
                      "must hold ", static_cast<int64_t>(kSlots), " tensors (or none: current "
                      "scaling), got ", slots.size());
          for (size_t i = 0; i < kSlots; ++i) {
            check_state(op, slots[i], "slots", i == kFwdScaleInv ? 4 : 1, fc1_weight);
          }
        }
        return call_on_backward(
            norm_mlp_step(input, norm_weight, norm_bias, fc1_weight, fc1_bias, fc2_weight,
                          fc2_bias, delayed ? slots.data() : nullptr, spec),
            std::move(backward_step));
      },
      "transformer_fp8::fp8_norm_mlp_delayed (15 state slots) or _current (none), then "
      "backward_step.on_backward() before its node runs",
      py::arg("input"), py::arg("norm_weight"), py::arg("norm_bias"), py::arg("normalization"),
      py::arg("eps"), py::arg("zero_centered_gamma"), py::arg("fc1_weight"),
      py::arg("fc1_bias"), py::arg("fc2_weight"), py::arg("fc2_bias"), py::arg("activation"),
      py::arg("slots"), py::arg("fwd_dtype"), py::arg("bwd_dtype"), py::arg("out_dtype"),
      py::arg("backward_step"));
}

}  // namespace transformer_fp8
