// One Linear GEMM, forward and backward, as one operator with its autograd in C++ (any device:
// it calls the CPU or CUDA kernels of the other operators through the dispatcher):
//   fp8_linear_delayed  DelayedScaling: the stored scales, amaxes recorded into history row 0;
//   fp8_linear_current  Float8CurrentScaling in one process: each tensor's scale from its own
//                       amax (no cross-rank reduction: the Python path does that).
//
// Each makes the same operator calls, with the same arguments, as modules/linear.py's
// _Fp8LinearFunction with the quantizers of quantization/roles.py, so its results and the
// amaxes it records are bit for bit that path's (tests/test_linear_fused_step.py); it only
// spares the host the Python work of the autograd function, its plan and its quantizers.
//
// Forward: input [..., K] and weight [N, K] cast to FP8, out = x @ w^T (+ bias) by fp8_gemm.
// Backward: grad_output cast (delayed: the bias gradient from the same read), dgrad and wgrad
// by fp8_gemm. A delayed grad_output scale is read when the backward runs, as the Python path
// reads it.
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/extension.h>

#include <array>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "fp8_common.h"
#include "python_module.h"

namespace transformer_fp8 {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int64_t kRowAlign = 16;  // ops.GEMM_ALIGN: FP8 GEMM operands get rows padded to it

// ---- the operators called, looked up once ------------------------------------------------

c10::OperatorHandle find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

// amax: the slot the cast records max |x| into, or none.
Tensor cast_to_fp8(const Tensor& x, const Tensor& scale, at::ScalarType dtype,
                   const std::optional<Tensor>& amax) {
  static const auto op = find_op("transformer_fp8::cast_to_fp8")
      .typed<Tensor(const Tensor&, const Tensor&, at::ScalarType, const std::optional<Tensor>&)>();
  return op.call(x, scale, dtype, amax);
}

std::tuple<Tensor, Tensor> cast_transpose_to_fp8(const Tensor& x, const Tensor& scale,
                                                 at::ScalarType dtype,
                                                 const std::optional<Tensor>& amax) {
  static const auto op = find_op("transformer_fp8::cast_transpose_to_fp8")
      .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, at::ScalarType,
                                        const std::optional<Tensor>&)>();
  return op.call(x, scale, dtype, amax);
}

std::tuple<Tensor, Tensor, Tensor> cast_transpose_dbias(const Tensor& x, const Tensor& scale,
                                                        at::ScalarType dtype, const Tensor& amax) {
  static const auto op = find_op("transformer_fp8::cast_transpose_dbias")
      .typed<std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, at::ScalarType,
                                                const std::optional<Tensor>&, int64_t)>();
  return op.call(x, scale, dtype, amax, kRowAlign);
}

Tensor fp8_gemm(const Tensor& a, const Tensor& a_scale_inv, const Tensor& b,
                const Tensor& b_scale_inv, at::ScalarType out_dtype,
                const std::optional<Tensor>& bias, bool fast_accum) {
  static const auto op = find_op("transformer_fp8::fp8_gemm")
      .typed<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, at::ScalarType,
                    const std::optional<Tensor>&, bool)>();
  return op.call(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, fast_accum);
}

Tensor amax_of(const Tensor& x) {
  static const auto op = find_op("transformer_fp8::amax").typed<Tensor(const Tensor&)>();
  return op.call(x);
}

Tensor compute_scale_from_amax(const Tensor& amax, double fp8_max) {
  static const auto op = find_op("transformer_fp8::compute_scale_from_amax")
      .typed<Tensor(const Tensor&, double, int64_t)>();
  return op.call(amax, fp8_max, /*margin=*/0);
}

// ---- row padding, as ops.pad_rows and ops.function_output ---------------------------------

Tensor pad_rows(const Tensor& x) {
  const int64_t extra = (kRowAlign - x.size(0) % kRowAlign) % kRowAlign;
  return extra ? at::constant_pad_nd(x, {0, 0, 0, extra}, 0) : x;
}

