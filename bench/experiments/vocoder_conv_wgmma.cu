// Issue 43 (experiment): the vocoder's stride-1 dilated convolution with its input window in shared
// memory, each tap's A operand loaded from a row-shifted view of it by ldmatrix, the MMA on wgmma.
//
// Layout: x (B, L, C_in), y (B, L, C_out) frame-major, channels innermost; w packed (taps, C_out, C_in)
// as torch_cfm.kernels.vocoder_conv packs a plain convolution; bias (C_out,) float32. "same" padding
// pad = dil * (taps - 1) / 2, stride 1. Operands float32 already rounded to TF32 (the tensor cores
// truncate) or float16; float32 accumulation.
//
// One CTA (one warpgroup, 128 threads) computes 64 output frames of one batch row x N (64 or 128)
// output channels. The reduction runs over channel blocks of 128 bytes (32 float32 / 64 float16 channels),
// taps inner. Per block, the input window (64 + (taps - 1) * dil frames x 128 bytes) is copied once
// into shared memory with cp.async; its 16-byte chunk j of row r sits at chunk j ^ (r & 7), so the
// eight rows one ldmatrix reads are in eight different bank groups at any row shift (a swizzle tied
// to the view, as wgmma's shared-memory descriptors need, would break at shifts that are not
// multiples of 8; ldmatrix takes one address per lane instead). Tap m's A fragments are ldmatrix
// loads of rows m * dil + [0, 64) (the wgmma register-A layout of tf32 and f16 is ldmatrix's b16
// layout), its B the tap's (N x 128-byte) weight tile in the 128-byte-swizzled K-major form wgmma
// reads through a descriptor. Weight tiles stream through a ring of 3 slots, windows through 2
// buffers; copies run 2 steps (tap-blocks) ahead. One wgmma group per tap, waited before the next.
//
// The window never leaves shared memory between taps, so the input leaves L2 once per channel block,
// (64 + (taps - 1) * dil) / (64 * taps) as often as with a tile per tap.

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace {

constexpr int kThreads = 128;
constexpr int kBlockM = 64;
constexpr int kRowBytes = 128;       // one channel block of one frame
constexpr int kWinRows = 128;        // window capacity: 64 + (taps - 1) * dil <= 128
constexpr int kStages = 3;           // weight ring slots
constexpr int kWinBytes = kWinRows * kRowBytes;
template <int N> __host__ __device__ constexpr int tile_bytes() { return N * kRowBytes; }  // one weight tile: N output channels
template <int N> __host__ __device__ constexpr int smem_bytes() { return 2 * kWinBytes + kStages * tile_bytes<N>() + 1024; }  // + alignment slack

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ uint32_t swz(int row, int chunk) {  // byte offset of a row's 16-byte chunk
  return row * kRowBytes + ((chunk ^ (row & 7)) << 4);
}

// The sm_90 wgmma shared-memory descriptor of a K-major tile with the 128-byte swizzle: rows of 128
// bytes, 8-row groups 1024 bytes apart; the start address advances 32 bytes per k-step.
__device__ __forceinline__ uint64_t desc_sw128(uint32_t addr) {
  uint64_t d = 0;
  d |= static_cast<uint64_t>((addr & 0x3FFFF) >> 4);
  d |= static_cast<uint64_t>(1) << 16;            // leading byte offset (unused by swizzled K-major)
  d |= static_cast<uint64_t>(1024 >> 4) << 32;    // stride byte offset: 8 rows x 128 bytes
  d |= static_cast<uint64_t>(1) << 62;            // SWIZZLE_128B
  return d;
}

#define ACC32(a) "+f"(a[0]), "+f"(a[1]), "+f"(a[2]), "+f"(a[3]), "+f"(a[4]), "+f"(a[5]), "+f"(a[6]), "+f"(a[7]), "+f"(a[8]), "+f"(a[9]), "+f"(a[10]), "+f"(a[11]), "+f"(a[12]), "+f"(a[13]), "+f"(a[14]), "+f"(a[15]), "+f"(a[16]), "+f"(a[17]), "+f"(a[18]), "+f"(a[19]), "+f"(a[20]), "+f"(a[21]), "+f"(a[22]), "+f"(a[23]), "+f"(a[24]), "+f"(a[25]), "+f"(a[26]), "+f"(a[27]), "+f"(a[28]), "+f"(a[29]), "+f"(a[30]), "+f"(a[31])
#define ACC64(a) "+f"(a[0]), "+f"(a[1]), "+f"(a[2]), "+f"(a[3]), "+f"(a[4]), "+f"(a[5]), "+f"(a[6]), "+f"(a[7]), "+f"(a[8]), "+f"(a[9]), "+f"(a[10]), "+f"(a[11]), "+f"(a[12]), "+f"(a[13]), "+f"(a[14]), "+f"(a[15]), "+f"(a[16]), "+f"(a[17]), "+f"(a[18]), "+f"(a[19]), "+f"(a[20]), "+f"(a[21]), "+f"(a[22]), "+f"(a[23]), "+f"(a[24]), "+f"(a[25]), "+f"(a[26]), "+f"(a[27]), "+f"(a[28]), "+f"(a[29]), "+f"(a[30]), "+f"(a[31]), "+f"(a[32]), "+f"(a[33]), "+f"(a[34]), "+f"(a[35]), "+f"(a[36]), "+f"(a[37]), "+f"(a[38]), "+f"(a[39]), "+f"(a[40]), "+f"(a[41]), "+f"(a[42]), "+f"(a[43]), "+f"(a[44]), "+f"(a[45]), "+f"(a[46]), "+f"(a[47]), "+f"(a[48]), "+f"(a[49]), "+f"(a[50]), "+f"(a[51]), "+f"(a[52]), "+f"(a[53]), "+f"(a[54]), "+f"(a[55]), "+f"(a[56]), "+f"(a[57]), "+f"(a[58]), "+f"(a[59]), "+f"(a[60]), "+f"(a[61]), "+f"(a[62]), "+f"(a[63])
#define D32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define D64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

// One k-step (8 tf32 / 16 f16 channels) of a 64 x N tile: acc += a (registers) x the descriptor's tile.
template <bool F16, int N>
__device__ __forceinline__ void wgmma_k(float (&acc)[N / 2], const uint32_t (&a)[4], uint64_t desc) {
  if constexpr (N == 64 && F16) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " D32 ", {%32, %33, %34, %35}, %36, 1, 1, 1, 0;\n"
                 : ACC32(acc) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
  } else if constexpr (N == 64) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 " D32 ", {%32, %33, %34, %35}, %36, 1, 1, 1;\n"
                 : ACC32(acc) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
  } else if constexpr (F16) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " D64 ", {%64, %65, %66, %67}, %68, 1, 1, 1, 0;\n"
                 : ACC64(acc) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
  } else {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 " D64 ", {%64, %65, %66, %67}, %68, 1, 1, 1;\n"
                 : ACC64(acc) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
  }
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// One step's copies, committed as one group: weight tile (tap m, block cb) into ring slot `slot`, and
// with `window` block cb's input window into window buffer cb & 1. Nothing loads past the last block.
template <int N>
__device__ __forceinline__ void issue(const char* x_row, const char* w, int L, int c_in_bytes, int c_out,
                                      int frame0, int n0, int win_rows, int kb, int cb, int m, int slot,
                                      bool window, uint32_t win_base, uint32_t ring_base) {
  const int tid = threadIdx.x;
  if (cb < kb) {
    if (window) {
      const uint32_t buf = win_base + (cb & 1) * kWinBytes;
      for (int i = tid; i < win_rows * 8; i += kThreads) {
        const int r = i >> 3, j = i & 7, h = frame0 + r;
        const bool ok = h >= 0 && h < L;
        const char* src = x_row + (ok ? static_cast<long long>(h) * c_in_bytes : 0) + cb * kRowBytes + j * 16;
        cp_async16(buf + swz(r, j), src, ok);
      }
    }
    const uint32_t tile = ring_base + slot * tile_bytes<N>();
    for (int i = tid; i < N * 8; i += kThreads) {
      const int n = i >> 3, j = i & 7;
      const char* src = w + (static_cast<long long>(m) * c_out + n0 + n) * c_in_bytes + cb * kRowBytes + j * 16;
      cp_async16(tile + swz(n, j), src, true);
    }
  }
  asm volatile("cp.async.commit_group;\n" ::);
}

