// CUDA kernels of the LayerNorm / RMSNorm operators. Reference: csrc/cpu/norm.cpp.
// Forward and dx: one block per row. Each thread keeps up to kCache elements of its row in
// registers (4-element vectors where the shape and pointers allow, coalesced over the warp;
// single elements otherwise), so the statistics are exact two-pass ones (mean, then the sum of
// squared deviations) from a single read of x; columns beyond blockDim.x * kCache are read
// again from global memory (rows wider than 16384 columns, 8192 for dx).
// dweight / dbias: deterministic two-stage column sums (fused_common.cu finishes them).
#include "block_reduce.cuh"
#include "fused_store.cuh"
#include "kernels.h"

namespace transformer_fp8 {
namespace cuda {
namespace {

constexpr int kCache = 16;
constexpr int kMaxThreads = 1024;
// The dx kernel caches two arrays (xhat and g): at most 512 threads, so that the 128 registers
// a thread may then use hold them without spilling.
constexpr int kMaxThreadsDx = 512;
constexpr int kColumnThreads = 256;

// Threads per row: enough for kCache elements each, a multiple of 32, in [32, max_threads].
int row_threads(int64_t cols, int max_threads) {
  const int64_t per = (cols + kCache - 1) / kCache;
  const int64_t rounded = (per + 31) / 32 * 32;
  return static_cast<int>(rounded < 32 ? 32 : (rounded > max_threads ? max_threads : rounded));
}

// gamma: the weight, plus 1 for a zero-centred one (gamma_shift 1): a weight of -0.0 keeps its
// sign otherwise (-0.0 + 0.0 is +0.0), as the CPU kernel's.
__device__ __forceinline__ float gamma_of(float weight, float gamma_shift) {
  return gamma_shift != 0.0f ? weight + gamma_shift : weight;
}

// The row is read as vectors of kVec elements (kVec = 4 where cols % 4 == 0 and the pointers
// allow); thread t keeps vectors t + k * blockDim.x, k < kSlots, in registers.
template <typename InT, Fp8Out kOut, int kVec>
__global__ void __launch_bounds__(kMaxThreads)
norm_fwd_kernel(const InT* __restrict__ x, int64_t cols, const float* __restrict__ weight,
                const float* __restrict__ bias, float gamma_shift, float eps, bool rms,
                float* __restrict__ mean_out, float* __restrict__ rstd_out,
                InT* __restrict__ y_hp, uint8_t* __restrict__ y_fp8,
                const float* __restrict__ scale_ptr, float* amax) {
  using Vec = VecOf<InT, kVec>;
  constexpr int kSlots = kCache / kVec;
  const int64_t row = blockIdx.x;
  const Vec* xr = reinterpret_cast<const Vec*>(x + row * cols);
  const int64_t n_vec = cols / kVec;
  const int64_t stride = blockDim.x;
  const int64_t cached_end = stride * kSlots;
  auto load = [&](int64_t q, float (&v)[kVec]) {
    const Vec pack = xr[q];
#pragma unroll
    for (int e = 0; e < kVec; ++e) v[e] = to_float(pack.v[e]);
  };
  float cache[kSlots][kVec];
  float sum = 0.0f;  // of x (LayerNorm) or x^2 (RMSNorm)
#pragma unroll
  for (int k = 0; k < kSlots; ++k) {
    const int64_t q = threadIdx.x + k * stride;
#pragma unroll
    for (int e = 0; e < kVec; ++e) cache[k][e] = 0.0f;
    if (q < n_vec) load(q, cache[k]);
#pragma unroll
    for (int e = 0; e < kVec; ++e) sum += rms ? cache[k][e] * cache[k][e] : cache[k][e];
  }
  for (int64_t q = threadIdx.x + cached_end; q < n_vec; q += stride) {
    float v[kVec];
    load(q, v);
#pragma unroll
    for (int e = 0; e < kVec; ++e) sum += rms ? v[e] * v[e] : v[e];
  }
  const float n = static_cast<float>(cols);
  float mean = 0.0f, var;
  if (rms) {
    var = block_sum(sum) / n;  // mean of x^2
  } else {
    mean = block_sum(sum) / n;
    // Second pass over the registers: the biased variance as a sum of squared deviations.
    float sq = 0.0f;
#pragma unroll
    for (int k = 0; k < kSlots; ++k) {
      if (threadIdx.x + k * stride < n_vec) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) sq += (cache[k][e] - mean) * (cache[k][e] - mean);
      }
    }
    for (int64_t q = threadIdx.x + cached_end; q < n_vec; q += stride) {
      float v[kVec];
      load(q, v);
#pragma unroll
      for (int e = 0; e < kVec; ++e) sq += (v[e] - mean) * (v[e] - mean);
    }
    var = block_sum(sq) / n;
  }
  const float rstd = 1.0f / sqrtf(var + eps);  // IEEE sqrt and division, as the CPU's rsqrt
  if (threadIdx.x == 0) {
    if (mean_out != nullptr) mean_out[row] = mean;
    rstd_out[row] = rstd;
  }