// The first `rows` rows of a GEMM output as a tensor of `shape`: not a view, so that the
// caller may change it in place (as torch.nn.Linear's output).
Tensor function_output(const Tensor& out, int64_t rows, at::IntArrayRef shape) {
  if (out.size(0) == rows && out.sizes() == shape) return out;  // (no operator to call)
  return at::_unsafe_view(out.size(0) != rows ? out.narrow(0, 0, rows) : out, shape);
}

std::vector<int64_t> with_last(at::IntArrayRef lead, int64_t last) {
  std::vector<int64_t> shape(lead.begin(), lead.end());
  shape.push_back(last);
  return shape;
}

// What the autograd kernel of an operator with a Tensor(a!) argument does after writing it.
void bump_version(const Tensor& written) { written.unsafeGetTensorImpl()->bump_version(); }

// ---- argument checks ----------------------------------------------------------------------

void check_state(const Tensor& t, const char* name, int64_t numel, const Tensor& weight) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 1 && t.numel() == numel,
              "transformer_fp8: argument '", name, "' of fp8_linear_delayed must be a float32 "
              "tensor of ", numel, " element(s) (a slice of the layer's FP8 state), got ",
              t.scalar_type(), " of shape ", t.sizes());
  TORCH_CHECK(t.device() == weight.device(), "transformer_fp8: argument '", name,
              "' of fp8_linear_delayed must be on the weight's device ", weight.device(),
              ", got ", t.device());
}

void check_shapes(const char* op, const Tensor& input, const Tensor& weight,
                  const std::optional<Tensor>& bias) {
  TORCH_CHECK(weight.dim() == 2, "transformer_fp8: argument 'weight' of ", op, " must be 2-D "
              "[out_features, in_features], got shape ", weight.sizes());
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) == weight.size(1), "transformer_fp8: argument "
              "'input' of ", op, " must have shape [..., ", weight.size(1), "] (the weight's "
              "in_features), got ", input.sizes());
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == weight.size(0)),
              "transformer_fp8: argument 'bias' of ", op, " must have shape [", weight.size(0),
              "], got ", bias->sizes());
}

// ---- one cast, as quantizer.py's TensorQuantizer.cast --------------------------------------

struct Operand {
  Tensor data, data_t, scale_inv;  // data_t undefined unless asked for
};

// The cast of x with `scale` (its transpose too if asked), max |x| recorded into amax_slot if
// given: delayed scaling's cast (the stored scale, the amax into history row 0).
Operand cast(const Tensor& x, const Tensor& scale, const Tensor& scale_inv,
             const std::optional<Tensor>& amax_slot, at::ScalarType dtype, bool with_transpose) {
  Operand q{Tensor(), Tensor(), scale_inv};
  if (with_transpose) {
    std::tie(q.data, q.data_t) = cast_transpose_to_fp8(x, scale, dtype, amax_slot);
  } else {
    q.data = cast_to_fp8(x, scale, dtype, amax_slot);
  }
  return q;
}

double fp8_max(at::ScalarType dtype) {
  return dtype == at::ScalarType::Float8_e4m3fn ? kE4M3Max : kE5M2Max;
}

// Current scaling in one process: the scale of x's own amax (margin 0), nothing recorded.
Operand cast_current(const Tensor& x, at::ScalarType dtype, bool with_transpose) {
  const Tensor scale = compute_scale_from_amax(amax_of(x).reshape({1}), fp8_max(dtype));
  return cast(x, scale, scale.reciprocal(), std::nullopt, dtype, with_transpose);
}

// ---- the autograd function ------------------------------------------------------------------

// What backward needs besides its saved variables, packed into one saved_data entry (each entry
// costs a string hash and allocations per call): the dtypes of grad_output's cast and of the
// gradients, whether there is a bias, whether the scaling is delayed, and the input's shape.
struct BackwardMeta {
  at::ScalarType bwd_dtype, input_dtype, weight_dtype, bias_dtype;
  bool has_bias, delayed;
  std::vector<int64_t> input_shape;

