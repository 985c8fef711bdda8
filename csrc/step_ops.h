// What the C++ steps of the FP8 modules share (csrc/linear_step.cpp: Linear and
// LayerNormLinear; csrc/norm_mlp_step.cpp: LayerNormMLP): the operators they call through the
// dispatcher, each as the Python path calls it (quantization/quantizer.py, ops/, the modules'
// autograd functions), so that a C++ step makes the same calls with the same arguments; their
// argument checks; and the hook that queues delayed scaling's backward update.
#pragma once

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/extension.h>

#include <atomic>
#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "fp8_common.h"

namespace transformer_fp8 {
namespace step {

using at::Tensor;
using torch::autograd::variable_list;

constexpr int64_t kRowAlign = 16;  // ops.GEMM_ALIGN: FP8 GEMM operands get rows padded to it

// ---- the operators called, looked up once ------------------------------------------------

inline c10::OperatorHandle find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

// amax: the slot the cast records max |x| into, or none.
inline Tensor cast_to_fp8(const Tensor& x, const Tensor& scale, at::ScalarType dtype,
                   const std::optional<Tensor>& amax) {
  static const auto op = find_op("transformer_fp8::cast_to_fp8")
      .typed<Tensor(const Tensor&, const Tensor&, at::ScalarType, const std::optional<Tensor>&)>();
  return op.call(x, scale, dtype, amax);
}

inline std::tuple<Tensor, Tensor> cast_transpose_to_fp8(const Tensor& x, const Tensor& scale,
                                                 at::ScalarType dtype,
                                                 const std::optional<Tensor>& amax) {
  static const auto op = find_op("transformer_fp8::cast_transpose_to_fp8")
      .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, at::ScalarType,
                                        const std::optional<Tensor>&)>();
  return op.call(x, scale, dtype, amax);
}

inline std::tuple<Tensor, Tensor, Tensor> cast_transpose_dbias(const Tensor& x, const Tensor& scale,
                                                        at::ScalarType dtype, const Tensor& amax) {
  static const auto op = find_op("transformer_fp8::cast_transpose_dbias")
      .typed<std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, at::ScalarType,
                                                const std::optional<Tensor>&, int64_t)>();
  return op.call(x, scale, dtype, amax, kRowAlign);
}

inline Tensor fp8_gemm(const Tensor& a, const Tensor& a_scale_inv, const Tensor& b,
                const Tensor& b_scale_inv, at::ScalarType out_dtype,
                const std::optional<Tensor>& bias, bool fast_accum) {
  static const auto op = find_op("transformer_fp8::fp8_gemm")
      .typed<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, at::ScalarType,
                    const std::optional<Tensor>&, bool)>();
  return op.call(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, fast_accum);
}

inline Tensor amax_of(const Tensor& x) {
  static const auto op = find_op("transformer_fp8::amax").typed<Tensor(const Tensor&)>();
  return op.call(x);
}

inline Tensor compute_scale_from_amax(const Tensor& amax, double fp8_max) {
  static const auto op = find_op("transformer_fp8::compute_scale_from_amax")
      .typed<Tensor(const Tensor&, double, int64_t)>();
  return op.call(amax, fp8_max, /*margin=*/0);
}

// ---- the norm in front of the GEMM (LayerNormLinear), as normalization.py's NormStep -------

// Which norm precedes the GEMM, if any: the non-tensor arguments of the norm.
struct NormSpec {
  enum Kind : int64_t { kNone = 0, kLayerNorm = 1, kRMSNorm = 2 };
  Kind kind = kNone;
  double eps = 0.0;
  bool zero_centered_gamma = false;
};

inline NormSpec::Kind norm_kind(const std::string& normalization, const char* op) {
  if (normalization == "LayerNorm") return NormSpec::kLayerNorm;
  if (normalization == "RMSNorm") return NormSpec::kRMSNorm;
  TORCH_CHECK(false, "transformer_fp8: argument 'normalization' of ", op, " must be "
              "\"LayerNorm\" or \"RMSNorm\", got \"", normalization, "\"");
}

