// One Linear GEMM, forward and backward, as one operator with its autograd in C++ (any device:
// it calls the CPU or CUDA kernels of the other operators through the dispatcher):
//   fp8_linear_delayed  DelayedScaling: the stored scales, amaxes recorded into history row 0;
//   fp8_linear_current  Float8CurrentScaling in one process: each tensor's scale from its own
//                       amax (no cross-rank reduction: the Python path does that);
//   fp8_norm_linear_delayed / fp8_norm_linear_current: the same GEMM after a LayerNorm or
//                       RMSNorm of the input (LayerNormLinear): delayed scaling casts the norm's
//                       output in the norm's kernel, current scaling casts its high-precision
//                       output; backward ends with the norm's backward.
//
// Each makes the same operator calls, with the same arguments, as modules/linear.py's
// _Fp8LinearFunction (layernorm_linear.py's _LayerNormLinearFunction) with the quantizers of quantization/roles.py, so its results and the
// amaxes it records are bit for bit that path's (tests/test_linear_fused_step.py,
// test_norm_linear_fused_step.py); it only
// spares the host the Python work of the autograd function, its plan and its quantizers.
//
// Forward: input [..., K] and weight [N, K] cast to FP8, out = x @ w^T (+ bias) by fp8_gemm.
// Backward: grad_output cast (delayed: the bias gradient from the same read), dgrad and wgrad
// by fp8_gemm. A delayed grad_output scale is read when the backward runs, as the Python path
// reads it.
#include <torch/extension.h>

#include <array>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/SavedTensorHooks.h>
#include <torch/csrc/autograd/python_variable.h>

#include "python_module.h"
#include "step_ops.h"

namespace transformer_fp8 {
namespace {

using namespace step;  // NOLINT: the shared operator calls (step_ops.h)
using torch::autograd::AutogradContext;

// ---- the autograd function ------------------------------------------------------------------

// What backward needs besides its saved variables, packed into one saved_data entry (each entry
// costs a string hash and allocations per call): the dtypes of grad_output's cast and of the
// gradients, whether there is a bias, whether the scaling is delayed, and the input's shape.
struct BackwardMeta {
  at::ScalarType bwd_dtype, input_dtype, weight_dtype, bias_dtype;
  bool has_bias, delayed;
  // The norm before the GEMM (NormSpec::kNone: none); whether it has a bias (LayerNorm's).
  NormSpec::Kind norm_kind;
  bool zero_centered_gamma, has_norm_bias;
  std::vector<int64_t> input_shape;