  const float scale = kOut != Fp8Out::None ? *scale_ptr : 1.0f;
  float local_amax = 0.0f;
  // y = ((x - mean) * rstd) * gamma (+ bias), in float32; the FP8 byte is cast from it. Each
  // step rounded as the CPU kernel rounds it: no fused multiply-add of the bias.
  auto emit = [&](int64_t q, const float (&v)[kVec]) {
    const int64_t j0 = q * kVec;
    float y[kVec];
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      y[e] = __fmul_rn(__fmul_rn(v[e] - mean, rstd), gamma_of(weight[j0 + e], gamma_shift));
      if (bias != nullptr) y[e] = __fadd_rn(y[e], bias[j0 + e]);
    }
    if (y_hp != nullptr) {
      Vec pack;
#pragma unroll
      for (int e = 0; e < kVec; ++e) pack.v[e] = round_to<InT>(y[e]);
      store_vec(y_hp + row * cols + j0, pack);
    }
    if constexpr (kOut != Fp8Out::None) {
      uint8_t bytes[kVec];
      fp8_bytes<kOut>(y, scale, local_amax, bytes);
      store_bytes<kVec>(y_fp8 + row * cols + j0, bytes);
    }
  };
#pragma unroll
  for (int k = 0; k < kSlots; ++k) {
    const int64_t q = threadIdx.x + k * stride;
    if (q < n_vec) emit(q, cache[k]);
  }
  for (int64_t q = threadIdx.x + cached_end; q < n_vec; q += stride) {
    float v[kVec];
    load(q, v);
    emit(q, v);
  }
  if constexpr (kOut != Fp8Out::None) commit_amax(amax, local_amax);
}

// dx of one row: xhat = (x - mean) * rstd, g = dy * gamma,
// dx = (g - (xhat * mean(g * xhat) + mean(g))) * rstd; RMSNorm: mean = 0 and no mean(g) term.
template <typename InT, int kVec>
__global__ void __launch_bounds__(kMaxThreadsDx)
norm_bwd_dx_kernel(const InT* __restrict__ dy, const InT* __restrict__ x, int64_t cols,
                   const float* __restrict__ mean_in, const float* __restrict__ rstd_in,
                   const float* __restrict__ weight, float gamma_shift, InT* __restrict__ dx) {
  using Vec = VecOf<InT, kVec>;
  constexpr int kSlots = kCache / kVec;
  const int64_t row = blockIdx.x;
  const Vec* xr = reinterpret_cast<const Vec*>(x + row * cols);
  const Vec* dyr = reinterpret_cast<const Vec*>(dy + row * cols);
  const int64_t n_vec = cols / kVec;
  const int64_t stride = blockDim.x;
  const int64_t cached_end = stride * kSlots;
  const float mean = mean_in != nullptr ? mean_in[row] : 0.0f;
  const float rstd = rstd_in[row];
  // xhat and g of vector q.
  auto load = [&](int64_t q, float (&xhat)[kVec], float (&g)[kVec]) {
    const Vec xp = xr[q], dp = dyr[q];
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      xhat[e] = (to_float(xp.v[e]) - mean) * rstd;
      g[e] = to_float(dp.v[e]) * gamma_of(weight[q * kVec + e], gamma_shift);
    }
  };
  float xhat_cache[kSlots][kVec], g_cache[kSlots][kVec];
  float sum_gx = 0.0f, sum_g = 0.0f;
#pragma unroll
  for (int k = 0; k < kSlots; ++k) {
    const int64_t q = threadIdx.x + k * stride;
#pragma unroll
    for (int e = 0; e < kVec; ++e) xhat_cache[k][e] = g_cache[k][e] = 0.0f;
    if (q < n_vec) load(q, xhat_cache[k], g_cache[k]);
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      sum_gx += g_cache[k][e] * xhat_cache[k][e];
      sum_g += g_cache[k][e];
    }
  }
  for (int64_t q = threadIdx.x + cached_end; q < n_vec; q += stride) {
    float xhat[kVec], g[kVec];
    load(q, xhat, g);
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      sum_gx += g[e] * xhat[e];
      sum_g += g[e];
    }
  }
  const float n = static_cast<float>(cols);
  const float c1 = block_sum(sum_gx) / n;
  const float c2 = mean_in != nullptr ? block_sum(sum_g) / n : 0.0f;
  auto store = [&](int64_t q, const float (&xhat)[kVec], const float (&g)[kVec]) {
    Vec pack;
#pragma unroll
    for (int e = 0; e < kVec; ++e)  // (xhat * c1, then + c2: rounded twice, as on the CPU)
      pack.v[e] = round_to<InT>((g[e] - __fadd_rn(__fmul_rn(xhat[e], c1), c2)) * rstd);
    store_vec(dx + (row * cols + q * kVec), pack);
  };