template <bool F16, int N>
__global__ void __launch_bounds__(kThreads) conv_window_kernel(const char* __restrict__ x, const char* __restrict__ w,
                                                               const float* __restrict__ bias, char* __restrict__ y,
                                                               int L, int c_in, int c_out, int taps, int dil) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t win_base = (raw + 1023) & ~1023u;
  const uint32_t ring_base = win_base + 2 * kWinBytes;

  constexpr int esize = F16 ? 2 : 4;
  const int tiles = (L + kBlockM - 1) / kBlockM;
  const int b = blockIdx.x / tiles, t = blockIdx.x % tiles;
  const int n0 = blockIdx.y * N;
  const int pad = dil * (taps - 1) / 2;
  const int frame0 = t * kBlockM - pad;
  const int win_rows = kBlockM + (taps - 1) * dil;
  const int c_in_bytes = c_in * esize;
  const int kb = c_in_bytes / kRowBytes;
  const char* x_row = x + static_cast<long long>(b) * L * c_in_bytes;
  const int steps = kb * taps;

  issue<N>(x_row, w, L, c_in_bytes, c_out, frame0, n0, win_rows, kb, 0, 0, 0, true, win_base, ring_base);
  {
    const int cb1 = 1 / taps, m1 = 1 % taps;
    issue<N>(x_row, w, L, c_in_bytes, c_out, frame0, n0, win_rows, kb, cb1, m1, 1, m1 == 0, win_base, ring_base);
  }

  float acc[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.f;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // ldmatrix x4: lanes 0-7 rows 0-7 of the warp's 16 (chunk 2kk), 8-15 rows 8-15, 16-23 rows 0-7
  // (chunk 2kk + 1), 24-31 rows 8-15: registers (g, t), (g + 8, t), (g, t + 4), (g + 8, t + 4) of tf32
  // (the same pairs of f16 halves), the wgmma register-A fragment.
  const int lrow = warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
  const int lchunk = lane >> 4;

  int cb = 0, m = 0;
  for (int s = 0; s < steps; ++s) {
    asm volatile("cp.async.wait_group 1;\n" ::);
    __syncthreads();
    asm volatile("fence.proxy.async.shared::cta;\n" ::);
    const uint32_t buf = win_base + (cb & 1) * kWinBytes;
    const int row = lrow + m * dil;
    uint32_t a[4][4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) ldmatrix_x4(a[kk], buf + swz(row, 2 * kk + lchunk));
    const uint64_t d0 = desc_sw128(ring_base + (s % kStages) * tile_bytes<N>());
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_k<F16, N>(acc, a[kk], d0 + 2 * kk);  // +32 bytes per k-step
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    // step s + 2's copies into slot (s + 2) % 3, free since step s - 1's wgmma finished
    const int s2 = s + 2, cb2 = s2 / taps, m2 = s2 % taps;
    issue<N>(x_row, w, L, c_in_bytes, c_out, frame0, n0, win_rows, kb, cb2, m2, s2 % kStages, m2 == 0, win_base,
          ring_base);
    if (++m == taps) { m = 0; ++cb; }
  }
  asm volatile("cp.async.wait_group 0;\n" ::);

  // D fragment: per n8 block jn, (g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1)
  const int g = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int jn = 0; jn < N / 8; ++jn) {
    const int n = n0 + jn * 8 + 2 * tq;
    const float b0 = bias[n], b1 = bias[n + 1];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int o = t * kBlockM + warp * 16 + g + half * 8;
      if (o < L) {
        const long long off = (static_cast<long long>(b) * L + o) * c_out + n;
        const float v0 = acc[jn * 4 + half * 2] + b0, v1 = acc[jn * 4 + half * 2 + 1] + b1;
        if constexpr (F16) {
          *reinterpret_cast<__half2*>(y + off * 2) = __floats2half2_rn(v0, v1);
        } else {
          *reinterpret_cast<float2*>(y + off * 4) = make_float2(v0, v1);
        }
      }
    }
  }
}

}  // namespace

