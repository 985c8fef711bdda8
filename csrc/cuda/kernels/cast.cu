// CUDA kernels of amax, cast_to_fp8, cast_transpose_to_fp8 and cast_from_fp8, and the byte
// transpose of the fused operators' FP8 outputs (cast_transpose's tiles without the cast).
// Reference: csrc/cpu/cast.cpp. Memory-bound: one read of x, 16-byte accesses where aligned.
#include "device_utils.cuh"
#include "fp8_tile.cuh"
#include "kernels.h"

namespace transformer_fp8 {
namespace cuda {
namespace {

constexpr int kThreads = 256;  // every kernel here is launched with kThreads threads per block
constexpr int kVec = 8;        // elements per vector access
// The 1-D kernels keep kBytesInFlight bytes of independent loads in flight per thread. With
// kBlocksPerSm blocks resident per SM (__launch_bounds__ holds the kernels to the 64 registers
// that allows) that is 64 KB per SM, well above the ~20 KB the HBM latency calls for.
constexpr int kBytesInFlight = 64;
constexpr int kBlocksPerSm = 4;

// Blocks for a grid-stride kernel: enough for the work, at most one wave of resident blocks.
int grid_for(int64_t work_items) {
  const int64_t needed = (work_items + kThreads - 1) / kThreads;
  const int64_t cap = static_cast<int64_t>(multiprocessor_count()) * kBlocksPerSm;
  return static_cast<int>(needed < 1 ? 1 : (needed < cap ? needed : cap));
}

bool aligned(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// Elements from p to the first address aligned to vec_bytes (p is element-aligned).
int64_t elements_to_alignment(const void* p, size_t elem_bytes, size_t vec_bytes) {
  const size_t misalignment = reinterpret_cast<uintptr_t>(p) % vec_bytes;
  return static_cast<int64_t>((vec_bytes - misalignment) % vec_bytes / elem_bytes);
}

// Split of n contiguous elements for the 1-D kernels: a scalar head of `head` elements, then
// vectors of kVec elements from head on, then a scalar tail. The head aligns the input and the
// output together; if they cannot both be aligned by the same head, everything is head (scalar).
struct Split {
  int64_t head;
  int64_t n_vec;
};

Split split(int64_t n, int64_t in_head, int64_t out_head) {
  if (in_head != out_head || in_head >= n) return {n, 0};
  return {in_head, (n - in_head) / kVec};
}

// Calls fn(i) for the scalar elements of a split: [0, head) and the tail after the vectors.
template <typename Fn>
__device__ __forceinline__ void for_each_scalar(int64_t n, Split s, Fn&& fn) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = tid; i < s.head; i += stride) fn(i);
  for (int64_t i = s.head + s.n_vec * kVec + tid; i < n; i += stride) fn(i);
}

// Calls fn(v, vec[v]) for v in [0, n_vec). Each thread first loads kUnroll vectors, kThreads
// apart (every load instruction is coalesced over the warp), then uses them: kUnroll
// independent loads in flight instead of one.
template <int kUnroll, typename Vec, typename Fn>
__device__ __forceinline__ void for_each_vector(const Vec* __restrict__ vec, int64_t n_vec, Fn&& fn) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads * kUnroll;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kThreads * kUnroll + threadIdx.x;
       base < n_vec; base += step) {
    Vec loaded[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (base + u * kThreads < n_vec) loaded[u] = vec[base + u * kThreads];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (base + u * kThreads < n_vec) fn(base + u * kThreads, loaded[u]);
  }
}

template <typename Vec>
__host__ __device__ constexpr int unroll_for() {
  return kBytesInFlight / sizeof(Vec);
}

template <typename InT>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
amax_kernel(const InT* __restrict__ x, int64_t n, Split s, float* amax) {
  using Vec = Pack8<InT>;
  float local = 0.0f;
  for_each_scalar(n, s, [&](int64_t i) { local = nan_max(local, fabsf(to_float(x[i]))); });
  const Vec* xv = reinterpret_cast<const Vec*>(x + s.head);
  for_each_vector<unroll_for<Vec>()>(xv, s.n_vec, [&](int64_t, const Vec& pack) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) local = nan_max(local, fabsf(to_float(pack.v[j])));
  });
  commit_amax(amax, local);
}