  static constexpr size_t kShapeStart = 9;
  std::vector<int64_t> pack() const {
    std::vector<int64_t> packed{static_cast<int64_t>(bwd_dtype), static_cast<int64_t>(input_dtype),
                                static_cast<int64_t>(weight_dtype),
                                static_cast<int64_t>(bias_dtype), has_bias ? 1 : 0,
                                delayed ? 1 : 0, static_cast<int64_t>(norm_kind),
                                zero_centered_gamma ? 1 : 0, has_norm_bias ? 1 : 0};
    packed.insert(packed.end(), input_shape.begin(), input_shape.end());
    return packed;
  }
  static BackwardMeta unpack(const std::vector<int64_t>& packed) {
    return {static_cast<at::ScalarType>(packed[0]), static_cast<at::ScalarType>(packed[1]),
            static_cast<at::ScalarType>(packed[2]), static_cast<at::ScalarType>(packed[3]),
            packed[4] != 0, packed[5] != 0, static_cast<NormSpec::Kind>(packed[6]),
            packed[7] != 0, packed[8] != 0,
            std::vector<int64_t>(packed.begin() + kShapeStart, packed.end())};
  }
};

// The delayed-scaling state the step takes, one tensor per entry (the Python caller slices the
// layer's buffers once and keeps the slices): the input's and the weight's amax slot (history
// row 0) and scale, their scale_invs [input, weight], and grad_output's amax slot, scale and
// scale_inv. (The scale_invs are checked with the rest; the casts take 1 / scale of the scale
// they use, see scale_invs_of in step_ops.h.)
enum StateIndex : size_t {
  kInputAmax, kWeightAmax, kInputScale, kWeightScale, kFwdScaleInv,
  kGradAmax, kGradScale, kGradScaleInv, kStateSize
};
// Arguments of forward: what backward returns gradients for.
constexpr size_t kMaxForwardInputs = 12;
struct Fp8LinearStep : public torch::autograd::Function<Fp8LinearStep> {
  // norm_weight / norm_bias: the norm's parameters when norm.kind is not kNone (else none).
  // state: delayed scaling's kStateSize tensors (StateIndex), or null for current scaling.
  // (A pointer, not tensor arguments: autograd would record each as an input of the node, a
  // host cost per call for tensors that take no gradient.)
  // needs_input_grad / needs_weight_grad: whether backward will want dgrad (of the GEMM's
  // input: the layer's input, or the norm's output) / wgrad (the transposes are cast only then).
  static Tensor forward(AutogradContext* ctx, const Tensor& input, const Tensor& weight,
                        const std::optional<Tensor>& bias,
                        const std::optional<Tensor>& norm_weight,
                        const std::optional<Tensor>& norm_bias, const Tensor* state,
                        at::ScalarType fwd_dtype, at::ScalarType bwd_dtype,
                        at::ScalarType out_dtype, bool needs_input_grad,
                        bool needs_weight_grad, NormSpec norm) {
    // The operators below need no autograd of their own (this node is theirs): dispatched
    // past the autograd and view-tracking kernels, a large part of the host time otherwise.
    const bool has_norm = norm.kind != NormSpec::kNone;
    const int64_t out_features = weight.size(0), in_features = weight.size(1);
    // The input as [rows, K]. With a norm it is saved for the norm's backward: then made before
    // autograd is dispatched past, a view of the input that shares its version counter, so
    // that an in-place change of the input before backward is refused, as the Python path's.
    const bool track_view = has_norm && input.dim() != 2;
    Tensor inp_2d = track_view ? input.reshape({-1, in_features}) : input;
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const bool delayed = state != nullptr;
    if (input.dim() != 2 && !track_view) inp_2d = input.reshape({-1, in_features});
    const int64_t rows = inp_2d.size(0);
    Operand x_q, w_q;
    Tensor stat0, stat1;  // the norm's statistics
    if (delayed) {
      const std::vector<Tensor> scale_inv =
          scale_invs_of({state[kInputScale], state[kWeightScale]});
      if (has_norm) {  // the norm's output cast in the norm's kernel
        x_q.scale_inv = scale_inv[0];
        Tensor y_t;
        std::tie(x_q.data, y_t, stat0, stat1) =
            norm_fp8(norm, inp_2d, *norm_weight, norm_bias, state[kInputScale], fwd_dtype,
                     state[kInputAmax], needs_weight_grad);
        if (needs_weight_grad) x_q.data_t = y_t;
      } else {
        x_q = cast(pad_rows(inp_2d), state[kInputScale], scale_inv[0],
                   state[kInputAmax], fwd_dtype, needs_weight_grad);
      }
      w_q = cast(weight, state[kWeightScale], scale_inv[1],
                 state[kWeightAmax], fwd_dtype, needs_input_grad);
      bump_version(state[kInputAmax]);  // written through the kernels, below autograd
      bump_version(state[kWeightAmax]);
    } else {
      Tensor gemm_input = inp_2d;
      if (has_norm) {  // current scaling needs the output's amax first: cast after the norm
        std::tie(gemm_input, stat0, stat1) = norm_hp(norm, inp_2d, *norm_weight, norm_bias);
      }
      x_q = cast_current(pad_rows(gemm_input), fwd_dtype, needs_weight_grad);
      w_q = cast_current(weight, fwd_dtype, needs_input_grad);
    }
    std::optional<Tensor> gemm_bias;
    if (bias.has_value()) gemm_bias = bias->scalar_type() == out_dtype ? *bias : bias->to(out_dtype);
    const Tensor out = fp8_gemm(x_q.data, x_q.scale_inv, w_q.data, w_q.scale_inv, out_dtype,
                                gemm_bias, /*fast_accum=*/true);
    // Backward keeps the FP8 transposes only, not the high-precision input (the norm's
    // backward needs its input: kept with a norm).
    // (In the Python path's order: a non-reentrant checkpoint matches the tensors saved by
    // this forward with those its recomputation, on the Python path, saves.)
    if (has_norm) {
      ctx->save_for_backward({inp_2d, *norm_weight, x_q.data_t, x_q.scale_inv, w_q.data_t,
                              w_q.scale_inv, stat0, stat1});
    } else {
      ctx->save_for_backward({x_q.data_t, x_q.scale_inv, w_q.data_t, w_q.scale_inv});
    }
    // grad_output's state is read, and its amax written, when backward runs: kept as values,
    // not saved variables (the update changes them in place between the passes). One entry
    // per tensor: compiled autograd lifts a tensor entry into its graph, not a list of them.
    if (delayed) {
      ctx->saved_data["grad_amax"] = state[kGradAmax];
      ctx->saved_data["grad_scale"] = state[kGradScale];
    }
    ctx->saved_data["meta"] =
        BackwardMeta{bwd_dtype, input.scalar_type(), weight.scalar_type(),
                     bias.has_value() ? bias->scalar_type() : out_dtype, bias.has_value(),
                     delayed, norm.kind, norm.zero_centered_gamma, norm_bias.has_value(),
                     input.sizes().vec()}
            .pack();
    return function_output(out, rows, with_last(input.sizes().slice(0, input.dim() - 1),
                                                out_features));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    // Unpacked before autograd is dispatched past: a non-reentrant checkpoint recomputes its
    // region here, which must build its graph.
    const variable_list saved = ctx->get_saved_variables();
    variable_list grads;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;  // as in forward
      grads = gradients(ctx, saved, grad_outputs[0]);
    }
    return once_differentiable(std::move(grads), "Linear");
  }

