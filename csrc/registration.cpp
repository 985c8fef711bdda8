// Every operator schema of the transformer_fp8 namespace, in one place. Kernels: csrc/cpu/*.cpp
// (CPU, also the executable reference) and csrc/cuda/kernels/, csrc/cuda/cublaslt/ (CUDA). Fake
// kernels for torch.compile live in transformer_fp8/ops/. The Python module _C that loads them:
// csrc/python_module.cpp.
#include <torch/library.h>

TORCH_LIBRARY(transformer_fp8, m) {
  // max |x| as a float32 0-dim tensor; NaN propagates; 0 for an empty x.
  m.def("amax(Tensor x) -> Tensor");
  // (x * scale) clamped to the FP8 range and rounded to nearest even; amax (if given) is
  // updated in place to max(amax, max |x|) in the same pass.
  m.def("cast_to_fp8(Tensor x, Tensor scale, ScalarType fp8_dtype, Tensor(a!)? amax=None) -> Tensor");
  // The same cast for a 2-D x, returning the FP8 tensor and its contiguous transpose.
  m.def("cast_transpose_to_fp8(Tensor x, Tensor scale, ScalarType fp8_dtype, Tensor(a!)? amax=None) -> (Tensor, Tensor)");
  // x_fp8 * scale_inv in float32, rounded to dtype.
  m.def("cast_from_fp8(Tensor x_fp8, Tensor scale_inv, ScalarType dtype) -> Tensor");
  // Delayed scaling for many tensors at once (one kernel launch on CUDA), in place.
  m.def("update_delayed_scaling(Tensor(a!)[] amax_histories, Tensor(b!)[] scales, Tensor(c!)[] scale_invs, float[] fp8_maxes, int margin, str amax_compute_algo) -> ()");
  // Current scaling: fp8_max / amax / 2**margin elementwise; 1.0 where amax is <= 0 or not finite.
  m.def("compute_scale_from_amax(Tensor amax, float fp8_max, int margin) -> Tensor");
  // out[M, N] = (a[M, K] * a_scale_inv) @ (b[N, K] * b_scale_inv)^T (+ bias[N]).
  m.def("fp8_gemm(Tensor a, Tensor a_scale_inv, Tensor b, Tensor b_scale_inv, ScalarType out_dtype, Tensor? bias=None, bool use_fast_accum=False) -> Tensor");

  // Fused norm / activation / dbias operators (csrc/cpu/norm.cpp, activation.cpp;
  // csrc/cuda/kernels/norm.cu, activation.cu). x is 2-D [M, N]; all math in float32; FP8
  // outputs are the saturating cast of the float32 result, with M padded to a multiple of
  // row_multiple by zero rows, amax over the M real rows, and an empty [0] where a transpose /
  // hp output / dbias is not asked for.
  // LayerNorm: y = (x - mean) * rstd * gamma + bias (gamma = weight (+1 if zero-centred)).
  m.def("layernorm_fwd(Tensor x, Tensor weight, Tensor? bias, float eps, bool zero_centered_gamma) -> (Tensor y, Tensor mean, Tensor rstd)");
  // LayerNorm emitting FP8 y (and its transpose, and y in x's dtype if return_hp).
  m.def("layernorm_fwd_fp8(Tensor x, Tensor weight, Tensor? bias, float eps, bool zero_centered_gamma, Tensor scale, ScalarType fp8_dtype, Tensor(a!)? amax, bool with_transpose, bool return_hp, int row_multiple) -> (Tensor y_fp8, Tensor y_t_fp8, Tensor y_hp, Tensor mean, Tensor rstd)");
  // LayerNorm backward from the forward's mean and rstd: dx (x's dtype), dweight, dbias (weight's dtype).
  m.def("layernorm_bwd(Tensor dy, Tensor x, Tensor mean, Tensor rstd, Tensor weight, bool zero_centered_gamma) -> (Tensor dx, Tensor dweight, Tensor dbias)");
  // RMSNorm: y = x * rstd * gamma, rstd = 1 / sqrt(mean(x^2) + eps).
  m.def("rmsnorm_fwd(Tensor x, Tensor weight, float eps, bool zero_centered_gamma) -> (Tensor y, Tensor rstd)");
  // RMSNorm emitting FP8 y, as layernorm_fwd_fp8.
  m.def("rmsnorm_fwd_fp8(Tensor x, Tensor weight, float eps, bool zero_centered_gamma, Tensor scale, ScalarType fp8_dtype, Tensor(a!)? amax, bool with_transpose, bool return_hp, int row_multiple) -> (Tensor y_fp8, Tensor y_t_fp8, Tensor y_hp, Tensor rstd)");
  // RMSNorm backward from the forward's rstd.
  m.def("rmsnorm_bwd(Tensor dy, Tensor x, Tensor rstd, Tensor weight, bool zero_centered_gamma) -> (Tensor dx, Tensor dweight)");
  // gelu (tanh), relu, silu, qgelu, srelu on [M, N]; swiglu, geglu, reglu, qgeglu, sreglu, glu:
  // act(x[:, :N]) * x[:, N:] on [M, 2N].
  m.def("activation_fwd(Tensor x, str activation) -> Tensor");
  // The activation emitting FP8 (and its transpose).
  m.def("activation_fwd_fp8(Tensor x, str activation, Tensor scale, ScalarType fp8_dtype, Tensor(a!)? amax, bool with_transpose, int row_multiple) -> (Tensor y_fp8, Tensor y_t_fp8)");
  // d(loss)/dx of the activation, x's shape and dtype.
  m.def("activation_bwd(Tensor dy, Tensor x, str activation) -> Tensor");
  // The activation backward emitting FP8 dx (and its transpose), with dbias = column sums of dx.
  m.def("activation_bwd_fp8(Tensor dy, Tensor x, str activation, Tensor scale, ScalarType fp8_dtype, Tensor(a!)? amax, bool with_transpose, bool with_dbias, int row_multiple) -> (Tensor dx_fp8, Tensor dx_t_fp8, Tensor dbias)");
  // cast_transpose_to_fp8 with row padding, plus dbias = x.sum(0) (float32 accumulation).
  m.def("cast_transpose_dbias(Tensor x, Tensor scale, ScalarType fp8_dtype, Tensor(a!)? amax, int row_multiple) -> (Tensor x_fp8, Tensor x_t_fp8, Tensor dbias)");
  // Block-scaled FP8 (csrc/blockwise_common.h): x [rows, cols] quantised per 1x128 tile, per
  // 128x128 block or per row (block_rows x block_cols = 1 x cols), each block with its own
  // scale; returns (x_fp8, scale_inv) in cuBLASLt's layout and, with_transpose, the same for x^T
  // quantised with its own blocks (else two empty tensors).
  m.def("quantize_blockwise(Tensor x, int block_rows, int block_cols, ScalarType fp8_dtype, bool power_2_scale, bool with_transpose) -> (Tensor, Tensor, Tensor, Tensor)");
  // out[M, N] = dequant(a [M, K]) @ dequant(b [N, K])^T (+ bias[N]); the scale_inv shapes give
  // the block modes. Accumulation is split (never fast) on CUDA.
  m.def("fp8_gemm_blockwise(Tensor a, Tensor a_scale_inv, Tensor b, Tensor b_scale_inv, ScalarType out_dtype, Tensor? bias=None) -> Tensor");
  // One Linear GEMM with its backward (csrc/linear_step.cpp, any device): input [..., K] and
  // weight [N, K] cast to FP8, out = x @ w^T (+ bias) in out_dtype; backward casts grad_output
  // and runs dgrad and wgrad in FP8. Delayed: input and weight cast with their scales (amaxes
  // recorded into their 1-element slots of history row 0; fwd_scale_inv is [input, weight]),
  // grad_output with grad_scale (amax into grad_amax, when backward runs). Current: each
  // tensor with the scale of its own amax (one process: no reduction across ranks). These
  // operators record amaxes only: the update of the scales from them is fp8_autocast's (the
  // modules call the operators' functions through transformer_fp8._C, which also registers
  // the layer's state with the step and queues the backward update).
  m.def("fp8_linear_current(Tensor input, Tensor weight, Tensor? bias, ScalarType fwd_dtype, ScalarType bwd_dtype, ScalarType out_dtype) -> Tensor");
  m.def("fp8_linear_delayed(Tensor input, Tensor weight, Tensor? bias, Tensor(a!) input_amax, Tensor(b!) weight_amax, Tensor input_scale, Tensor weight_scale, Tensor fwd_scale_inv, Tensor(c!) grad_amax, Tensor grad_scale, Tensor grad_scale_inv, ScalarType fwd_dtype, ScalarType bwd_dtype, ScalarType out_dtype) -> Tensor");
  // The same after a norm of the input (normalization "LayerNorm" or "RMSNorm", whose bias is
  // None): delayed scaling casts the norm's output in the norm's kernel.
  m.def("fp8_norm_linear_current(Tensor input, Tensor norm_weight, Tensor? norm_bias, str normalization, float eps, bool zero_centered_gamma, Tensor weight, Tensor? bias, ScalarType fwd_dtype, ScalarType bwd_dtype, ScalarType out_dtype) -> Tensor");
  m.def("fp8_norm_linear_delayed(Tensor input, Tensor norm_weight, Tensor? norm_bias, str normalization, float eps, bool zero_centered_gamma, Tensor weight, Tensor? bias, Tensor(a!) input_amax, Tensor(b!) weight_amax, Tensor input_scale, Tensor weight_scale, Tensor fwd_scale_inv, Tensor(c!) grad_amax, Tensor grad_scale, Tensor grad_scale_inv, ScalarType fwd_dtype, ScalarType bwd_dtype, ScalarType out_dtype) -> Tensor");
  // LayerNormMLP's step (csrc/norm_mlp_step.cpp): norm -> fc1 -> activation -> fc2 and its
  // backward, both GEMMs in FP8. Delayed: history row 0's slots (fwd_amax [4]: fc1 input, fc1
  // weight, fc2 input, fc2 weight; bwd_amax [2]: fc1's and fc2's grad_output), their scales
  // and scale_invs; the norm's and the activation's outputs cast in their kernels.
  m.def("fp8_norm_mlp_current(Tensor input, Tensor norm_weight, Tensor? norm_bias, str normalization, float eps, bool zero_centered_gamma, Tensor fc1_weight, Tensor? fc1_bias, Tensor fc2_weight, Tensor? fc2_bias, str activation, ScalarType fwd_dtype, ScalarType bwd_dtype, ScalarType out_dtype) -> Tensor");
  m.def("fp8_norm_mlp_delayed(Tensor input, Tensor norm_weight, Tensor? norm_bias, str normalization, float eps, bool zero_centered_gamma, Tensor fc1_weight, Tensor? fc1_bias, Tensor fc2_weight, Tensor? fc2_bias, str activation, Tensor(a!) fwd_amax, Tensor fwd_scale, Tensor fwd_scale_inv, Tensor(b!) bwd_amax, Tensor bwd_scale, Tensor bwd_scale_inv, ScalarType fwd_dtype, ScalarType bwd_dtype, ScalarType out_dtype) -> Tensor");
  // Statistics of an FP8 operand: x [rows, cols] quantised to q with x_scale (1 element, or one
  // per block_rows x block_cols block), as transformer_fp8/debug/stats.py's FIELDS vector
  // (float64 [12]); rows beyond min(x rows, q rows) are ignored.
  m.def("fp8_operand_stats(Tensor x, Tensor q, Tensor x_scale, float fp8_max, int block_rows, int block_cols) -> Tensor");
}
