// The `staged` kernel of quantize_blockwise with 1x128 blocks and with_transpose
// (TRANSFORMER_FP8_BLOCKWISE_TRANSPOSE_KERNEL=staged; blockwise_transpose.cu's header has the
// algorithm and the default kernel). Same tile, same threads, same packs, the same phase-1 and
// phase-2 functions (blockwise_transpose.cuh) and the same casts: the same bits. What differs is
// where a thread's 8 packs wait for the column scales: the default kernel keeps all 8 in
// registers through the three phases (111 registers, 2 blocks per SM); this one loads them in two
// halves of 4, parks each half in shared memory as it arrives, casts the rows from there one pack
// at a time and reads the packs back again in phase 3: at most 4 packs are live, and only while
// loading (60 registers, no spills: 4 blocks per SM).
//
// Shared memory, 48 KB (the static limit; 4 blocks = 196 KB with the 1 KB per block the SM
// keeps, within an H100's 228 KB): the staged packs (128 rows x 16 packs x 16 bytes = 32 KB) and
// one 16 KB region that holds phase 2's column partials and scales, then phase 3's FP8 tile
// (a __syncthreads between the last read of the scales and the first write of the tile).
// bf16 and fp16 only: float32 packs would need 64 KB (the launcher runs the default kernel).
//
// Bank conflicts: a thread writes and reads back only its own packs (no barrier needed between
// the two for that), staged[r][c / 8] with r = t / 16 + 16 u, c / 8 = t % 16. One warp's 16-byte
// accesses for one u cover rows 2 w + 16 u and 2 w + 16 u + 1 whole: 512 contiguous bytes, lane
// l at byte 16 l. A 16-byte shared access is served a quarter-warp at a time (8 lanes x 16 bytes
// = 128 contiguous bytes, each of the 32 banks once): conflict-free, for the stores (phase 1) and
// the loads (phase 3) alike. The column scales (8 floats at 4 c: lanes l and l + 16 read the
// same ones) and the FP8 tile (fp8_tile.cuh's swizzle) are accessed as in the default kernel.
#include "blockwise_transpose.cuh"