template <typename InT, Fp8Format F>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
cast_kernel(const InT* __restrict__ x, int64_t n, Split s, const float* __restrict__ scale_ptr,
            uint8_t* __restrict__ out, float* amax) {
  using Vec = Pack8<InT>;
  const float scale = *scale_ptr;
  float local = 0.0f;
  for_each_scalar(n, s, [&](int64_t i) { out[i] = cast_one<F>(x[i], scale, local); });
  const Vec* xv = reinterpret_cast<const Vec*>(x + s.head);
  uint2* outv = reinterpret_cast<uint2*>(out + s.head);
  for_each_vector<unroll_for<Vec>()>(xv, s.n_vec, [&](int64_t v, const Vec& pack) {
    outv[v] = cast_pack8<F>(pack, scale, local);
  });
  commit_amax(amax, local);
}

// cast_transpose: one block of 256 threads per tile of 128 x 128 elements. Phase 1 reads the
// tile by rows, casts it once, writes out and keeps the FP8 bytes in shared memory; phase 2
// reads them back by columns and writes out_t. Each phase uses vectors where the shapes and
// pointers allow (row_vec, col_vec), with per-vector bounds checks in edge tiles. The shared
// tile's layout and phase 2 are in fp8_tile.cuh.
static_assert(kThreads == kTileThreads, "fp8_tile.cuh's phase 2 is written for 256 threads");
constexpr int kPacksPerThread = kTile * kTile / kVec / kThreads;  // phase 1: 8
constexpr int kLoadBatch = 4;                       // phase 1 loads in flight per thread

// One tile as the phases see it: pointers to its first element in x, out and out_t, the row
// pitch of x and out (cols), the row pitch of out_t (rows) and how many rows and columns of the
// tile lie inside the tensor. Offsets inside a tile are 32-bit: r * pitch < 128 * 65535 * 128.
template <typename InT>
struct TileView {
  const InT* __restrict__ x;
  uint8_t* __restrict__ out;
  uint8_t* __restrict__ out_t;
  int pitch;
  int64_t pitch_t;
  int n_rows, n_cols;
};

// Phase 1, vectors (cols % 8 == 0): thread t takes packs t, t + 256, ... of the tile, 16 packs
// per row; kLoadBatch loads are issued before the first is cast.
template <Fp8Format F, typename InT>
__device__ __forceinline__ void cast_tile_rows_vec(const TileView<InT>& v, float scale,
                                                   uint32_t* tile, float& local) {
  constexpr int kPacksPerRow = kTile / kVec;
#pragma unroll
  for (int b = 0; b < kPacksPerThread; b += kLoadBatch) {
    Pack8<InT> packs[kLoadBatch];
#pragma unroll
    for (int u = 0; u < kLoadBatch; ++u) {
      const int k = (b + u) * kThreads + threadIdx.x, r = k / kPacksPerRow, c = k % kPacksPerRow * kVec;
      if (r < v.n_rows && c < v.n_cols) packs[u] = *reinterpret_cast<const Pack8<InT>*>(v.x + r * v.pitch + c);
    }
#pragma unroll
    for (int u = 0; u < kLoadBatch; ++u) {
      const int k = (b + u) * kThreads + threadIdx.x, r = k / kPacksPerRow, c = k % kPacksPerRow * kVec;
      if (r < v.n_rows && c < v.n_cols) {
        const uint2 bytes = cast_pack8<F>(packs[u], scale, local);
        *reinterpret_cast<uint2*>(v.out + r * v.pitch + c) = bytes;
        *reinterpret_cast<uint2*>(&tile[tile_word(r, c / 4)]) = bytes;
      }
    }
  }
}

// Phase 1, element by element (any shape).
template <Fp8Format F, typename InT>
__device__ __forceinline__ void cast_tile_rows_scalar(const TileView<InT>& v, float scale,
                                                      uint32_t* tile, float& local) {
  uint8_t* tile_bytes = reinterpret_cast<uint8_t*>(tile);
  for (int k = threadIdx.x; k < kTile * kTile; k += kThreads) {
    const int r = k / kTile, c = k % kTile;
    if (r < v.n_rows && c < v.n_cols) {
      const uint8_t byte = cast_one<F>(v.x[r * v.pitch + c], scale, local);
      v.out[r * v.pitch + c] = byte;
      tile_bytes[tile_byte(r, c)] = byte;
    }
  }
}

