// CUDA kernels of the activation operators (forward and backward, in high precision or FP8,
// with fused dbias partial sums) and of cast_transpose_dbias (the identity "activation").
// Reference: csrc/cpu/activation.cpp.
//
// One block = 256 threads of consecutive columns (blockIdx.y) x one chunk of kColumnChunkRows rows
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
constexpr int kRowsAhead = 4;  // rows whose loads a thread issues together

// Columns: a gated x [rows, 2n] pairs column c (activated) with column n + c (linear gate);
// otherwise n = in_cols. Forward results are [rows, n]; backward results are [rows, in_cols].
// Each thread owns kVec consecutive columns (kVec = 4: one 4-element access per load and
// store; the launcher checks n % 4 == 0 and the alignment). The activation and the direction
// are template parameters: chosen at run time, one kernel held every activation's code (up to
// 77 registers) and each thread had one load per operand in flight. Fixed, with kRowsAhead rows
// loaded together, a thread has 32-96 bytes in flight (bf16: 50-103 registers, ptxas -v).
template <typename InT, Fp8Out kOut, int kVec, Activation kAct, bool kBackward>
__global__ void __launch_bounds__(kThreads)
activation_kernel(const InT* __restrict__ x, const InT* __restrict__ dy, int64_t rows,
                  int64_t in_cols, InT* __restrict__ out_hp, uint8_t* __restrict__ out_fp8,
                  const float* __restrict__ scale_ptr, float* amax,
                  float* __restrict__ partials) {
  using Vec = VecOf<InT, kVec>;
  constexpr bool gated = is_gated(kAct);
  constexpr Activation act = kAct, base = base_activation(kAct);
  constexpr bool backward = kBackward;
  const int64_t n = gated ? in_cols / 2 : in_cols;
  const int64_t out_cols = backward ? in_cols : n;
  const int64_t c = (static_cast<int64_t>(blockIdx.y) * kThreads + threadIdx.x) * kVec;
  const int64_t chunk = blockIdx.x;
  const int64_t r_begin = chunk * kColumnChunkRows;
  const int64_t r_end = min(rows, r_begin + kColumnChunkRows);
  const float scale = kOut != Fp8Out::None ? *scale_ptr : 1.0f;
  float local_amax = 0.0f;
  float sum_first[kVec] = {}, sum_second[kVec] = {};  // columns c.. and (gated bwd) n + c..

  // Stores kVec float32 results at out[index..]: rounded to InT and / or as FP8 bytes.
  auto store = [&](int64_t index, const float (&v)[kVec]) {
    if (out_hp != nullptr) {
      Vec pack;
#pragma unroll
      for (int e = 0; e < kVec; ++e) pack.v[e] = round_to<InT>(v[e]);
      store_vec(out_hp + index, pack);
    }
    if constexpr (kOut != Fp8Out::None) {
      uint8_t bytes[kVec];
      fp8_bytes<kOut>(v, scale, local_amax, bytes);
      store_bytes<kVec>(out_fp8 + index, bytes);
    }
  };

  // One row's work, given its loaded vectors.
  auto row = [&](int64_t r, const Vec& xa, const Vec& xb, const Vec& dv) {
    if constexpr (!backward) {
      if constexpr (kOut != Fp8Out::None && act == Activation::Identity) {
        // A plain cast of the input elements: NaN keeps the sign of their bits.
        uint8_t bytes[kVec];
        fp8_bytes<kOut>(xa.v, scale, local_amax, bytes);
#pragma unroll
        for (int e = 0; e < kVec; ++e) sum_first[e] += to_float(xa.v[e]);
        store_bytes<kVec>(out_fp8 + r * out_cols + c, bytes);
      } else {
        // out = act(a) (* b): the float32 value, never rounded to InT before the cast.
        float v[kVec];
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          const float a = to_float(xa.v[e]);
          v[e] = gated ? pointwise(a, base) * to_float(xb.v[e]) : pointwise(a, act);
          sum_first[e] += v[e];
        }
        store(r * out_cols + c, v);
      }
    } else {
      float da[kVec], db[kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const float a = to_float(xa.v[e]), d = to_float(dv.v[e]);
        if constexpr (gated) {
          // dx[:, c] = (dy * b) * act'(a), dx[:, n + c] = dy * act(a).
          const float b = to_float(xb.v[e]);
          da[e] = pointwise_grad(d * b, a, base);
          db[e] = d * pointwise(a, base);
          sum_second[e] += db[e];
        } else {
          da[e] = pointwise_grad(d, a, act);
        }
        sum_first[e] += da[e];
      }
      store(r * out_cols + c, da);
      if constexpr (gated) store(r * out_cols + n + c, db);
    }
  };

  if (c < n) {
    // kRowsAhead rows' loads are issued before the first row is computed (the stores of one
    // row would otherwise come before the next row's loads: one load per operand in flight).
    // The rows are then done in order, so the column sums keep their order.
    for (int64_t r0 = r_begin; r0 < r_end; r0 += kRowsAhead) {
      Vec xa[kRowsAhead], xb[kRowsAhead], dv[kRowsAhead];
#pragma unroll
      for (int i = 0; i < kRowsAhead; ++i) {
        const int64_t r = r0 + i;
        if (r < r_end) {
          xa[i] = *reinterpret_cast<const Vec*>(x + r * in_cols + c);
          if constexpr (gated) xb[i] = *reinterpret_cast<const Vec*>(x + r * in_cols + n + c);
          if constexpr (backward) dv[i] = *reinterpret_cast<const Vec*>(dy + r * n + c);
        }
      }
#pragma unroll
      for (int i = 0; i < kRowsAhead; ++i)
        if (r0 + i < r_end) row(r0 + i, xa[i], xb[i], dv[i]);
    }
    if (partials != nullptr) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        partials[chunk * out_cols + c + e] = sum_first[e];
        if (backward && gated) partials[chunk * out_cols + n + c + e] = sum_second[e];
      }
    }
  }
  if constexpr (kOut != Fp8Out::None) commit_amax(amax, local_amax);
}