  static variable_list gradients(AutogradContext* ctx, const variable_list& saved,
                                 const Tensor& grad_out) {
    const BackwardMeta meta = BackwardMeta::unpack(ctx->saved_data["meta"].toIntVector());
    const bool has_norm = meta.norm_kind != NormSpec::kNone;
    const size_t first = has_norm ? 2 : 0;  // (with a norm, its input and weight come first)
    const Tensor &x_t = saved[first], &x_scale_inv = saved[first + 1], &w_t = saved[first + 2],
                 &w_scale_inv = saved[first + 3];
    // Output edges are numbered over the tensor arguments given: no bias, no edge for it.
    const size_t norm_weight_edge = meta.has_bias ? 3 : 2;
    const bool needs_norm_weight_grad = has_norm && ctx->needs_input_grad(norm_weight_edge);
    const bool needs_norm_bias_grad =
        has_norm && meta.has_norm_bias && ctx->needs_input_grad(norm_weight_edge + 1);
    // dgrad of the GEMM: for the input's gradient, or for the norm's parameters'.
    const bool needs_input_grad =
        ctx->needs_input_grad(0) || needs_norm_weight_grad || needs_norm_bias_grad;
    const bool needs_weight_grad = ctx->needs_input_grad(1);
    const bool needs_bias_grad = meta.has_bias && ctx->needs_input_grad(2);

    const int64_t out_features = grad_out.size(-1);
    const Tensor g_2d = grad_out.dim() == 2 ? grad_out : grad_out.reshape({-1, out_features});
    const int64_t rows = g_2d.size(0);
    CastState grad_state;  // (undefined: current scaling)
    if (meta.delayed) {
      // scale_inv as 1 / scale (as the forward's, see scale_invs_of), not the buffer's
      const Tensor scale = ctx->saved_data["grad_scale"].toTensor();
      grad_state = {scale, scale.reciprocal(), ctx->saved_data["grad_amax"].toTensor()};
    }
    auto [g_q, grad_bias] =
        cast_grad_output(g_2d, grad_state, meta.bwd_dtype, needs_weight_grad, needs_bias_grad);
    Tensor grad_input, grad_weight, grad_norm_weight, grad_norm_bias;
    if (needs_input_grad) {
      // dgrad [M, K] = grad_out [M, N] @ weight [N, K]; the b operand is weight^T [K, N]
      const Tensor dgrad = fp8_gemm(g_q.data, g_q.scale_inv, w_t, w_scale_inv, meta.input_dtype,
                                    std::nullopt, false);
      if (has_norm) {  // then the norm's backward, from its input and statistics
        const Tensor &norm_input = saved[0], &norm_weight = saved[1];
        Tensor grad_x;
        std::tie(grad_x, grad_norm_weight, grad_norm_bias) = norm_backward(
            NormSpec{meta.norm_kind, 0.0, meta.zero_centered_gamma},
            dgrad.narrow(0, 0, rows), norm_input, saved[6], saved[7], norm_weight);
        grad_input = grad_x.reshape(meta.input_shape);
      } else {
        grad_input = function_output(dgrad, rows, meta.input_shape);
      }
    }
    if (needs_weight_grad) {
      // wgrad [N, K] = grad_out^T [N, M] @ input [M, K]; the b operand is input^T [K, M]
      grad_weight = fp8_gemm(g_q.data_t, g_q.scale_inv, x_t, x_scale_inv, meta.weight_dtype,
                             std::nullopt, false);
    }
    if (needs_bias_grad && grad_bias.scalar_type() != meta.bias_dtype) {
      grad_bias = grad_bias.to(meta.bias_dtype);
    }
    // One entry per argument of forward (the undefined extras past current scaling's are
    // dropped).
    variable_list grads(kMaxForwardInputs);
    grads[0] = grad_input;
    grads[1] = grad_weight;
    grads[2] = grad_bias;
    grads[3] = grad_norm_weight;
    grads[4] = meta.has_norm_bias ? grad_norm_bias : Tensor();
    return grads;
  }
};

std::tuple<bool, bool> needs_grads(const Tensor& input, const Tensor& weight) {
  const bool grad_mode = at::GradMode::is_enabled();
  return {grad_mode && input.requires_grad(), grad_mode && weight.requires_grad()};
}

// The delayed-scaling state arguments, checked, in StateIndex order.
std::array<Tensor, kStateSize> delayed_state(
    const char* op, const Tensor& weight, const Tensor& input_amax, const Tensor& weight_amax,
    const Tensor& input_scale, const Tensor& weight_scale, const Tensor& fwd_scale_inv,
    const Tensor& grad_amax, const Tensor& grad_scale, const Tensor& grad_scale_inv) {
  check_state(op, input_amax, "input_amax", 1, weight);
  check_state(op, weight_amax, "weight_amax", 1, weight);
  check_state(op, input_scale, "input_scale", 1, weight);
  check_state(op, weight_scale, "weight_scale", 1, weight);
  check_state(op, fwd_scale_inv, "fwd_scale_inv", 2, weight);
  check_state(op, grad_amax, "grad_amax", 1, weight);
  check_state(op, grad_scale, "grad_scale", 1, weight);
  check_state(op, grad_scale_inv, "grad_scale_inv", 1, weight);
  return {input_amax, weight_amax, input_scale, weight_scale, fwd_scale_inv, grad_amax,
          grad_scale, grad_scale_inv};
}

Tensor fp8_linear_delayed(const Tensor& input, const Tensor& weight,
                          const std::optional<Tensor>& bias, const Tensor& input_amax,
                          const Tensor& weight_amax, const Tensor& input_scale,
                          const Tensor& weight_scale, const Tensor& fwd_scale_inv,
                          const Tensor& grad_amax, const Tensor& grad_scale,
                          const Tensor& grad_scale_inv, at::ScalarType fwd_dtype,
                          at::ScalarType bwd_dtype, at::ScalarType out_dtype) {
  constexpr const char* op = "fp8_linear_delayed";
  check_shapes(op, input, weight, bias);
  check_step_dtypes(op, fwd_dtype, bwd_dtype, out_dtype);
  const auto state = delayed_state(op, weight, input_amax, weight_amax, input_scale,
                                   weight_scale, fwd_scale_inv, grad_amax, grad_scale,
                                   grad_scale_inv);
  const auto [needs_input_grad, needs_weight_grad] = needs_grads(input, weight);
  return Fp8LinearStep::apply(input, weight, bias, std::nullopt, std::nullopt,
                              state.data(), fwd_dtype, bwd_dtype, out_dtype,
                              needs_input_grad, needs_weight_grad, NormSpec{});
}

Tensor fp8_linear_current(const Tensor& input, const Tensor& weight,
                          const std::optional<Tensor>& bias, at::ScalarType fwd_dtype,
                          at::ScalarType bwd_dtype, at::ScalarType out_dtype) {
  check_shapes("fp8_linear_current", input, weight, bias);
  check_step_dtypes("fp8_linear_current", fwd_dtype, bwd_dtype, out_dtype);
  const auto [needs_input_grad, needs_weight_grad] = needs_grads(input, weight);
  return Fp8LinearStep::apply(input, weight, bias, std::nullopt, std::nullopt,
                              nullptr, fwd_dtype, bwd_dtype, out_dtype,
                              needs_input_grad, needs_weight_grad, NormSpec{});
}

// Whether backward wants the GEMM's dgrad (for the input or the norm's parameters) and wgrad.
std::tuple<bool, bool> norm_needs_grads(const Tensor& input, const Tensor& norm_weight,
                                        const std::optional<Tensor>& norm_bias,
                                        const Tensor& weight) {
  const bool grad_mode = at::GradMode::is_enabled();
  const bool norm_grad = input.requires_grad() || norm_weight.requires_grad() ||
                         (norm_bias.has_value() && norm_bias->requires_grad());
  return {grad_mode && norm_grad, grad_mode && weight.requires_grad()};
}

Tensor fp8_norm_linear_delayed(const Tensor& input, const Tensor& norm_weight,
                               const std::optional<Tensor>& norm_bias,
                               const std::string& normalization, double eps,
                               bool zero_centered_gamma, const Tensor& weight,
                               const std::optional<Tensor>& bias, const Tensor& input_amax,
                               const Tensor& weight_amax, const Tensor& input_scale,
                               const Tensor& weight_scale, const Tensor& fwd_scale_inv,
                               const Tensor& grad_amax, const Tensor& grad_scale,
                               const Tensor& grad_scale_inv, at::ScalarType fwd_dtype,
                               at::ScalarType bwd_dtype, at::ScalarType out_dtype) {
  constexpr const char* op = "fp8_norm_linear_delayed";
  check_shapes(op, input, weight, bias);
  check_step_dtypes(op, fwd_dtype, bwd_dtype, out_dtype);
  const NormSpec norm = norm_spec(op, input, norm_weight, norm_bias, normalization, eps,
                                  zero_centered_gamma);
  const auto state = delayed_state(op, weight, input_amax, weight_amax, input_scale,
                                   weight_scale, fwd_scale_inv, grad_amax, grad_scale,
                                   grad_scale_inv);
  const auto [needs_input_grad, needs_weight_grad] =
      norm_needs_grads(input, norm_weight, norm_bias, weight);
  return Fp8LinearStep::apply(input, weight, bias, norm_weight, norm_bias,
                              state.data(), fwd_dtype, bwd_dtype, out_dtype,
                              needs_input_grad, needs_weight_grad, norm);
}

Tensor fp8_norm_linear_current(const Tensor& input, const Tensor& norm_weight,
                               const std::optional<Tensor>& norm_bias,
                               const std::string& normalization, double eps,
                               bool zero_centered_gamma, const Tensor& weight,
                               const std::optional<Tensor>& bias, at::ScalarType fwd_dtype,
                               at::ScalarType bwd_dtype, at::ScalarType out_dtype) {
  constexpr const char* op = "fp8_norm_linear_current";
  check_shapes(op, input, weight, bias);
  check_step_dtypes(op, fwd_dtype, bwd_dtype, out_dtype);
  const NormSpec norm = norm_spec(op, input, norm_weight, norm_bias, normalization, eps,
                                  zero_centered_gamma);
  const auto [needs_input_grad, needs_weight_grad] =
      norm_needs_grads(input, norm_weight, norm_bias, weight);
  return Fp8LinearStep::apply(input, weight, bias, norm_weight, norm_bias, nullptr,
                              fwd_dtype, bwd_dtype, out_dtype, needs_input_grad,
                              needs_weight_grad, norm);
}

// ---- the Python entry of the eager step (modules/linear_fused_step.py) ---------------------

}  // namespace