namespace transformer_fp8 {
namespace cuda {
namespace {

using namespace rows_and_cols;

constexpr int kStagedBlocksPerSm = 4;  // 64 registers per thread at 256 threads
constexpr int kHalf = kPacks / 2;      // packs loaded (and live) at once

// Pack bits: load_pack's 16 bytes as 4 words. (A Pack8 merged from the vector and the zero
// paths is kept one element per register: 32 registers for 4 bf16 packs instead of 16.)
template <typename InT>
__device__ __forceinline__ uint4 as_bits(const Pack8<InT>& p) {
  uint4 bits;
  memcpy(&bits, &p, sizeof(bits));
  return bits;
}

template <typename InT>
__device__ __forceinline__ Pack8<InT> as_pack(uint4 bits) {
  Pack8<InT> p;
  memcpy(&p, &bits, sizeof(p));
  return p;
}

// Phase 2's column scratch until phase 3 writes the FP8 tile over it.
union ColumnsThenTile {
  ColumnScratch cols;
  uint32_t tile[kTile * kTileWords];
};

// g: the blocks of x [rows, cols]; gt: those of x^T [cols, rows].
template <Fp8Format F, typename InT>
__global__ void __launch_bounds__(kThreads, kStagedBlocksPerSm)
quantize_rows_and_cols_staged_kernel(const InT* __restrict__ x, BlockGeometry g, BlockGeometry gt,
                                     bool power_2_scale, bool row_vec, bool col_vec,
                                     uint8_t* __restrict__ out, float* __restrict__ scale_inv,
                                     uint8_t* __restrict__ out_t,
                                     float* __restrict__ scale_inv_t) {
  static_assert(sizeof(Pack8<InT>) == 16, "staged packs of 16 bytes (bf16, fp16): 32 KB");
  __shared__ uint4 staged[kTile][kPacksPerRow];  // the pack at tile row r, columns 8 k .. 8 k + 7
  __shared__ __align__(16) ColumnsThenTile s;

  int64_t br, bc;
  const Tile t = tile_of_block(g, out_t, br, bc);
  const int c = (threadIdx.x % kPacksPerRow) * kVec, first_row = threadIdx.x / kPacksPerRow;

  // 1. Rows, in two halves of 4 packs: load 4 and park them, then cast their rows one pack at a
  // time from shared memory (so that one pack, not 4, is live through the row casts).
  float col_amax[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) col_amax[j] = 0.0f;
#pragma unroll
  for (int h = 0; h < kPacks; h += kHalf) {
    if (row_vec) {
      uint4 packs[kHalf];
#pragma unroll
      for (int i = 0; i < kHalf; ++i) {
        const int r = first_row + (h + i) * kRowsPerPass;
        packs[i] = r < t.n_rows && c < t.n_cols
                       ? *reinterpret_cast<const uint4*>(x + (t.r0 + r) * g.cols + t.c0 + c)
                       : make_uint4(0u, 0u, 0u, 0u);  // load_pack's zeros
      }
#pragma unroll
      for (int i = 0; i < kHalf; ++i)
        staged[first_row + (h + i) * kRowsPerPass][c / kVec] = packs[i];
    } else {
      // Element by element, one pack at a time: 4 packs' element loads at once would hold 32
      // registers (one per element) and their addresses.
#pragma unroll 1
      for (int i = 0; i < kHalf; ++i) {
        const int r = first_row + (h + i) * kRowsPerPass;
        staged[r][c / kVec] = as_bits(load_pack(x, g.cols, t, r, c, false));
      }
    }
    // A memory barrier for the compiler, no more: without it the loads below are forwarded from
    // the stores above, and the 4 packs stay live in registers through the row casts.
    __syncwarp();
#pragma unroll
    for (int i = 0; i < kHalf; ++i) {
      const int r = first_row + (h + i) * kRowsPerPass;
      const Pack8<InT> p = as_pack<InT>(staged[r][c / kVec]);
      quantize_row_pack<F>(p, r, c, t, g, bc, power_2_scale, row_vec, out, scale_inv, col_amax);
    }
  }

  // 2. Columns (ends with a __syncthreads: every column's scale is in s.cols.scale).
  column_scales<F>(col_amax, c, t, gt, br, power_2_scale, scale_inv_t, s.cols);

  // 3. The parked packs with their column scales into the shared tile, then out by columns.
  float scales[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) scales[j] = s.cols.scale[c + j];
  __syncthreads();  // s.tile overwrites s.cols: every thread has its scales first
  float unused = 0.0f;
#pragma unroll
  for (int u = 0; u < kPacks; ++u) {
    const int r = first_row + u * kRowsPerPass;
    const Pack8<InT> p = as_pack<InT>(staged[r][c / kVec]);  // parked by this thread
    *reinterpret_cast<uint2*>(&s.tile[tile_word(r, c / 4)]) = cast_pack8<F>(p, scales, unused);
  }
  __syncthreads();
  if (col_vec)
    write_tile_cols_vec(t, s.tile);
  else
    write_tile_cols_scalar(t, s.tile);
}

template <Fp8Format F, typename InT>
cudaError_t launch_typed(const void* x, const BlockGeometry& g, bool power_2_scale, uint8_t* out,
                         float* scale_inv, uint8_t* out_t, float* scale_inv_t,
                         cudaStream_t stream) {
  // Four 48 KB blocks per SM need the largest shared-memory carveout, which the driver need not
  // pick for a kernel that does not ask: a hint, given once per instantiation (thread-safe
  // static; on the device current at the first call).
  static const cudaError_t carveout = cudaFuncSetAttribute(
      quantize_rows_and_cols_staged_kernel<F, InT>,
      cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
  if (carveout != cudaSuccess) return carveout;
  const Launch l = launch_of<InT>(x, g, out, out_t);
  quantize_rows_and_cols_staged_kernel<F, InT><<<l.tiles, kThreads, 0, stream>>>(
      static_cast<const InT*>(x), g, transposed_geometry(g), power_2_scale, l.row_vec, l.col_vec,
      out, scale_inv, out_t, scale_inv_t);
  return cudaGetLastError();
}

template <typename InT>
cudaError_t launch_format(const void* x, const BlockGeometry& g, Fp8Format fmt,
                          bool power_2_scale, uint8_t* out, float* scale_inv, uint8_t* out_t,
                          float* scale_inv_t, cudaStream_t stream) {
  return fmt == Fp8Format::E4M3
             ? launch_typed<Fp8Format::E4M3, InT>(x, g, power_2_scale, out, scale_inv, out_t,
                                                  scale_inv_t, stream)
             : launch_typed<Fp8Format::E5M2, InT>(x, g, power_2_scale, out, scale_inv, out_t,
                                                  scale_inv_t, stream);
}

}  // namespace

namespace rows_and_cols {

cudaError_t launch_staged(const void* x, HpType x_type, const BlockGeometry& g, Fp8Format fmt,
                          bool power_2_scale, uint8_t* out, float* scale_inv, uint8_t* out_t,
                          float* scale_inv_t, cudaStream_t stream) {
  if (x_type == HpType::BFloat16)
    return launch_format<__nv_bfloat16>(x, g, fmt, power_2_scale, out, scale_inv, out_t,
                                        scale_inv_t, stream);
  if (x_type == HpType::Float16)
    return launch_format<__half>(x, g, fmt, power_2_scale, out, scale_inv, out_t, scale_inv_t,
                                 stream);
  return cudaErrorInvalidValue;  // float32: the launcher runs the default kernel instead
}

}  // namespace rows_and_cols
}  // namespace cuda
}  // namespace transformer_fp8
