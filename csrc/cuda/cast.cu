// CUDA kernels of amax, cast_to_fp8, cast_transpose_to_fp8 and cast_from_fp8.
// Reference: csrc/cpu/cast.cpp. Memory-bound: one read of x, 16-byte accesses where aligned.
#include "device_utils.cuh"
#include "kernels.h"

namespace transformer_fp8 {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 8;  // elements per vector access

int grid_for(int64_t work_items, int blocks_per_sm = 8) {
  const int64_t needed = (work_items + kThreads - 1) / kThreads;
  const int64_t cap = static_cast<int64_t>(multiprocessor_count()) * blocks_per_sm;
  return static_cast<int>(needed < 1 ? 1 : (needed < cap ? needed : cap));
}

bool aligned(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

template <typename InT>
__global__ void amax_kernel(const InT* __restrict__ x, int64_t n, bool vec_ok, float* amax) {
  float local = 0.0f;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t n_vec = vec_ok ? n / kVec : 0;
  for (int64_t v = tid; v < n_vec; v += stride) {
    const Pack8<InT> pack = reinterpret_cast<const Pack8<InT>*>(x)[v];
#pragma unroll
    for (int j = 0; j < kVec; ++j) local = nan_max(local, fabsf(to_float(pack.v[j])));
  }
  for (int64_t i = n_vec * kVec + tid; i < n; i += stride) local = nan_max(local, fabsf(to_float(x[i])));
  commit_amax(amax, local);
}

template <typename InT, Fp8Format F>
__global__ void cast_kernel(const InT* __restrict__ x, int64_t n, bool vec_ok,
                            const float* __restrict__ scale_ptr, uint8_t* __restrict__ out,
                            float* amax) {
  const float scale = *scale_ptr;
  float local = 0.0f;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t n_vec = vec_ok ? n / kVec : 0;
  for (int64_t v = tid; v < n_vec; v += stride) {
    const Pack8<InT> pack = reinterpret_cast<const Pack8<InT>*>(x)[v];
    reinterpret_cast<uint2*>(out)[v] = cast_pack8<F>(pack, scale, local);
  }
  for (int64_t i = n_vec * kVec + tid; i < n; i += stride) out[i] = cast_one<F>(x[i], scale, local);
  commit_amax(amax, local);
}

// Tiles of 64 x 64: the tile is cast once, written row-major to out and, through shared
// memory, column-major to out_t. Full tiles use 8-element vectors; edge tiles go element-wise.
constexpr int kTile = 64;
constexpr int kTilePitch = kTile + 8;  // keeps 8-byte alignment of each shared row

template <typename InT, Fp8Format F>
__global__ void cast_transpose_kernel(const InT* __restrict__ x, int64_t rows, int64_t cols,
                                      bool vec_ok, const float* __restrict__ scale_ptr,
                                      uint8_t* __restrict__ out, uint8_t* __restrict__ out_t,
                                      float* amax) {
  __shared__ __align__(8) uint8_t tile[kTile][kTilePitch];
  const float scale = *scale_ptr;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * kTile;
  float local = 0.0f;
  const bool full_tile = vec_ok && r0 + kTile <= rows && c0 + kTile <= cols;
  if (full_tile) {
    for (int k = threadIdx.x; k < kTile * kTile / kVec; k += blockDim.x) {
      const int r = k / (kTile / kVec), cv = (k % (kTile / kVec)) * kVec;
      const int64_t offset = (r0 + r) * cols + c0 + cv;
      const Pack8<InT> pack = *reinterpret_cast<const Pack8<InT>*>(x + offset);
      const uint2 bytes = cast_pack8<F>(pack, scale, local);
      *reinterpret_cast<uint2*>(out + offset) = bytes;
      *reinterpret_cast<uint2*>(&tile[r][cv]) = bytes;
    }
    __syncthreads();
    for (int k = threadIdx.x; k < kTile * kTile / kVec; k += blockDim.x) {
      const int c = k / (kTile / kVec), rv = (k % (kTile / kVec)) * kVec;
      uint8_t b[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) b[j] = tile[rv + j][c];
      uint2 bytes;
      bytes.x = b[0] | (b[1] << 8) | (b[2] << 16) | (static_cast<uint32_t>(b[3]) << 24);
      bytes.y = b[4] | (b[5] << 8) | (b[6] << 16) | (static_cast<uint32_t>(b[7]) << 24);
      *reinterpret_cast<uint2*>(out_t + (c0 + c) * rows + r0 + rv) = bytes;
    }
  } else {
    for (int k = threadIdx.x; k < kTile * kTile; k += blockDim.x) {
      const int r = k / kTile, c = k % kTile;
      if (r0 + r < rows && c0 + c < cols) {
        const uint8_t byte = cast_one<F>(x[(r0 + r) * cols + c0 + c], scale, local);
        out[(r0 + r) * cols + c0 + c] = byte;
        tile[r][c] = byte;
      }
    }
    __syncthreads();
    for (int k = threadIdx.x; k < kTile * kTile; k += blockDim.x) {
      const int c = k / kTile, r = k % kTile;
      if (r0 + r < rows && c0 + c < cols) out_t[(c0 + c) * rows + r0 + r] = tile[r][c];
    }
  }
  commit_amax(amax, local);
}

template <typename OutT>
__device__ __forceinline__ OutT from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

// Every FP8 value is exact in half precision, and so in float32.
template <Fp8Format F>
__device__ __forceinline__ float fp8_to_float(uint8_t byte) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(byte, interpretation<F>())));
}