// Calls fn(activation, backward) with both as compile-time constants; false (fn not called) for
// a combination no operator makes: the identity backward (cast_transpose_dbias runs the
// identity forward only) or a value outside the enum.
template <typename Fn>
bool with_activation(Activation act, bool backward, Fn&& fn) {
  auto direction = [&](auto act_kind) {
    if (backward)
      fn(act_kind, std::true_type{});
    else
      fn(act_kind, std::false_type{});
    return true;
  };
  switch (act) {
    case Activation::Gelu: return direction(std::integral_constant<Activation, Activation::Gelu>{});
    case Activation::Relu: return direction(std::integral_constant<Activation, Activation::Relu>{});
    case Activation::Silu: return direction(std::integral_constant<Activation, Activation::Silu>{});
    case Activation::Swiglu:
      return direction(std::integral_constant<Activation, Activation::Swiglu>{});
    case Activation::Geglu:
      return direction(std::integral_constant<Activation, Activation::Geglu>{});
    case Activation::Reglu:
      return direction(std::integral_constant<Activation, Activation::Reglu>{});
    case Activation::Qgelu:
      return direction(std::integral_constant<Activation, Activation::Qgelu>{});
    case Activation::Srelu:
      return direction(std::integral_constant<Activation, Activation::Srelu>{});
    case Activation::Qgeglu:
      return direction(std::integral_constant<Activation, Activation::Qgeglu>{});
    case Activation::Sreglu:
      return direction(std::integral_constant<Activation, Activation::Sreglu>{});
    case Activation::Glu: return direction(std::integral_constant<Activation, Activation::Glu>{});
    case Activation::Sigmoid:
      return false;  // (glu's first half only; no operator takes it alone)
    case Activation::Identity:
      if (backward) return false;
      fn(std::integral_constant<Activation, Activation::Identity>{}, std::false_type{});
      return true;
  }
  return false;
}

}  // namespace

cudaError_t launch_activation(const void* x, const void* dy, HpType x_type, int64_t rows,
                              int64_t in_cols, Activation act, const FusedOutput& out,
                              float* partials, cudaStream_t stream) {
  const int64_t n = is_gated(act) ? in_cols / 2 : in_cols;
  if (rows == 0 || n == 0) return cudaSuccess;
  bool supported = true;
  with_input_type(x_type, [&](auto* tag) {
    using InT = std::remove_pointer_t<decltype(tag)>;
    with_vec_width(n, sizeof(InT), {x, dy, out.hp}, out.fp8, [&](auto vec) {
      constexpr int kVec = decltype(vec)::value;
      const int64_t threads_needed = (n / kVec + kThreads - 1) / kThreads;
      const dim3 grid(static_cast<unsigned>(column_chunks(rows)),
                      static_cast<unsigned>(threads_needed));
      with_fp8_out(out, [&](auto out_kind) {
        supported = with_activation(act, dy != nullptr, [&](auto act_kind, auto backward) {
          activation_kernel<InT, decltype(out_kind)::value, kVec, decltype(act_kind)::value,
                            decltype(backward)::value><<<grid, kThreads, 0, stream>>>(
              static_cast<const InT*>(x), static_cast<const InT*>(dy), rows, in_cols,
              static_cast<InT*>(out.hp), out.fp8, out.scale, out.amax, partials);
        });
      });
    });
  });
  if (!supported) return cudaErrorInvalidValue;
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace transformer_fp8