#pragma unroll
  for (int k = 0; k < kSlots; ++k) {
    const int64_t q = threadIdx.x + k * stride;
    if (q < n_vec) store(q, xhat_cache[k], g_cache[k]);
  }
  for (int64_t q = threadIdx.x + cached_end; q < n_vec; q += stride) {
    float xhat[kVec], g[kVec];
    load(q, xhat, g);
    store(q, xhat, g);
  }
}

// Partial column sums over one chunk of rows (blockIdx.x) of dy * xhat and dy; one thread per
// column (blockIdx.y selects 256 columns), coalesced over the warp.
template <typename InT>
__global__ void __launch_bounds__(kColumnThreads)
norm_bwd_partials_kernel(const InT* __restrict__ dy, const InT* __restrict__ x, int64_t rows,
                         int64_t cols, const float* __restrict__ mean_in,
                         const float* __restrict__ rstd_in, float* __restrict__ partial_dweight,
                         float* __restrict__ partial_dbias) {
  const int64_t col = static_cast<int64_t>(blockIdx.y) * kColumnThreads + threadIdx.x;
  if (col >= cols) return;
  const int64_t chunk = blockIdx.x;
  const int64_t r_end = min(rows, (chunk + 1) * kColumnChunkRows);
  float acc_w = 0.0f, acc_b = 0.0f;
  for (int64_t r = chunk * kColumnChunkRows; r < r_end; ++r) {
    const float d = to_float(dy[r * cols + col]);
    const float mean = mean_in != nullptr ? mean_in[r] : 0.0f;
    acc_w += d * ((to_float(x[r * cols + col]) - mean) * rstd_in[r]);
    acc_b += d;
  }
  partial_dweight[chunk * cols + col] = acc_w;
  if (partial_dbias != nullptr) partial_dbias[chunk * cols + col] = acc_b;
}

}  // namespace

cudaError_t launch_norm_fwd(const void* x, HpType x_type, int64_t rows, int64_t cols,
                            const float* weight, const float* bias, bool zero_centered_gamma,
                            float eps, float* mean, float* rstd, const FusedOutput& out,
                            cudaStream_t stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  const int threads = row_threads(cols, kMaxThreads);
  const float shift = zero_centered_gamma ? 1.0f : 0.0f;
  const bool rms = mean == nullptr;
  with_input_type(x_type, [&](auto* tag) {
    using InT = std::remove_pointer_t<decltype(tag)>;
    with_vec_width(cols, sizeof(InT), {x, out.hp}, out.fp8, [&](auto vec) {
      constexpr int kVec = decltype(vec)::value;
      with_fp8_out(out, [&](auto out_kind) {
        norm_fwd_kernel<InT, decltype(out_kind)::value, kVec>
            <<<static_cast<unsigned>(rows), threads, 0, stream>>>(
                static_cast<const InT*>(x), cols, weight, bias, shift, eps, rms, mean, rstd,
                static_cast<InT*>(out.hp), out.fp8, out.scale, out.amax);
      });
    });
  });
  return cudaGetLastError();
}

cudaError_t launch_norm_bwd(const void* dy, const void* x, HpType x_type, int64_t rows,
                            int64_t cols, const float* mean, const float* rstd,
                            const float* weight, bool zero_centered_gamma, void* dx,
                            float* partial_dweight, float* partial_dbias, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  const float shift = zero_centered_gamma ? 1.0f : 0.0f;
  const dim3 partial_grid(static_cast<unsigned>(column_chunks(rows)),
                          static_cast<unsigned>((cols + kColumnThreads - 1) / kColumnThreads));
  with_input_type(x_type, [&](auto* tag) {
    using InT = std::remove_pointer_t<decltype(tag)>;
    const InT* dyt = static_cast<const InT*>(dy);
    const InT* xt = static_cast<const InT*>(x);
    with_vec_width(cols, sizeof(InT), {dy, x, dx}, nullptr, [&](auto vec) {
      norm_bwd_dx_kernel<InT, decltype(vec)::value>
          <<<static_cast<unsigned>(rows), row_threads(cols, kMaxThreadsDx), 0, stream>>>(
              dyt, xt, cols, mean, rstd, weight, shift, static_cast<InT*>(dx));
    });
    norm_bwd_partials_kernel<InT><<<partial_grid, kColumnThreads, 0, stream>>>(
        dyt, xt, rows, cols, mean, rstd, partial_dweight, partial_dbias);
  });
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace transformer_fp8