  static constexpr size_t kShapeStart = 6;
  std::vector<int64_t> pack() const {
    std::vector<int64_t> packed{static_cast<int64_t>(bwd_dtype), static_cast<int64_t>(input_dtype),
                                static_cast<int64_t>(weight_dtype),
                                static_cast<int64_t>(bias_dtype), has_bias ? 1 : 0,
                                delayed ? 1 : 0};
    packed.insert(packed.end(), input_shape.begin(), input_shape.end());
    return packed;
  }
  static BackwardMeta unpack(const std::vector<int64_t>& packed) {
    return {static_cast<at::ScalarType>(packed[0]), static_cast<at::ScalarType>(packed[1]),
            static_cast<at::ScalarType>(packed[2]), static_cast<at::ScalarType>(packed[3]),
            packed[4] != 0, packed[5] != 0,
            std::vector<int64_t>(packed.begin() + kShapeStart, packed.end())};
  }
};

// The delayed-scaling state the step takes, one tensor per entry (the Python caller slices the
// layer's buffers once and keeps the slices): the input's and the weight's amax slot (history
// row 0) and scale, their scale_invs [input, weight], and grad_output's amax slot, scale and
// scale_inv.
enum StateIndex : size_t {
  kInputAmax, kWeightAmax, kInputScale, kWeightScale, kFwdScaleInv,
  kGradAmax, kGradScale, kGradScaleInv, kStateSize
};
// Arguments of forward, each state tensor counting as one: what backward returns gradients for.
constexpr size_t kMaxForwardInputs = 3 + kStateSize + 5;

struct Fp8LinearStep : public torch::autograd::Function<Fp8LinearStep> {
  // state: delayed scaling's tensors (StateIndex), or empty for current scaling.
  // needs_input_grad / needs_weight_grad: whether backward will want dgrad / wgrad (the
  // transposes are cast only then).
  static Tensor forward(AutogradContext* ctx, const Tensor& input, const Tensor& weight,
                        const std::optional<Tensor>& bias, at::TensorList state,
                        at::ScalarType fwd_dtype, at::ScalarType bwd_dtype,
                        at::ScalarType out_dtype, bool needs_input_grad,
                        bool needs_weight_grad) {
    // The operators below need no autograd of their own (this node is theirs): dispatched
    // past the autograd and view-tracking kernels, a large part of the host time otherwise.
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const bool delayed = !state.empty();
    const int64_t out_features = weight.size(0), in_features = weight.size(1);
    const Tensor inp_2d = input.dim() == 2 ? input : input.reshape({-1, in_features});
    const int64_t rows = inp_2d.size(0);
    const Tensor x_pad = pad_rows(inp_2d);
    Operand x_q, w_q;
    if (delayed) {
      // A copy of the scale_invs: the update at the context's exit rewrites them in place
      // before backward multiplies the saved transposes. On CUDA the weight's copy sits 16
      // bytes after the input's: cuBLASLt refuses a scale 4 bytes into a buffer, and fp8_gemm
      // would copy it again before each GEMM that reads it.
      const Tensor& fwd_scale_inv = state[kFwdScaleInv];
      Tensor scale_inv;
      int64_t weight_slot = 1;
      if (fwd_scale_inv.is_cuda()) {
        scale_inv = at::empty({8}, fwd_scale_inv.options());
        scale_inv.as_strided({2}, {4}).copy_(fwd_scale_inv);
        weight_slot = 4;
      } else {
        scale_inv = fwd_scale_inv.clone();
      }
      x_q = cast(x_pad, state[kInputScale], scale_inv.narrow(0, 0, 1), state[kInputAmax],
                 fwd_dtype, needs_weight_grad);
      w_q = cast(weight, state[kWeightScale], scale_inv.narrow(0, weight_slot, 1),
                 state[kWeightAmax], fwd_dtype, needs_input_grad);
      bump_version(state[kInputAmax]);  // written through the kernels, below autograd
      bump_version(state[kWeightAmax]);
    } else {
      x_q = cast_current(x_pad, fwd_dtype, needs_weight_grad);
      w_q = cast_current(weight, fwd_dtype, needs_input_grad);
    }
    std::optional<Tensor> gemm_bias;
    if (bias.has_value()) gemm_bias = bias->scalar_type() == out_dtype ? *bias : bias->to(out_dtype);
    const Tensor out = fp8_gemm(x_q.data, x_q.scale_inv, w_q.data, w_q.scale_inv, out_dtype,
                                gemm_bias, /*fast_accum=*/true);
    // Backward keeps the FP8 transposes only, not the high-precision input.
    ctx->save_for_backward({x_q.data_t, x_q.scale_inv, w_q.data_t, w_q.scale_inv});
    // grad_output's state is read, and its amax written, when backward runs: kept as values,
    // not saved variables (the update changes them in place between the passes). One entry
    // per tensor: compiled autograd lifts a tensor entry into its graph, not a list of them.
    if (delayed) {
      ctx->saved_data["grad_amax"] = state[kGradAmax];
      ctx->saved_data["grad_scale"] = state[kGradScale];
      ctx->saved_data["grad_scale_inv"] = state[kGradScaleInv];
    }
    ctx->saved_data["meta"] =
        BackwardMeta{bwd_dtype, input.scalar_type(), weight.scalar_type(),
                     bias.has_value() ? bias->scalar_type() : out_dtype, bias.has_value(),
                     delayed, input.sizes().vec()}
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
    return once_differentiable(std::move(grads), grad_outputs[0]);
  }