template <typename OutT, Fp8Format F>
__global__ void cast_from_fp8_kernel(const uint8_t* __restrict__ x, int64_t n, bool vec_ok,
                                     const float* __restrict__ scale_inv_ptr,
                                     OutT* __restrict__ out) {
  const float scale_inv = *scale_inv_ptr;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t n_vec = vec_ok ? n / kVec : 0;
  for (int64_t v = tid; v < n_vec; v += stride) {
    const uint2 bytes = reinterpret_cast<const uint2*>(x)[v];
    Pack8<OutT> pack;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const uint32_t word = j < 4 ? bytes.x : bytes.y;
      const uint8_t byte = static_cast<uint8_t>(word >> (8 * (j % 4)));
      pack.v[j] = from_float<OutT>(fp8_to_float<F>(byte) * scale_inv);
    }
    reinterpret_cast<Pack8<OutT>*>(out)[v] = pack;
  }
  for (int64_t i = n_vec * kVec + tid; i < n; i += stride)
    out[i] = from_float<OutT>(fp8_to_float<F>(x[i]) * scale_inv);
}

// Calls fn with a null pointer of the C++ type of t (float, __nv_bfloat16 or __half).
template <typename Fn>
void with_hp_type(HpType t, Fn&& fn) {
  switch (t) {
    case HpType::Float32: fn(static_cast<float*>(nullptr)); break;
    case HpType::BFloat16: fn(static_cast<__nv_bfloat16*>(nullptr)); break;
    default: fn(static_cast<__half*>(nullptr)); break;
  }
}

}  // namespace

cudaError_t launch_amax(const void* x, HpType x_type, int64_t n, float* amax, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  with_hp_type(x_type, [&](auto* tag) {
    using InT = std::remove_pointer_t<decltype(tag)>;
    const bool vec_ok = aligned(x, sizeof(Pack8<InT>));
    amax_kernel<InT><<<grid_for(vec_ok ? n / kVec + 1 : n), kThreads, 0, stream>>>(
        static_cast<const InT*>(x), n, vec_ok, amax);
  });
  return cudaGetLastError();
}

cudaError_t launch_cast(const void* x, HpType x_type, int64_t n, const float* scale,
                        Fp8Format fmt, uint8_t* out, float* amax, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  with_hp_type(x_type, [&](auto* tag) {
    using InT = std::remove_pointer_t<decltype(tag)>;
    const bool vec_ok = aligned(x, sizeof(Pack8<InT>)) && aligned(out, 8);
    const int grid = grid_for(vec_ok ? n / kVec + 1 : n);
    const InT* xt = static_cast<const InT*>(x);
    if (fmt == Fp8Format::E4M3)
      cast_kernel<InT, Fp8Format::E4M3><<<grid, kThreads, 0, stream>>>(xt, n, vec_ok, scale, out, amax);
    else
      cast_kernel<InT, Fp8Format::E5M2><<<grid, kThreads, 0, stream>>>(xt, n, vec_ok, scale, out, amax);
  });
  return cudaGetLastError();
}

cudaError_t launch_cast_transpose(const void* x, HpType x_type, int64_t rows, int64_t cols,
                                  const float* scale, Fp8Format fmt, uint8_t* out,
                                  uint8_t* out_t, float* amax, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((rows + kTile - 1) / kTile),
                  static_cast<unsigned>((cols + kTile - 1) / kTile));
  with_hp_type(x_type, [&](auto* tag) {
    using InT = std::remove_pointer_t<decltype(tag)>;
    const bool vec_ok = rows % kVec == 0 && cols % kVec == 0 &&
                        aligned(x, sizeof(Pack8<InT>)) && aligned(out, 8) && aligned(out_t, 8);
    const InT* xt = static_cast<const InT*>(x);
    if (fmt == Fp8Format::E4M3)
      cast_transpose_kernel<InT, Fp8Format::E4M3><<<grid, kThreads, 0, stream>>>(
          xt, rows, cols, vec_ok, scale, out, out_t, amax);
    else
      cast_transpose_kernel<InT, Fp8Format::E5M2><<<grid, kThreads, 0, stream>>>(
          xt, rows, cols, vec_ok, scale, out, out_t, amax);
  });
  return cudaGetLastError();
}

cudaError_t launch_cast_from_fp8(const uint8_t* x, Fp8Format fmt, int64_t n,
                                 const float* scale_inv, void* out, HpType out_type,
                                 cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  with_hp_type(out_type, [&](auto* tag) {
    using OutT = std::remove_pointer_t<decltype(tag)>;
    const bool vec_ok = aligned(x, 8) && aligned(out, sizeof(Pack8<OutT>));
    const int grid = grid_for(vec_ok ? n / kVec + 1 : n);
    OutT* o = static_cast<OutT*>(out);
    if (fmt == Fp8Format::E4M3)
      cast_from_fp8_kernel<OutT, Fp8Format::E4M3><<<grid, kThreads, 0, stream>>>(x, n, vec_ok, scale_inv, o);
    else
      cast_from_fp8_kernel<OutT, Fp8Format::E5M2><<<grid, kThreads, 0, stream>>>(x, n, vec_ok, scale_inv, o);
  });
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace transformer_fp8