template <bool F16, int N>
static int launch(const void* x, const void* w, const float* bias, void* y, int batch, int L, int c_in, int c_out,
                  int taps, int dil, cudaStream_t st) {
  const dim3 grid(batch * ((L + kBlockM - 1) / kBlockM), c_out / N);
  cudaFuncSetAttribute(conv_window_kernel<F16, N>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes<N>());
  conv_window_kernel<F16, N><<<grid, kThreads, smem_bytes<N>(), st>>>(static_cast<const char*>(x),
      static_cast<const char*>(w), bias, static_cast<char*>(y), L, c_in, c_out, taps, dil);
  return cudaGetLastError() == cudaSuccess ? 0 : 2;
}

// 0 on success; 1: unsupported (C_in * esize a multiple of 128 bytes, C_out of block_n, block_n 64 or
// 128, the window at most 128 frames, at least 2 taps); 2: a CUDA error at launch.
extern "C" int conv_window(const void* x, const void* w, const float* bias, void* y, int batch, int L, int c_in,
                           int c_out, int taps, int dil, int f16, int block_n, void* stream) {
  const int esize = f16 ? 2 : 4;
  if ((c_in * esize) % kRowBytes != 0 || (block_n != 64 && block_n != 128) || c_out % block_n != 0 ||
      kBlockM + (taps - 1) * dil > kWinRows || taps < 2)
    return 1;
  auto st = static_cast<cudaStream_t>(stream);
  if (f16) return block_n == 64 ? launch<true, 64>(x, w, bias, y, batch, L, c_in, c_out, taps, dil, st)
                                : launch<true, 128>(x, w, bias, y, batch, L, c_in, c_out, taps, dil, st);
  return block_n == 64 ? launch<false, 64>(x, w, bias, y, batch, L, c_in, c_out, taps, dil, st)
                       : launch<false, 128>(x, w, bias, y, batch, L, c_in, c_out, taps, dil, st);
}