TORCH_LIBRARY_IMPL(transformer_fp8, CompositeImplicitAutograd, m) {
  m.impl("fp8_linear_delayed", &fp8_linear_delayed);
  m.impl("fp8_linear_current", &fp8_linear_current);
  m.impl("fp8_norm_linear_delayed", &fp8_norm_linear_delayed);
  m.impl("fp8_norm_linear_current", &fp8_norm_linear_current);
}

// ---- the ticket: the next forwards of a Linear layer (modules/linear_fused_step.py) ---------

namespace {

namespace py = pybind11;

// What a Linear layer's next forwards pass to its C++ step, made after a forward that ran it
// (modules/linear_fused_step.py's _keep_ticket): the step's arguments that stay the same from
// one forward to the next (delayed scaling's state slices, the FP8 dtypes, the backward step's
// BackwardOnce) and the objects the layer held then (its weight and bias Parameters, its six
// state buffers) with their types. A call runs the step on an input only where the input and
// the layer are as they were (the checks the layer's full path would make, reduced to
// identities, here in C++ where each costs nanoseconds), else returns None: the layer's full
// path runs instead.
//
// The layer's objects are borrowed: the Python ticket that holds this object holds them too
// (a strong reference from here would hide a reference cycle through the layer from the
// garbage collector).
class LinearTicket {
 public:
  LinearTicket(const py::object& weight, const py::object& bias,
               const std::vector<py::object>& buffers, std::vector<Tensor> state_slices,
               at::ScalarType fwd_dtype, at::ScalarType bwd_dtype, at::ScalarType dtype,
               int64_t in_features, const py::object& backward_step)
      : weight_(held(weight)), bias_(held(bias)), slices_(std::move(state_slices)),
        fwd_dtype_(fwd_dtype), bwd_dtype_(bwd_dtype), dtype_(dtype), in_features_(in_features) {
    TORCH_CHECK(THPVariable_Check(weight.ptr()) && (bias.is_none() || THPVariable_Check(bias.ptr())),
                "transformer_fp8: LinearTicket takes a weight tensor and a bias tensor or None");
    TORCH_CHECK(buffers.size() == kBufferNames.size() || buffers.empty(),
                "transformer_fp8: LinearTicket takes the layer's ", kBufferNames.size(),
                " state buffers or none, got ", buffers.size());
    TORCH_CHECK(slices_.size() == 8 || slices_.empty(),
                "transformer_fp8: LinearTicket takes 8 state slices or none, got ",
                slices_.size());
    TORCH_CHECK(slices_.empty() == backward_step.is_none() && slices_.empty() == buffers.empty(),
                "transformer_fp8: LinearTicket takes state slices, buffers and a backward "
                "step together (delayed scaling) or none of them (current scaling)");
    for (const py::object& buffer : buffers) buffers_.push_back(held(buffer));
    if (!backward_step.is_none())
      once_ = backward_step.attr("_once").cast<std::shared_ptr<step::BackwardOnce>>();
  }