  // Under create_graph=True the gradients take a node that raises if they are differentiated
  // again, as torch.autograd.function.once_differentiable does for the Python path.
  static variable_list once_differentiable(variable_list grads, const Tensor& grad_out) {
    if (!at::GradMode::is_enabled() || !grad_out.requires_grad()) return grads;
    for (auto& grad : grads) {
      if (!grad.defined()) continue;
      grad = grad.detach();
      grad.set_requires_grad(true);
    }
    torch::autograd::DelayedError error(
        "transformer_fp8: trying to differentiate twice the FP8 Linear backward, which is "
        "once_differentiable (no double backward); run the layer outside fp8_autocast for that",
        static_cast<int64_t>(grads.size()));
    return error.apply(std::move(grads));
  }

  // The cast of grad_output [rows, N] and, if asked, the bias gradient (float32 sums, in g's
  // dtype): delayed scaling reads g once for both (cast_transpose_dbias); current scaling sums
  // g first, then casts it with the scale of its own amax.
  static std::tuple<Operand, Tensor> cast_grad_output(AutogradContext* ctx,
                                                      const BackwardMeta& meta,
                                                      const Tensor& g_2d, bool with_transpose,
                                                      bool with_dbias) {
    const at::ScalarType bwd_dtype = meta.bwd_dtype;
    if (!meta.delayed) {  // current scaling
      Tensor dbias;
      if (with_dbias) {
        dbias = g_2d.sum(at::IntArrayRef{0}, /*keepdim=*/false, at::kFloat).to(g_2d.scalar_type());
      }
      return {cast_current(pad_rows(g_2d), bwd_dtype, with_transpose), dbias};
    }
    const Tensor amax = ctx->saved_data["grad_amax"].toTensor();
    const Tensor scale = ctx->saved_data["grad_scale"].toTensor();
    const Tensor scale_inv = ctx->saved_data["grad_scale_inv"].toTensor();
    bump_version(amax);  // (written below autograd, as in forward)
    if (with_dbias) {
      Operand g_q{Tensor(), Tensor(), scale_inv};
      Tensor dbias;
      std::tie(g_q.data, g_q.data_t, dbias) = cast_transpose_dbias(g_2d, scale, bwd_dtype, amax);
      return {g_q, dbias};
    }
    return {cast(pad_rows(g_2d), scale, scale_inv, amax, bwd_dtype, with_transpose), Tensor()};
  }