template <typename InT, Fp8Format F>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
cast_transpose_kernel(const InT* __restrict__ x, int64_t rows, int64_t cols, bool row_vec,
                      bool col_vec, const float* __restrict__ scale_ptr, uint8_t* __restrict__ out,
                      uint8_t* __restrict__ out_t, float* amax) {
  __shared__ uint32_t tile[kTile * kTileWords];
  const float scale = *scale_ptr;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const TileView<InT> v{x + r0 * cols + c0, out + r0 * cols + c0, out_t + c0 * rows + r0,
                        static_cast<int>(cols), rows,
                        static_cast<int>(rows - r0 < kTile ? rows - r0 : kTile),
                        static_cast<int>(cols - c0 < kTile ? cols - c0 : kTile)};
  float local = 0.0f;
  if (row_vec)
    cast_tile_rows_vec<F>(v, scale, tile, local);
  else
    cast_tile_rows_scalar<F>(v, scale, tile, local);
  __syncthreads();
  // With col_vec and cols % 4 != 0, the last word column of an edge tile holds bytes phase 1
  // did not write; they are read but never stored.
  if (col_vec)
    write_tile_cols_vec(v, tile);
  else
    write_tile_cols_scalar(v, tile);
  commit_amax(amax, local);
}

// transpose_bytes: cast_transpose's two phases without the cast, for the FP8 outputs of the
// fused operators. Phase 1 copies a 128 x 128 tile of FP8 bytes into the same swizzled shared
// tile (8-byte loads, all 8 of a thread issued before the first store: 64 bytes in flight);
// phase 2 is cast_transpose's own.
__device__ __forceinline__ void copy_tile_rows_vec(const TileView<uint8_t>& v, uint32_t* tile) {
  constexpr int kPacksPerRow = kTile / kVec;
  uint2 packs[kPacksPerThread];
#pragma unroll
  for (int u = 0; u < kPacksPerThread; ++u) {
    const int k = u * kThreads + threadIdx.x, r = k / kPacksPerRow, c = k % kPacksPerRow * kVec;
    if (r < v.n_rows && c < v.n_cols) packs[u] = *reinterpret_cast<const uint2*>(v.x + r * v.pitch + c);
  }
#pragma unroll
  for (int u = 0; u < kPacksPerThread; ++u) {
    const int k = u * kThreads + threadIdx.x, r = k / kPacksPerRow, c = k % kPacksPerRow * kVec;
    if (r < v.n_rows && c < v.n_cols) *reinterpret_cast<uint2*>(&tile[tile_word(r, c / 4)]) = packs[u];
  }
}

__device__ __forceinline__ void copy_tile_rows_scalar(const TileView<uint8_t>& v, uint32_t* tile) {
  uint8_t* tile_bytes = reinterpret_cast<uint8_t*>(tile);
  for (int k = threadIdx.x; k < kTile * kTile; k += kThreads) {
    const int r = k / kTile, c = k % kTile;
    if (r < v.n_rows && c < v.n_cols) tile_bytes[tile_byte(r, c)] = v.x[r * v.pitch + c];
  }
}

__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
transpose_bytes_kernel(const uint8_t* __restrict__ in, int64_t rows, int64_t cols, bool row_vec,
                       bool col_vec, uint8_t* __restrict__ out) {
  __shared__ uint32_t tile[kTile * kTileWords];
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const TileView<uint8_t> v{in + r0 * cols + c0, nullptr, out + c0 * rows + r0,
                            static_cast<int>(cols), rows,
                            static_cast<int>(rows - r0 < kTile ? rows - r0 : kTile),
                            static_cast<int>(cols - c0 < kTile ? cols - c0 : kTile)};
  if (row_vec)
    copy_tile_rows_vec(v, tile);
  else
    copy_tile_rows_scalar(v, tile);
  __syncthreads();
  if (col_vec)
    write_tile_cols_vec(v, tile);
  else
    write_tile_cols_scalar(v, tile);
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
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
cast_from_fp8_kernel(const uint8_t* __restrict__ x, int64_t n, Split s,
                     const float* __restrict__ scale_inv_ptr, OutT* __restrict__ out) {
  const float scale_inv = *scale_inv_ptr;
  for_each_scalar(n, s, [&](int64_t i) { out[i] = from_float<OutT>(fp8_to_float<F>(x[i]) * scale_inv); });
  const uint2* xv = reinterpret_cast<const uint2*>(x + s.head);
  Pack8<OutT>* outv = reinterpret_cast<Pack8<OutT>*>(out + s.head);
  for_each_vector<unroll_for<uint2>()>(xv, s.n_vec, [&](int64_t v, const uint2& bytes) {
    Pack8<OutT> pack;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const uint32_t word = j < 4 ? bytes.x : bytes.y;
      const uint8_t byte = static_cast<uint8_t>(word >> (8 * (j % 4)));
      pack.v[j] = from_float<OutT>(fp8_to_float<F>(byte) * scale_inv);
    }
    outv[v] = pack;
  });
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
    const int64_t head = elements_to_alignment(x, sizeof(InT), sizeof(Pack8<InT>));
    const Split s = split(n, head, head);
    const int grid = grid_for(s.n_vec > 0 ? s.n_vec / unroll_for<Pack8<InT>>() + 1 : n);
    amax_kernel<InT><<<grid, kThreads, 0, stream>>>(static_cast<const InT*>(x), n, s, amax);
  });
  return cudaGetLastError();
}