  // The layer's output, or None where the full path must run. ``parameters`` and ``buffers``:
  // the layer's _parameters and _buffers dicts.
  py::object operator()(const py::handle& input, const py::handle& parameters,
                        const py::handle& buffers) const {
    if (!THPVariable_CheckExact(input.ptr()) || !PyDict_Check(parameters.ptr()) ||
        !PyDict_Check(buffers.ptr()))
      return py::none();
    const Tensor& x = THPVariable_Unpack(input.ptr());
    if (x.scalar_type() != dtype_ || x.dim() < 1 || x.size(-1) != in_features_)
      return py::none();
    // As checkpointing.may_be_checkpointed(): a checkpointed forward keeps a replay record.
    if (!c10::GradMode::is_enabled() || at::SavedTensorDefaultHooks::get_hooks(false))
      return py::none();
    // The same objects, of the same types (torch.utils.swap_tensors changes a tensor's class
    // in place: a tensor subclass takes the full path).
    const Names& names = interned_names();
    if (!weight_.is(PyDict_GetItem(parameters.ptr(), names.weight)) ||
        !bias_.is(PyDict_GetItem(parameters.ptr(), names.bias)))
      return py::none();
    for (size_t i = 0; i < buffers_.size(); ++i)
      if (!buffers_[i].is(PyDict_GetItem(buffers.ptr(), names.buffers[i]))) return py::none();
    const Tensor& weight = THPVariable_Unpack(weight_.object);
    if (weight.scalar_type() != dtype_) return py::none();  // (its .data replaced)
    const std::optional<Tensor> bias =
        bias_.object == Py_None ? std::nullopt
                                : std::optional<Tensor>(THPVariable_Unpack(bias_.object));
    if (slices_.empty())
      return py::cast(fp8_linear_current(x, weight, bias, fwd_dtype_, bwd_dtype_, dtype_));
    Tensor out = fp8_linear_delayed(x, weight, bias, slices_[0], slices_[1], slices_[2],
                                    slices_[3], slices_[4], slices_[5], slices_[6], slices_[7],
                                    fwd_dtype_, bwd_dtype_, dtype_);
    if (out.grad_fn() != nullptr)
      out.grad_fn()->add_pre_hook(std::make_unique<step::CallOnBackward>(once_));
    return py::cast(std::move(out));
  }