// The norm of x [M, K] in x's dtype: (y, stat0, stat1) with (mean, rstd) for LayerNorm and
// (rstd, undefined) for RMSNorm.
inline std::tuple<Tensor, Tensor, Tensor> norm_hp(const NormSpec& norm, const Tensor& x,
                                           const Tensor& weight,
                                           const std::optional<Tensor>& bias) {
  if (norm.kind == NormSpec::kLayerNorm) {
    static const auto op = find_op("transformer_fp8::layernorm_fwd")
        .typed<std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&,
                                                  const std::optional<Tensor>&, double, bool)>();
    return op.call(x, weight, bias, norm.eps, norm.zero_centered_gamma);
  }
  static const auto op = find_op("transformer_fp8::rmsnorm_fwd")
      .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, double, bool)>();
  auto [y, rstd] = op.call(x, weight, norm.eps, norm.zero_centered_gamma);
  return {y, rstd, Tensor()};
}

// The norm of x [M, K] cast to FP8 in the norm's kernel (rows padded to kRowAlign, the
// transpose if asked, max |y| into amax_slot): (y_fp8, y_t_fp8 or [0], stat0, stat1).
inline std::tuple<Tensor, Tensor, Tensor, Tensor> norm_fp8(const NormSpec& norm, const Tensor& x,
                                                    const Tensor& weight,
                                                    const std::optional<Tensor>& bias,
                                                    const Tensor& scale, at::ScalarType dtype,
                                                    const Tensor& amax_slot,
                                                    bool with_transpose) {
  const std::optional<Tensor> amax = amax_slot;
  if (norm.kind == NormSpec::kLayerNorm) {
    static const auto op = find_op("transformer_fp8::layernorm_fwd_fp8")
        .typed<std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>(
            const Tensor&, const Tensor&, const std::optional<Tensor>&, double, bool,
            const Tensor&, at::ScalarType, const std::optional<Tensor>&, bool, bool, int64_t)>();
    auto [y, y_t, y_hp, mean, rstd] = op.call(x, weight, bias, norm.eps,
                                              norm.zero_centered_gamma, scale, dtype, amax,
                                              with_transpose, /*return_hp=*/false, kRowAlign);
    return {y, y_t, mean, rstd};
  }
  static const auto op = find_op("transformer_fp8::rmsnorm_fwd_fp8")
      .typed<std::tuple<Tensor, Tensor, Tensor, Tensor>(
          const Tensor&, const Tensor&, double, bool, const Tensor&, at::ScalarType,
          const std::optional<Tensor>&, bool, bool, int64_t)>();
  auto [y, y_t, y_hp, rstd] = op.call(x, weight, norm.eps, norm.zero_centered_gamma, scale,
                                      dtype, amax, with_transpose, /*return_hp=*/false,
                                      kRowAlign);
  return {y, y_t, rstd, Tensor()};
}

// The norm's backward: (dx, dweight, dbias or undefined).
inline std::tuple<Tensor, Tensor, Tensor> norm_backward(const NormSpec& norm, const Tensor& dy,
                                                 const Tensor& x, const Tensor& stat0,
                                                 const Tensor& stat1, const Tensor& weight) {
  if (norm.kind == NormSpec::kLayerNorm) {
    static const auto op = find_op("transformer_fp8::layernorm_bwd")
        .typed<std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                  const Tensor&, const Tensor&, bool)>();
    return op.call(dy, x, stat0, stat1, weight, norm.zero_centered_gamma);
  }
  static const auto op = find_op("transformer_fp8::rmsnorm_bwd")
      .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                        const Tensor&, bool)>();
  auto [dx, dweight] = op.call(dy, x, stat0, weight, norm.zero_centered_gamma);
  return {dx, dweight, Tensor()};
}

// ---- row padding, as ops.pad_rows and ops.function_output ---------------------------------

inline Tensor pad_rows(const Tensor& x) {
  const int64_t extra = (kRowAlign - x.size(0) % kRowAlign) % kRowAlign;
  return extra ? at::constant_pad_nd(x, {0, 0, 0, extra}, 0) : x;
}

// The first `rows` rows of a GEMM output as a tensor of `shape`: not a view, so that the
// caller may change it in place (as torch.nn.Linear's output).
inline Tensor function_output(const Tensor& out, int64_t rows, at::IntArrayRef shape) {
  if (out.size(0) == rows && out.sizes() == shape) return out;  // (no operator to call)
  return at::_unsafe_view(out.size(0) != rows ? out.narrow(0, 0, rows) : out, shape);
}