  static variable_list gradients(AutogradContext* ctx, const variable_list& saved,
                                 const Tensor& grad_out) {
    const Tensor &x_t = saved[0], &x_scale_inv = saved[1], &w_t = saved[2],
                 &w_scale_inv = saved[3];
    const BackwardMeta meta = BackwardMeta::unpack(ctx->saved_data["meta"].toIntVector());
    // Output edges are numbered over the tensor arguments given: no bias, no edge for it.
    const bool needs_input_grad = ctx->needs_input_grad(0);
    const bool needs_weight_grad = ctx->needs_input_grad(1);
    const bool needs_bias_grad = meta.has_bias && ctx->needs_input_grad(2);

    const int64_t out_features = grad_out.size(-1);
    const Tensor g_2d = grad_out.dim() == 2 ? grad_out : grad_out.reshape({-1, out_features});
    const int64_t rows = g_2d.size(0);
    auto [g_q, grad_bias] =
        cast_grad_output(ctx, meta, g_2d, needs_weight_grad, needs_bias_grad);
    Tensor grad_input, grad_weight;
    if (needs_input_grad) {
      // dgrad [M, K] = grad_out [M, N] @ weight [N, K]; the b operand is weight^T [K, N]
      const Tensor dgrad = fp8_gemm(g_q.data, g_q.scale_inv, w_t, w_scale_inv, meta.input_dtype,
                                    std::nullopt, false);
      grad_input = function_output(dgrad, rows, meta.input_shape);
    }
    if (needs_weight_grad) {
      // wgrad [N, K] = grad_out^T [N, M] @ input [M, K]; the b operand is input^T [K, M]
      grad_weight = fp8_gemm(g_q.data_t, g_q.scale_inv, x_t, x_scale_inv, meta.weight_dtype,
                             std::nullopt, false);
    }
    if (needs_bias_grad && grad_bias.scalar_type() != meta.bias_dtype) {
      grad_bias = grad_bias.to(meta.bias_dtype);
    }
    // One entry per argument of forward (the undefined extras past current scaling's 8 are
    // dropped).
    variable_list grads(kMaxForwardInputs);
    grads[0] = grad_input;
    grads[1] = grad_weight;
    grads[2] = grad_bias;
    return grads;
  }
};

std::tuple<bool, bool> needs_grads(const Tensor& input, const Tensor& weight) {
  const bool grad_mode = at::GradMode::is_enabled();
  return {grad_mode && input.requires_grad(), grad_mode && weight.requires_grad()};
}

Tensor fp8_linear_delayed(const Tensor& input, const Tensor& weight,
                          const std::optional<Tensor>& bias, const Tensor& input_amax,
                          const Tensor& weight_amax, const Tensor& input_scale,
                          const Tensor& weight_scale, const Tensor& fwd_scale_inv,
                          const Tensor& grad_amax, const Tensor& grad_scale,
                          const Tensor& grad_scale_inv, at::ScalarType fwd_dtype,
                          at::ScalarType bwd_dtype, at::ScalarType out_dtype) {
  check_shapes("fp8_linear_delayed", input, weight, bias);
  check_state(input_amax, "input_amax", 1, weight);
  check_state(weight_amax, "weight_amax", 1, weight);
  check_state(input_scale, "input_scale", 1, weight);
  check_state(weight_scale, "weight_scale", 1, weight);
  check_state(fwd_scale_inv, "fwd_scale_inv", 2, weight);
  check_state(grad_amax, "grad_amax", 1, weight);
  check_state(grad_scale, "grad_scale", 1, weight);
  check_state(grad_scale_inv, "grad_scale_inv", 1, weight);
  const auto [needs_input_grad, needs_weight_grad] = needs_grads(input, weight);
  const std::array<Tensor, kStateSize> state{input_amax,    weight_amax, input_scale,
                                             weight_scale,  fwd_scale_inv, grad_amax,
                                             grad_scale,    grad_scale_inv};
  return Fp8LinearStep::apply(input, weight, bias, at::TensorList(state), fwd_dtype, bwd_dtype,
                              out_dtype, needs_input_grad, needs_weight_grad);
}