  // The state buffers compared, in roles.FP8_FLOAT_STATE's order.
  static constexpr std::array<const char*, 6> kBufferNames = {
      "fp8_fwd_amax_history", "fp8_fwd_scale", "fp8_fwd_scale_inv",
      "fp8_bwd_amax_history", "fp8_bwd_scale", "fp8_bwd_scale_inv"};

 private:
  // A borrowed object and the type it had.
  struct Held {
    PyObject* object;
    PyTypeObject* type;
    bool is(PyObject* other) const { return other == object && Py_TYPE(other) == type; }
  };
  static Held held(const py::object& object) { return {object.ptr(), Py_TYPE(object.ptr())}; }

  // The dict keys, made once and never freed (no decref after the interpreter has gone).
  struct Names {
    PyObject* weight;
    PyObject* bias;
    std::array<PyObject*, kBufferNames.size()> buffers;
  };
  static const Names& interned_names() {
    static const Names names = [] {
      Names made{PyUnicode_InternFromString("weight"), PyUnicode_InternFromString("bias"), {}};
      for (size_t i = 0; i < kBufferNames.size(); ++i)
        made.buffers[i] = PyUnicode_InternFromString(kBufferNames[i]);
      return made;
    }();
    return names;
  }

  Held weight_, bias_;
  std::vector<Held> buffers_;
  std::vector<Tensor> slices_;
  at::ScalarType fwd_dtype_, bwd_dtype_, dtype_;
  int64_t in_features_;
  std::shared_ptr<step::BackwardOnce> once_;
};

}  // namespace

