// CUDA kernels of the activation operators (forward and backward, in high precision or FP8,
// with fused dbias partial sums) and of cast_transpose_dbias (the identity "activation").
// Reference: csrc/cpu/activation.cpp.
//
// One block = 256 consecutive columns (blockIdx.y) x one chunk of kColumnChunkRows rows
// (blockIdx.x). Each thread walks its column down the chunk: loads and stores are coalesced
// over the warp, and its running column sum is the chunk's partial dbias, written without
// atomics (fused_common.cu adds the chunks in order: deterministic).
#include "device_utils.cuh"
#include "fused_math.cuh"
#include "fused_store.cuh"
#include "kernels.h"

namespace transformer_fp8 {
namespace cuda {
namespace {

constexpr int kThreads = 256;

// Columns: a gated x [rows, 2n] pairs column c (activated) with column n + c (linear gate);
// otherwise n = in_cols. Forward results are [rows, n]; backward results are [rows, in_cols].
template <typename InT, Fp8Out kOut>
__global__ void __launch_bounds__(kThreads)
activation_kernel(const InT* __restrict__ x, const InT* __restrict__ dy, int64_t rows,
                  int64_t in_cols, Activation act, InT* __restrict__ out_hp,
                  uint8_t* __restrict__ out_fp8, const float* __restrict__ scale_ptr,
                  float* amax, float* __restrict__ partials) {
  const bool gated = is_gated(act);
  const Activation base = base_activation(act);
  const int64_t n = gated ? in_cols / 2 : in_cols;
  const bool backward = dy != nullptr;
  const int64_t out_cols = backward ? in_cols : n;
  const int64_t c = static_cast<int64_t>(blockIdx.y) * kThreads + threadIdx.x;
  const int64_t chunk = blockIdx.x;
  const int64_t r_begin = chunk * kColumnChunkRows;
  const int64_t r_end = min(rows, r_begin + kColumnChunkRows);
  const float scale = kOut != Fp8Out::None ? *scale_ptr : 1.0f;
  float local_amax = 0.0f;
  float sum_first = 0.0f, sum_second = 0.0f;  // column c and (gated backward) column n + c

  auto store = [&](int64_t index, float v) {
    if (out_hp != nullptr) out_hp[index] = round_to<InT>(v);
    if constexpr (kOut != Fp8Out::None) out_fp8[index] = fp8_byte<kOut>(v, scale, local_amax);
  };

  if (c < n) {
    for (int64_t r = r_begin; r < r_end; ++r) {
      const InT x_raw = x[r * in_cols + c];
      const float a = to_float(x_raw);
      const float b = gated ? to_float(x[r * in_cols + n + c]) : 0.0f;
      if (!backward) {
        // out = act(a) (* b): the float32 value, never rounded to InT before the cast.
        const float v = gated ? pointwise(a, base) * b : pointwise(a, act);
        if constexpr (kOut != Fp8Out::None) {
          if (act == Activation::Identity) {
            // A plain cast of the input element: NaN keeps the sign of its bits.
            if (out_hp != nullptr) out_hp[r * out_cols + c] = x_raw;
            out_fp8[r * out_cols + c] = fp8_byte_of_input<kOut>(x_raw, scale, local_amax);
          } else {
            store(r * out_cols + c, v);
          }
        } else {
          store(r * out_cols + c, v);
        }
        sum_first += v;
      } else {
        const float d = to_float(dy[r * n + c]);
        if (gated) {
          // dx[:, c] = (dy * b) * act'(a), dx[:, n + c] = dy * act(a).
          const float da = pointwise_grad(d * b, a, base);
          const float db = d * pointwise(a, base);
          store(r * out_cols + c, da);
          store(r * out_cols + n + c, db);
          sum_first += da;
          sum_second += db;
        } else {
          const float da = pointwise_grad(d, a, act);
          store(r * out_cols + c, da);
          sum_first += da;
        }
      }
    }
    if (partials != nullptr) {
      partials[chunk * out_cols + c] = sum_first;
      if (backward && gated) partials[chunk * out_cols + n + c] = sum_second;
    }
  }
  if constexpr (kOut != Fp8Out::None) commit_amax(amax, local_amax);
}

}  // namespace

cudaError_t launch_activation(const void* x, const void* dy, HpType x_type, int64_t rows,
                              int64_t in_cols, Activation act, const FusedOutput& out,
                              float* partials, cudaStream_t stream) {
  const int64_t n = is_gated(act) ? in_cols / 2 : in_cols;
  if (rows == 0 || n == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(column_chunks(rows)),
                  static_cast<unsigned>((n + kThreads - 1) / kThreads));
  with_input_type(x_type, [&](auto* tag) {
    using InT = std::remove_pointer_t<decltype(tag)>;
    with_fp8_out(out, [&](auto out_kind) {
      activation_kernel<InT, decltype(out_kind)::value><<<grid, kThreads, 0, stream>>>(
          static_cast<const InT*>(x), static_cast<const InT*>(dy), rows, in_cols, act,
          static_cast<InT*>(out.hp), out.fp8, out.scale, out.amax, partials);
    });
  });
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace transformer_fp8
