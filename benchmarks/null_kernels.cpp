// Host-cost measurement only (benchmarks/bench_host.py --null-kernels): CPU kernels for the
// transformer_fp8 operators that allocate their outputs, with the shapes and dtypes of the real
// kernels, and compute nothing. Loaded into a benchmark process, they replace the CPU kernels of
// the installed library (torch warns once per operator that it overrides a kernel), so a step's
// time is its host work: Python, the dispatcher, autograd and allocation. Never loaded by the
// package; the values these kernels return are garbage.
#include <torch/library.h>
#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <tuple>

namespace {

using at::Tensor;

Tensor like(const Tensor& x, at::IntArrayRef shape, at::ScalarType dtype) {
  return at::empty(shape, x.options().dtype(dtype));
}

int64_t padded(int64_t rows, int64_t multiple) {
  return multiple > 1 ? (rows + multiple - 1) / multiple * multiple : rows;
}

// y [rows padded, cols] and, if asked, y^T [cols, rows padded] (else an empty tensor).
std::tuple<Tensor, Tensor> fp8_pair(const Tensor& x, int64_t cols, at::ScalarType dtype,
                                    bool with_transpose, int64_t row_multiple) {
  const int64_t rows = padded(x.size(0), row_multiple);
  return {like(x, {rows, cols}, dtype),
          with_transpose ? like(x, {cols, rows}, dtype) : like(x, {0}, dtype)};
}

Tensor stats(const Tensor& x) { return like(x, {x.size(0)}, at::kFloat); }

bool gated(const std::string& activation) {
  return activation == "swiglu" || activation == "geglu" || activation == "reglu" ||
         activation == "qgeglu" || activation == "sreglu" || activation == "glu";
}

Tensor amax(const Tensor& x) { return like(x, {}, at::kFloat); }

Tensor cast_to_fp8(const Tensor& x, const Tensor&, at::ScalarType dtype,
                   const std::optional<Tensor>&) {
  return like(x, x.sizes(), dtype);
}

std::tuple<Tensor, Tensor> cast_transpose_to_fp8(const Tensor& x, const Tensor&,
                                                 at::ScalarType dtype,
                                                 const std::optional<Tensor>&) {
  return fp8_pair(x, x.size(1), dtype, true, 1);
}

Tensor cast_from_fp8(const Tensor& x, const Tensor&, at::ScalarType dtype) {
  return like(x, x.sizes(), dtype);
}

Tensor compute_scale_from_amax(const Tensor& amax, double, int64_t) {
  return like(amax, amax.sizes(), at::kFloat);
}

Tensor fp8_gemm(const Tensor& a, const Tensor&, const Tensor& b, const Tensor&,
                at::ScalarType out_dtype, const std::optional<Tensor>&, bool) {
  return like(a, {a.size(0), b.size(0)}, out_dtype);
}

std::tuple<Tensor, Tensor, Tensor> cast_transpose_dbias(const Tensor& x, const Tensor&,
                                                        at::ScalarType dtype,
                                                        const std::optional<Tensor>&,
                                                        int64_t row_multiple) {
  auto [y, y_t] = fp8_pair(x, x.size(1), dtype, true, row_multiple);
  return {y, y_t, like(x, {x.size(1)}, x.scalar_type())};
}

std::tuple<Tensor, Tensor, Tensor> layernorm_fwd(const Tensor& x, const Tensor&,
                                                 const std::optional<Tensor>&, double, bool) {
  return {like(x, x.sizes(), x.scalar_type()), stats(x), stats(x)};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> layernorm_fwd_fp8(
    const Tensor& x, const Tensor&, const std::optional<Tensor>&, double, bool, const Tensor&,
    at::ScalarType dtype, const std::optional<Tensor>&, bool with_transpose, bool return_hp,
    int64_t row_multiple) {
  auto [y, y_t] = fp8_pair(x, x.size(1), dtype, with_transpose, row_multiple);
  Tensor hp = return_hp ? like(x, x.sizes(), x.scalar_type()) : like(x, {0}, x.scalar_type());
  return {y, y_t, hp, stats(x), stats(x)};
}

std::tuple<Tensor, Tensor, Tensor> layernorm_bwd(const Tensor&, const Tensor& x, const Tensor&,
                                                 const Tensor&, const Tensor& weight, bool) {
  return {like(x, x.sizes(), x.scalar_type()), like(weight, weight.sizes(), weight.scalar_type()),
          like(weight, weight.sizes(), weight.scalar_type())};
}

std::tuple<Tensor, Tensor> rmsnorm_fwd(const Tensor& x, const Tensor&, double, bool) {
  return {like(x, x.sizes(), x.scalar_type()), stats(x)};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> rmsnorm_fwd_fp8(
    const Tensor& x, const Tensor&, double, bool, const Tensor&, at::ScalarType dtype,
    const std::optional<Tensor>&, bool with_transpose, bool return_hp, int64_t row_multiple) {
  auto [y, y_t] = fp8_pair(x, x.size(1), dtype, with_transpose, row_multiple);
  Tensor hp = return_hp ? like(x, x.sizes(), x.scalar_type()) : like(x, {0}, x.scalar_type());
  return {y, y_t, hp, stats(x)};
}

std::tuple<Tensor, Tensor> rmsnorm_bwd(const Tensor&, const Tensor& x, const Tensor&,
                                       const Tensor& weight, bool) {
  return {like(x, x.sizes(), x.scalar_type()), like(weight, weight.sizes(), weight.scalar_type())};
}

Tensor activation_fwd(const Tensor& x, c10::string_view activation) {
  const int64_t cols = gated(std::string(activation)) ? x.size(1) / 2 : x.size(1);
  return like(x, {x.size(0), cols}, x.scalar_type());
}

std::tuple<Tensor, Tensor> activation_fwd_fp8(const Tensor& x, c10::string_view activation,
                                              const Tensor&, at::ScalarType dtype,
                                              const std::optional<Tensor>&, bool with_transpose,
                                              int64_t row_multiple) {
  const int64_t cols = gated(std::string(activation)) ? x.size(1) / 2 : x.size(1);
  return fp8_pair(x, cols, dtype, with_transpose, row_multiple);
}

Tensor activation_bwd(const Tensor&, const Tensor& x, c10::string_view) {
  return like(x, x.sizes(), x.scalar_type());
}

std::tuple<Tensor, Tensor, Tensor> activation_bwd_fp8(
    const Tensor&, const Tensor& x, c10::string_view, const Tensor&, at::ScalarType dtype,
    const std::optional<Tensor>&, bool with_transpose, bool with_dbias, int64_t row_multiple) {
  auto [y, y_t] = fp8_pair(x, x.size(1), dtype, with_transpose, row_multiple);
  return {y, y_t, with_dbias ? like(x, {x.size(1)}, x.scalar_type()) : like(x, {0},
                                                                             x.scalar_type())};
}

}  // namespace

TORCH_LIBRARY_IMPL(transformer_fp8, CPU, m) {
  m.impl("amax", &amax);
  m.impl("cast_to_fp8", &cast_to_fp8);
  m.impl("cast_transpose_to_fp8", &cast_transpose_to_fp8);
  m.impl("cast_from_fp8", &cast_from_fp8);
  m.impl("compute_scale_from_amax", &compute_scale_from_amax);
  m.impl("fp8_gemm", &fp8_gemm);
  m.impl("cast_transpose_dbias", &cast_transpose_dbias);
  m.impl("layernorm_fwd", &layernorm_fwd);
  m.impl("layernorm_fwd_fp8", &layernorm_fwd_fp8);
  m.impl("layernorm_bwd", &layernorm_bwd);
  m.impl("rmsnorm_fwd", &rmsnorm_fwd);
  m.impl("rmsnorm_fwd_fp8", &rmsnorm_fwd_fp8);
  m.impl("rmsnorm_bwd", &rmsnorm_bwd);
  m.impl("activation_fwd", &activation_fwd);
  m.impl("activation_fwd_fp8", &activation_fwd_fp8);
  m.impl("activation_bwd", &activation_bwd);
  m.impl("activation_bwd_fp8", &activation_bwd_fp8);
}