// The operators' functions called directly from Python (an eager step, no dispatcher on the
// way in); linear_delayed and norm_linear_delayed also attach backward_step's on_backward (see CallOnBackward) to
// the output's node (None: nothing attached).
void bind_linear_steps(pybind11::module_& module) {
  namespace py = pybind11;
  py::class_<LinearTicket>(module, "LinearTicket",
                           "What a Linear layer's next forwards pass to its C++ step "
                           "(csrc/linear_step.cpp; made by modules/linear_fused_step.py)")
      .def(py::init<const py::object&, const py::object&, const std::vector<py::object>&,
                    std::vector<Tensor>, at::ScalarType, at::ScalarType, at::ScalarType, int64_t,
                    const py::object&>(),
           py::arg("weight"), py::arg("bias"), py::arg("buffers"), py::arg("state_slices"),
           py::arg("fwd_dtype"), py::arg("bwd_dtype"), py::arg("dtype"),
           py::arg("in_features"), py::arg("backward_step"))
      .def("__call__", &LinearTicket::operator(), py::arg("input"), py::arg("parameters"),
           py::arg("buffers"),
           "The layer's output through its C++ step, or None where the input or the layer "
           "is not as the ticket was made for (the full path must run)")
      .def_property_readonly_static("buffer_names", [](py::object) {
        std::vector<std::string> names(LinearTicket::kBufferNames.begin(),
                                       LinearTicket::kBufferNames.end());
        return names;
      });
  py::class_<step::BackwardOnce, std::shared_ptr<step::BackwardOnce>>(
      module, "BackwardOnce",
      "Which backward pass last called backward_step.on_backward(), shared by the hooks the "
      "C++ steps attach for that step (csrc/step_ops.h); cleared by the step.")
      .def(py::init<const py::object&>(), py::arg("backward_step"))
      .def("clear", [](step::BackwardOnce& once) { once.task.store(step::BackwardOnce::kNone); },
           "The next node of any backward pass calls backward_step.on_backward() again.")
      .def_property_readonly("task", [](const step::BackwardOnce& once) -> std::optional<int> {
        const int task = once.task.load();
        return task == step::BackwardOnce::kNone ? std::nullopt : std::optional<int>(task);
      }, "The graph task id of the backward pass that last called on_backward(), or None.");
  module.def(
      "linear_delayed",
      [](const Tensor& input, const Tensor& weight, const std::optional<Tensor>& bias,
         const Tensor& input_amax, const Tensor& weight_amax, const Tensor& input_scale,
         const Tensor& weight_scale, const Tensor& fwd_scale_inv, const Tensor& grad_amax,
         const Tensor& grad_scale, const Tensor& grad_scale_inv, at::ScalarType fwd_dtype,
         at::ScalarType bwd_dtype, at::ScalarType out_dtype, py::object backward_step) {
        return call_on_backward(
            fp8_linear_delayed(input, weight, bias, input_amax, weight_amax, input_scale,
                               weight_scale, fwd_scale_inv, grad_amax, grad_scale,
                               grad_scale_inv, fwd_dtype, bwd_dtype, out_dtype),
            std::move(backward_step));
      },
      "transformer_fp8::fp8_linear_delayed, then backward_step.on_backward() before its node runs",
      py::arg("input"), py::arg("weight"), py::arg("bias"), py::arg("input_amax"),
      py::arg("weight_amax"), py::arg("input_scale"), py::arg("weight_scale"),
      py::arg("fwd_scale_inv"), py::arg("grad_amax"), py::arg("grad_scale"),
      py::arg("grad_scale_inv"), py::arg("fwd_dtype"), py::arg("bwd_dtype"),
      py::arg("out_dtype"), py::arg("backward_step"));
  module.def("linear_current", &fp8_linear_current, "transformer_fp8::fp8_linear_current",
             py::arg("input"), py::arg("weight"), py::arg("bias"), py::arg("fwd_dtype"),
             py::arg("bwd_dtype"), py::arg("out_dtype"));
  module.def(
      "norm_linear_delayed",
      [](const Tensor& input, const Tensor& norm_weight, const std::optional<Tensor>& norm_bias,
         const std::string& normalization, double eps, bool zero_centered_gamma,
         const Tensor& weight, const std::optional<Tensor>& bias, const Tensor& input_amax,
         const Tensor& weight_amax, const Tensor& input_scale, const Tensor& weight_scale,
         const Tensor& fwd_scale_inv, const Tensor& grad_amax, const Tensor& grad_scale,
         const Tensor& grad_scale_inv, at::ScalarType fwd_dtype, at::ScalarType bwd_dtype,
         at::ScalarType out_dtype, py::object backward_step) {
        return call_on_backward(
            fp8_norm_linear_delayed(input, norm_weight, norm_bias, normalization, eps,
                                    zero_centered_gamma, weight, bias, input_amax, weight_amax,
                                    input_scale, weight_scale, fwd_scale_inv, grad_amax,
                                    grad_scale, grad_scale_inv, fwd_dtype, bwd_dtype,
                                    out_dtype),
            std::move(backward_step));
      },
      "transformer_fp8::fp8_norm_linear_delayed, then backward_step.on_backward() before its "
      "node runs",
      py::arg("input"), py::arg("norm_weight"), py::arg("norm_bias"), py::arg("normalization"),
      py::arg("eps"), py::arg("zero_centered_gamma"), py::arg("weight"), py::arg("bias"),
      py::arg("input_amax"), py::arg("weight_amax"), py::arg("input_scale"),
      py::arg("weight_scale"), py::arg("fwd_scale_inv"), py::arg("grad_amax"),
      py::arg("grad_scale"), py::arg("grad_scale_inv"), py::arg("fwd_dtype"),
      py::arg("bwd_dtype"), py::arg("out_dtype"), py::arg("backward_step"));
  module.def("norm_linear_current", &fp8_norm_linear_current,
             "transformer_fp8::fp8_norm_linear_current", py::arg("input"),
             py::arg("norm_weight"), py::arg("norm_bias"), py::arg("normalization"),
             py::arg("eps"), py::arg("zero_centered_gamma"), py::arg("weight"), py::arg("bias"),
             py::arg("fwd_dtype"), py::arg("bwd_dtype"), py::arg("out_dtype"));
}

}  // namespace transformer_fp8