Tensor fp8_linear_current(const Tensor& input, const Tensor& weight,
                          const std::optional<Tensor>& bias, at::ScalarType fwd_dtype,
                          at::ScalarType bwd_dtype, at::ScalarType out_dtype) {
  check_shapes("fp8_linear_current", input, weight, bias);
  const auto [needs_input_grad, needs_weight_grad] = needs_grads(input, weight);
  return Fp8LinearStep::apply(input, weight, bias, at::TensorList(), fwd_dtype, bwd_dtype,
                              out_dtype, needs_input_grad, needs_weight_grad);
}

// ---- the Python entry of the eager step (modules/linear_fused_step.py) ---------------------

// Calls backward_step.on_backward() when the node it is attached to is about to run: delayed
// scaling's BackwardStep (amax_step.py), which queues the grad_output update for the end of the
// backward pass (as a pre-hook registered from Python would, without the host cost of
// registering one per call). Compiled autograd never runs C++ hooks: it asks each for its
// compiled_args on every backward pass it runs, where this one calls
// backward_step.hold_for_compiled_autograd() instead (the update then runs at the next
// outermost fp8_autocast, as after any compiled backward).
class CallOnBackward : public torch::autograd::FunctionPreHook {
 public:
  explicit CallOnBackward(pybind11::object backward_step) : step_(std::move(backward_step)) {}
  ~CallOnBackward() override {
    if (!Py_IsInitialized()) {  // (the interpreter has gone: nothing left to release)
      step_.release();
      return;
    }
    pybind11::gil_scoped_acquire gil;  // (the node may die on an autograd thread)
    step_ = pybind11::object();
  }
  variable_list operator()(const variable_list& grads) override {
    pybind11::gil_scoped_acquire gil;
    step_.attr("on_backward")();
    return grads;
  }
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& /*args*/) const override {
    pybind11::gil_scoped_acquire gil;
    step_.attr("hold_for_compiled_autograd")();
  }

 private:
  pybind11::object step_;
};

}  // namespace

TORCH_LIBRARY_IMPL(transformer_fp8, CompositeImplicitAutograd, m) {
  m.impl("fp8_linear_delayed", &fp8_linear_delayed);
  m.impl("fp8_linear_current", &fp8_linear_current);
}

// The operators' functions called directly from Python (an eager step, no dispatcher on the
// way in); linear_delayed also attaches backward_step's on_backward (see CallOnBackward) to
// the output's node (None: nothing attached).
void bind_linear_steps(pybind11::module_& module) {
  namespace py = pybind11;
  module.def(
      "linear_delayed",
      [](const Tensor& input, const Tensor& weight, const std::optional<Tensor>& bias,
         const Tensor& input_amax, const Tensor& weight_amax, const Tensor& input_scale,
         const Tensor& weight_scale, const Tensor& fwd_scale_inv, const Tensor& grad_amax,
         const Tensor& grad_scale, const Tensor& grad_scale_inv, at::ScalarType fwd_dtype,
         at::ScalarType bwd_dtype, at::ScalarType out_dtype, py::object backward_step) {
        Tensor out = fp8_linear_delayed(input, weight, bias, input_amax, weight_amax,
                                        input_scale, weight_scale, fwd_scale_inv, grad_amax,
                                        grad_scale, grad_scale_inv, fwd_dtype, bwd_dtype,
                                        out_dtype);
        if (!backward_step.is_none() && out.grad_fn() != nullptr)
          out.grad_fn()->add_pre_hook(std::make_unique<CallOnBackward>(std::move(backward_step)));
        return out;
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
}

}  // namespace transformer_fp8