cudaError_t launch_cast(const void* x, HpType x_type, int64_t n, const float* scale,
                        Fp8Format fmt, uint8_t* out, float* amax, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  with_hp_type(x_type, [&](auto* tag) {
    using InT = std::remove_pointer_t<decltype(tag)>;
    const Split s = split(n, elements_to_alignment(x, sizeof(InT), sizeof(Pack8<InT>)),
                          elements_to_alignment(out, 1, sizeof(uint2)));
    const int grid = grid_for(s.n_vec > 0 ? s.n_vec / unroll_for<Pack8<InT>>() + 1 : n);
    const InT* xt = static_cast<const InT*>(x);
    if (fmt == Fp8Format::E4M3)
      cast_kernel<InT, Fp8Format::E4M3><<<grid, kThreads, 0, stream>>>(xt, n, s, scale, out, amax);
    else
      cast_kernel<InT, Fp8Format::E5M2><<<grid, kThreads, 0, stream>>>(xt, n, s, scale, out, amax);
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
    // Every row of x and out starts aligned iff cols % 8 == 0 and the bases are; every out_t
    // row (16-byte stores of 16 rows) iff rows % 16 == 0 and out_t is.
    const bool row_vec = cols % kVec == 0 && aligned(x, sizeof(Pack8<InT>)) && aligned(out, 8);
    const bool col_vec = rows % kColRows == 0 && aligned(out_t, 16);
    const InT* xt = static_cast<const InT*>(x);
    if (fmt == Fp8Format::E4M3)
      cast_transpose_kernel<InT, Fp8Format::E4M3><<<grid, kThreads, 0, stream>>>(
          xt, rows, cols, row_vec, col_vec, scale, out, out_t, amax);
    else
      cast_transpose_kernel<InT, Fp8Format::E5M2><<<grid, kThreads, 0, stream>>>(
          xt, rows, cols, row_vec, col_vec, scale, out, out_t, amax);
  });
  return cudaGetLastError();
}

cudaError_t launch_transpose_bytes(const uint8_t* in, int64_t rows, int64_t cols, uint8_t* out,
                                   cudaStream_t stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((rows + kTile - 1) / kTile),
                  static_cast<unsigned>((cols + kTile - 1) / kTile));
  // As launch_cast_transpose: 8-byte row loads iff cols % 8 == 0 and in is aligned; 16-byte
  // out rows iff rows % 16 == 0 and out is aligned.
  const bool row_vec = cols % kVec == 0 && aligned(in, 8);
  const bool col_vec = rows % kColRows == 0 && aligned(out, 16);
  transpose_bytes_kernel<<<grid, kThreads, 0, stream>>>(in, rows, cols, row_vec, col_vec, out);
  return cudaGetLastError();
}

cudaError_t launch_cast_from_fp8(const uint8_t* x, Fp8Format fmt, int64_t n,
                                 const float* scale_inv, void* out, HpType out_type,
                                 cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  with_hp_type(out_type, [&](auto* tag) {
    using OutT = std::remove_pointer_t<decltype(tag)>;
    const Split s = split(n, elements_to_alignment(x, 1, sizeof(uint2)),
                          elements_to_alignment(out, sizeof(OutT), sizeof(Pack8<OutT>)));
    const int grid = grid_for(s.n_vec > 0 ? s.n_vec / unroll_for<uint2>() + 1 : n);
    OutT* o = static_cast<OutT*>(out);
    if (fmt == Fp8Format::E4M3)
      cast_from_fp8_kernel<OutT, Fp8Format::E4M3><<<grid, kThreads, 0, stream>>>(x, n, s, scale_inv, o);
    else
      cast_from_fp8_kernel<OutT, Fp8Format::E5M2><<<grid, kThreads, 0, stream>>>(x, n, s, scale_inv, o);
  });
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace transformer_fp8