inline std::vector<int64_t> with_last(at::IntArrayRef lead, int64_t last) {
  std::vector<int64_t> shape(lead.begin(), lead.end());
  shape.push_back(last);
  return shape;
}

// What the autograd kernel of an operator with a Tensor(a!) argument does after writing it.
inline void bump_version(const Tensor& written) { written.unsafeGetTensorImpl()->bump_version(); }

// ---- argument checks ----------------------------------------------------------------------

inline void check_state(const char* op, const Tensor& t, const char* name, int64_t numel,
                 const Tensor& weight) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 1 && t.numel() == numel,
              "transformer_fp8: argument '", name, "' of ", op, " must be a float32 "
              "tensor of ", numel, " element(s) (a slice of the layer's FP8 state), got ",
              t.scalar_type(), " of shape ", t.sizes());
  TORCH_CHECK(t.device() == weight.device(), "transformer_fp8: argument '", name,
              "' of ", op, " must be on the weight's device ", weight.device(),
              ", got ", t.device());
}

inline bool is_step_high_precision(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

// What the step's kernels would refuse only after the first cast had written its amax slot:
// checked first, so that a refused call leaves the FP8 state as it was.
inline void check_step_tensor(const char* op, const Tensor& t, const char* name,
                              const Tensor& weight) {
  TORCH_CHECK(is_step_high_precision(t.scalar_type()), "transformer_fp8: argument '", name,
              "' of ", op, " must be float32, bfloat16 or float16, got ", t.scalar_type());
  TORCH_CHECK(t.device() == weight.device(), "transformer_fp8: argument '", name, "' of ", op,
              " must be on the weight's device ", weight.device(), ", got ", t.device());
}

inline void check_step_dtypes(const char* op, at::ScalarType fwd_dtype, at::ScalarType bwd_dtype,
                              at::ScalarType out_dtype) {
  TORCH_CHECK(fwd_dtype == at::kFloat8_e4m3fn, "transformer_fp8: argument 'fwd_dtype' of ", op,
              " must be float8_e4m3fn (the forward GEMM multiplies two fwd_dtype operands, and "
              "E5M2 x E5M2 is no FP8 GEMM), got ", fwd_dtype);
  TORCH_CHECK(bwd_dtype == at::kFloat8_e4m3fn || bwd_dtype == at::kFloat8_e5m2,
              "transformer_fp8: argument 'bwd_dtype' of ", op, " must be float8_e4m3fn or "
              "float8_e5m2, got ", bwd_dtype);
  TORCH_CHECK(is_step_high_precision(out_dtype), "transformer_fp8: argument 'out_dtype' of ", op,
              " must be float32, bfloat16 or float16, got ", out_dtype);
}

inline void check_shapes(const char* op, const Tensor& input, const Tensor& weight,
                  const std::optional<Tensor>& bias) {
  check_step_tensor(op, weight, "weight", weight);
  check_step_tensor(op, input, "input", weight);
  if (bias.has_value()) check_step_tensor(op, *bias, "bias", weight);
  TORCH_CHECK(weight.dim() == 2, "transformer_fp8: argument 'weight' of ", op, " must be 2-D "
              "[out_features, in_features], got shape ", weight.sizes());
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) == weight.size(1), "transformer_fp8: argument "
              "'input' of ", op, " must have shape [..., ", weight.size(1), "] (the weight's "
              "in_features), got ", input.sizes());
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == weight.size(0)),
              "transformer_fp8: argument 'bias' of ", op, " must have shape [", weight.size(0),
              "], got ", bias->sizes());
}

// ---- the forward's copy of delayed scaling's scale_invs -----------------------------------

// The forward casts' scale_invs, 1 / scale of each cast's scale [1], made once per forward as
// new tensors: the update at the context's exit rewrites the state in place before backward
// multiplies the saved transposes. Taken from the scales the casts use, not from the
// scale_inv buffer: a buffer out of step with its scale (an EMA that averages buffers averages
// the two apart) must not scale the output. The update writes scale_inv = 1 / scale, so in
// step the two agree bit for bit. On CUDA the entries sit 16 bytes apart: cuBLASLt refuses a
// scale 4 bytes into a buffer, and fp8_gemm would copy each again before every GEMM.
inline std::vector<Tensor> scale_invs_of(std::initializer_list<Tensor> scales) {
  const Tensor& first = *scales.begin();
  const int64_t n = static_cast<int64_t>(scales.size());
  const int64_t stride = first.is_cuda() ? 4 : 1;
  const Tensor all = at::empty({n * stride}, first.options());
  std::vector<Tensor> entries;
  entries.reserve(n);
  int64_t i = 0;
  for (const Tensor& scale : scales) {
    Tensor entry = all.narrow(0, i++ * stride, 1);
    at::reciprocal_out(entry, scale);
    entries.push_back(std::move(entry));
  }
  return entries;
}

// ---- one cast, as quantizer.py's TensorQuantizer.cast --------------------------------------

struct Operand {
  Tensor data, data_t, scale_inv;  // data_t undefined unless asked for
};

// The cast of x with `scale` (its transpose too if asked), max |x| recorded into amax_slot if
// given: delayed scaling's cast (the stored scale, the amax into history row 0).
inline Operand cast(const Tensor& x, const Tensor& scale, const Tensor& scale_inv,
             const std::optional<Tensor>& amax_slot, at::ScalarType dtype, bool with_transpose) {
  Operand q{Tensor(), Tensor(), scale_inv};
  if (with_transpose) {
    std::tie(q.data, q.data_t) = cast_transpose_to_fp8(x, scale, dtype, amax_slot);
  } else {
    q.data = cast_to_fp8(x, scale, dtype, amax_slot);
  }
  return q;
}

inline double fp8_max(at::ScalarType dtype) {
  return dtype == at::ScalarType::Float8_e4m3fn ? kE4M3Max : kE5M2Max;
}

// Current scaling in one process: the scale of x's own amax (margin 0), nothing recorded.
inline Operand cast_current(const Tensor& x, at::ScalarType dtype, bool with_transpose) {
  const Tensor scale = compute_scale_from_amax(amax_of(x).reshape({1}), fp8_max(dtype));
  return cast(x, scale, scale.reciprocal(), std::nullopt, dtype, with_transpose);
}

// A tensor's delayed-scaling state for one cast: its scale, scale_inv and amax slot (history
// row 0); all undefined for current scaling (the scale of the tensor's own amax).
struct CastState {
  Tensor scale, scale_inv, amax;
  bool delayed() const { return scale.defined(); }
};

// The cast of grad_output [rows, N] (rows padded) and, if asked, the bias gradient (float32
// sums, in g's dtype), as quantizer.py's cast_grad_output: delayed scaling reads g once for
// both (cast_transpose_dbias); current scaling sums g first, then casts it with the scale of
// its own amax. Returns (Operand, dbias or undefined).
inline std::tuple<Operand, Tensor> cast_grad_output(const Tensor& g_2d, const CastState& state,
                                                    at::ScalarType dtype, bool with_transpose,
                                                    bool with_dbias) {
  if (!state.delayed()) {
    Tensor dbias;
    if (with_dbias) {
      dbias = g_2d.sum(at::IntArrayRef{0}, /*keepdim=*/false, at::kFloat).to(g_2d.scalar_type());
    }
    return {cast_current(pad_rows(g_2d), dtype, with_transpose), dbias};
  }
  bump_version(state.amax);  // (written below autograd)
  if (with_dbias) {
    Operand g_q{Tensor(), Tensor(), state.scale_inv};
    Tensor dbias;
    std::tie(g_q.data, g_q.data_t, dbias) = cast_transpose_dbias(g_2d, state.scale, dtype,
                                                                 state.amax);
    return {g_q, dbias};
  }
  return {cast(pad_rows(g_2d), state.scale, state.scale_inv, state.amax, dtype, with_transpose),
          Tensor()};
}

// ---- the activation between two GEMMs (LayerNormMLP), as layernorm_mlp.py's casts ---------

// act(x) quantised (rows padded): delayed scaling in the activation's kernel (max |act(x)|
// into the amax slot); current scaling from its high-precision output.
inline Operand cast_activation(const Tensor& x, const std::string& activation,
                               const CastState& state, at::ScalarType dtype,
                               bool with_transpose) {
  if (!state.delayed()) {
    static const auto op = find_op("transformer_fp8::activation_fwd")
        .typed<Tensor(const Tensor&, c10::string_view)>();
    return cast_current(pad_rows(op.call(x, activation)), dtype, with_transpose);
  }
  static const auto op = find_op("transformer_fp8::activation_fwd_fp8")
      .typed<std::tuple<Tensor, Tensor>(const Tensor&, c10::string_view, const Tensor&,
                                        at::ScalarType, const std::optional<Tensor>&, bool,
                                        int64_t)>();
  Operand q{Tensor(), Tensor(), state.scale_inv};
  Tensor y_t;
  std::tie(q.data, y_t) = op.call(x, activation, state.scale, dtype, state.amax,
                                  with_transpose, kRowAlign);
  if (with_transpose) q.data_t = y_t;
  bump_version(state.amax);
  return q;
}

// d(loss)/dx of the activation from dy = d(loss)/d(act(x)), quantised (rows padded), and its
// column sums (the bias gradient of the GEMM that made x) if asked: (Operand, dbias or
// undefined). Delayed scaling in the activation backward's kernel.
inline std::tuple<Operand, Tensor> cast_activation_grad(const Tensor& dy, const Tensor& x,
                                                        const std::string& activation,
                                                        const CastState& state,
                                                        at::ScalarType dtype,
                                                        bool with_transpose, bool with_dbias) {
  if (!state.delayed()) {
    static const auto op = find_op("transformer_fp8::activation_bwd")
        .typed<Tensor(const Tensor&, const Tensor&, c10::string_view)>();
    const Tensor dx = op.call(dy, x, activation);
    Tensor dbias;
    if (with_dbias) {
      dbias = dx.sum(at::IntArrayRef{0}, /*keepdim=*/false, at::kFloat).to(dx.scalar_type());
    }
    return {cast_current(pad_rows(dx), dtype, with_transpose), dbias};
  }
  static const auto op = find_op("transformer_fp8::activation_bwd_fp8")
      .typed<std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, c10::string_view,
                                                const Tensor&, at::ScalarType,
                                                const std::optional<Tensor>&, bool, bool,
                                                int64_t)>();
  Operand q{Tensor(), Tensor(), state.scale_inv};
  Tensor dx_t, dbias;
  std::tie(q.data, dx_t, dbias) = op.call(dy, x, activation, state.scale, dtype, state.amax,
                                          with_transpose, with_dbias, kRowAlign);
  if (with_transpose) q.data_t = dx_t;
  bump_version(state.amax);
  return {q, with_dbias ? dbias : Tensor()};
}

// Under create_graph=True a step's gradients take a node that raises if they are
// differentiated again, as modules/once_differentiable.py does for the Python path: always,
// not only when grad_output requires grad (a gradient penalty's grad_output is a constant,
// while the gradients still depend on the weights). `what`: the step, in the message.
inline variable_list once_differentiable(variable_list grads, const char* what) {
  if (!at::GradMode::is_enabled()) return grads;
  for (auto& grad : grads) {
    if (!grad.defined()) continue;
    grad = grad.detach();
    grad.set_requires_grad(true);
  }
  torch::autograd::DelayedError error(
      std::string("transformer_fp8: trying to differentiate twice the FP8 ") + what +
          " backward, which is once_differentiable (no double backward); run the layer "
          "outside fp8_autocast for that",
      static_cast<int64_t>(grads.size()));
  return error.apply(std::move(grads));
}


// The norm's arguments, checked: its NormSpec.
inline NormSpec norm_spec(const char* op, const Tensor& input, const Tensor& norm_weight,
                   const std::optional<Tensor>& norm_bias, const std::string& normalization,
                   double eps, bool zero_centered_gamma) {
  const NormSpec::Kind kind = norm_kind(normalization, op);
  const int64_t features = input.size(-1);
  TORCH_CHECK(norm_weight.dim() == 1 && norm_weight.size(0) == features, "transformer_fp8: "
              "argument 'norm_weight' of ", op, " must have shape [", features, "] (the "
              "input's features), got ", norm_weight.sizes());
  TORCH_CHECK(!norm_bias.has_value() || kind == NormSpec::kLayerNorm, "transformer_fp8: "
              "argument 'norm_bias' of ", op, " must be None for RMSNorm (it has no bias)");
  TORCH_CHECK(!norm_bias.has_value() || (norm_bias->dim() == 1 && norm_bias->size(0) == features),
              "transformer_fp8: argument 'norm_bias' of ", op, " must have shape [", features,
              "], got ", norm_bias->sizes());
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, "transformer_fp8: argument 'eps' of ", op,
              " must be a finite number >= 0, got ", eps);
  return NormSpec{kind, eps, zero_centered_gamma};
}

// ---- the Python side -------------------------------------------------------------------------

// Which backward pass last called backward_step.on_backward(): one per BackwardStep
// (backward_step.py, its `_once`), shared by the hooks of its nodes (CallOnBackward). The first hook
// of a pass (autograd's graph task) records the pass and calls into Python; the others of the
// same pass only compare, without the GIL. The step clears it when the update it queued has
// run, or was discarded.
struct BackwardOnce {
  explicit BackwardOnce(const pybind11::object& backward_step)
      : step(pybind11::weakref(backward_step)) {}
  ~BackwardOnce() {
    if (!Py_IsInitialized()) {  // (the interpreter has gone: nothing left to release)
      step.release();
      return;
    }
    pybind11::gil_scoped_acquire gil;  // (the last hook may die on an autograd thread)
    step = pybind11::weakref();
  }
  // The BackwardStep, or None once it has gone (call with the GIL held).
  pybind11::object backward_step() const { return step(); }

  static constexpr int kNone = -1;  // (graph task ids are >= 0)
  std::atomic<int> task{kNone};
  pybind11::weakref step;  // (weak: the step holds this object)
};

// Calls backward_step.on_backward() when the node it is attached to is about to run, unless an
// earlier node of the same backward pass has (BackwardOnce): delayed scaling's BackwardStep (backward_step.py)
// queues the grad_output update for the end of the backward pass (as a pre-hook registered from
// Python would, without the host cost of registering one per call, or of a Python call per
// node). Compiled autograd never runs C++ hooks: it asks each for its compiled_args on every
// backward pass it runs, where this one calls backward_step.hold_for_compiled_autograd()
// instead (the update then runs at the next outermost fp8_autocast, as after any compiled
// backward).
//
// The hook holds the BackwardStep itself (made with the GIL held): the node's backward must
// find it. Nothing else may: an isolated fp8_autocast's steps (a graphed callable's) are dropped
// when the context exits, before the backward pass, and a weak reference then found None (the
// grad_output histories of LayerNormLinear and LayerNormMLP were never updated in CUDA graphs).
class CallOnBackward : public torch::autograd::FunctionPreHook {
 public:
  explicit CallOnBackward(std::shared_ptr<BackwardOnce> once)
      : once_(std::move(once)), step_(once_->backward_step()) {}
  ~CallOnBackward() override {
    if (!Py_IsInitialized()) {  // (the interpreter has gone: nothing left to release)
      step_.release();
      return;
    }
    pybind11::gil_scoped_acquire gil;  // (a node may die on an autograd thread)
    step_ = pybind11::object();
  }
  variable_list operator()(const variable_list& grads) override {
    const int task = torch::autograd::get_current_graph_task_id();
    if (once_->task.exchange(task) != task) {
      pybind11::gil_scoped_acquire gil;
      if (!step_.is_none()) step_.attr("on_backward")();
    }
    return grads;
  }
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& /*args*/) const override {
    pybind11::gil_scoped_acquire gil;
    if (!step_.is_none()) step_.attr("hold_for_compiled_autograd")();
  }

 private:
  std::shared_ptr<BackwardOnce> once_;
  pybind11::object step_;  // the BackwardStep (None if it had gone)
};

// out, with backward_step's on_backward attached to its node (None: nothing attached).
inline Tensor call_on_backward(Tensor out, const pybind11::object& backward_step) {
  if (!backward_step.is_none() && out.grad_fn() != nullptr) {
    auto once = backward_step.attr("_once").cast<std::shared_ptr<BackwardOnce>>();
    out.grad_fn()->add_pre_hook(std::make_unique<CallOnBackward>(std::move(once)));
  }
  return out;
}


}  // namespace step
}  // namespace transformer_fp8
