// A stand-alone Hopper GEMM for the DiT block's K = 512 roles (bench/wgmma_gemm.py):
//   out[M, N] = a[M, K] @ w[N, K]^T + bias[N]      (fp16 or bf16 in and out, fp32 accumulation)
// Question (bench/NOTES.md, session 14 "Where #4 stands", route 1): does a wgmma + TMA kernel reach
// cuBLAS's 3.7 µs for proj (400 x 512 x 512) in a dependent chain, where session 14's mma.sync kernel
// took twice that? If it does, the PDL weight prefetch (-2 µs per GEMM, measured in session 14) and
// a row-norm epilogue come on top of it; if not, the route closes.
//
// Design: one warpgroup per CTA computes a 64 x BN tile. The whole K (<= 512) is resident in shared
// memory, so nothing is ever overwritten: one mbarrier per 64-wide K stage, no "empty" barriers.
// Thread 0 issues every stage's TMA load of w (128-byte swizzle) first, then, after
// griddepcontrol.wait (a no-op without PDL), every stage's load of a; the warpgroup waits stage by
// stage and issues 4 wgmma m64nBNk16 per stage straight from shared memory.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

namespace wgmma_bench {

constexpr int kBM = 64;         // rows per CTA (one wgmma m64)
constexpr int kBK = 64;         // K per stage: 64 x 2 bytes = one 128-byte swizzle row
constexpr int kMaxStages = 8;   // K <= 512 resident
constexpr int kThreads = 128;   // one warpgroup

// flags
constexpr int kTriggerEarly = 1;  // griddepcontrol.launch_dependents right after the loads are issued
constexpr int kGelu = 2;          // tanh-free exact GELU epilogue (erf)

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Shared-memory matrix descriptor of a K-major tile whose rows are 128 bytes, 128-byte swizzle, tile
// base 1024-byte aligned: start >> 4 in bits 0-13, leading offset (unused by this mode) 1, stride
// offset 1024 B (8 rows) >> 4 in bits 32-45, swizzle mode 1 (128 B) in bits 62-63. Stepping K by 16
// elements inside the 128-byte row adds 32 bytes (2 in >> 4 units) to the start address.
__device__ __forceinline__ uint64_t desc_sw128(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(1) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count));
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
  }
}

// One 2D TMA box (64 K-elements x box rows) into shared memory, completion counted on `bar`.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, int k0, int row0, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(k0), "r"(row0), "r"(smem_u32(bar))
      : "memory");
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }

// wgmma m64nNk16 wrappers (generated text: one asm statement per (N, dtype); the accumulator
// registers are "+f" operands so that they stay in registers across the async group).
// D(64x32, f32) += A(64x16, smem) * B(16x32, smem), both K-major, f16 operands
__device__ __forceinline__ void wgmma_m64n32k16_f16(float* d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
      "}, %16, %17, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// D(64x64, f32) += A(64x16, smem) * B(16x64, smem), both K-major, f16 operands
__device__ __forceinline__ void wgmma_m64n64k16_f16(float* d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
      "}, %32, %33, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// D(64x128, f32) += A(64x16, smem) * B(16x128, smem), both K-major, f16 operands
__device__ __forceinline__ void wgmma_m64n128k16_f16(float* d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, %64, %65, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// D(64x32, f32) += A(64x16, smem) * B(16x32, smem), both K-major, bf16 operands
__device__ __forceinline__ void wgmma_m64n32k16_bf16(float* d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
      "}, %16, %17, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// D(64x64, f32) += A(64x16, smem) * B(16x64, smem), both K-major, bf16 operands
__device__ __forceinline__ void wgmma_m64n64k16_bf16(float* d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
      "}, %32, %33, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// D(64x128, f32) += A(64x16, smem) * B(16x128, smem), both K-major, bf16 operands
__device__ __forceinline__ void wgmma_m64n128k16_bf16(float* d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, %64, %65, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

template <typename T, int BN>
__device__ __forceinline__ void wgmma_k16(float* d, uint64_t da, uint64_t db, int scale_d) {
  if constexpr (std::is_same<T, __half>::value) {
    if constexpr (BN == 32) wgmma_m64n32k16_f16(d, da, db, scale_d);
    else if constexpr (BN == 64) wgmma_m64n64k16_f16(d, da, db, scale_d);
    else wgmma_m64n128k16_f16(d, da, db, scale_d);
  } else {
    if constexpr (BN == 32) wgmma_m64n32k16_bf16(d, da, db, scale_d);
    else if constexpr (BN == 64) wgmma_m64n64k16_bf16(d, da, db, scale_d);
    else wgmma_m64n128k16_bf16(d, da, db, scale_d);
  }
}

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <int BN>
constexpr int smem_bytes(int stages) {
  return stages * (kBM + BN) * kBK * 2 + 1024;  // + alignment slack for the 1024-byte swizzle atoms
}

// grid (ceil(M / 64), N / BN), kThreads threads, smem_bytes<BN>(K / 64) dynamic shared memory.
template <typename T, int BN>
__global__ void __launch_bounds__(kThreads) wgmma_gemm_kernel(const __grid_constant__ CUtensorMap map_a,
                                                              const __grid_constant__ CUtensorMap map_w,
                                                              const T* __restrict__ bias, T* __restrict__ out,
                                                              int m, int ldo, int k, int flags) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t full[kMaxStages];
  unsigned char* smem =
      reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~static_cast<uintptr_t>(1023));
  constexpr int kABytes = kBM * kBK * 2;
  constexpr int kWBytes = BN * kBK * 2;
  const int stages = k / kBK;
  unsigned char* sw = smem;                     // stages x (BN x 64), each 1024-aligned
  unsigned char* sa = smem + stages * kWBytes;  // stages x (64 x 64)
  const int m0 = blockIdx.x * kBM;
  const int n0 = blockIdx.y * BN;
  const int tid = threadIdx.x;

  if (tid == 0) {
    for (int s = 0; s < stages; ++s) mbar_init(&full[s], 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    // Weights never depend on the kernel in front: they load before the PDL wait.
    for (int s = 0; s < stages; ++s) {
      mbar_expect_tx(&full[s], kABytes + kWBytes);
      tma_load_2d(sw + s * kWBytes, &map_w, s * kBK, n0, &full[s]);
    }
  }
  const int warp = tid / 32, lane = tid % 32;
  const int col0 = n0 + 2 * (lane % 4);
  float bias_v[BN / 4];  // this thread's bias pairs: columns col0 + 8j + {0, 1}
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
    bias_v[2 * j] = to_float(bias[col0 + 8 * j]);
    bias_v[2 * j + 1] = to_float(bias[col0 + 8 * j + 1]);
  }
  __syncthreads();  // barriers initialised before anyone waits on them
  pdl_wait();       // a (and out, which the kernel in front may still read) only after this
  if (tid == 0) {
    for (int s = 0; s < stages; ++s) tma_load_2d(sa + s * kABytes, &map_a, s * kBK, m0, &full[s]);
  }
  if (flags & kTriggerEarly) pdl_trigger();

  float d[BN / 2];
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) d[i] = 0.f;
  for (int s = 0; s < stages; ++s) {
    mbar_wait(&full[s], 0);
    wgmma_fence();
    const uint64_t da = desc_sw128(smem_u32(sa + s * kABytes));
    const uint64_t dw = desc_sw128(smem_u32(sw + s * kWBytes));
#pragma unroll
    for (int kk = 0; kk < kBK / 16; ++kk) wgmma_k16<T, BN>(d, da + 2 * kk, dw + 2 * kk, 1);
    wgmma_commit();
  }
  wgmma_wait_all();
  if (!(flags & kTriggerEarly)) pdl_trigger();

  // Accumulator layout of m64nN: warp w holds rows 16w + lane/4 (+8); register 4j + {0,1} holds
  // columns 8j + 2(lane%4) + {0,1} of the first row, 4j + {2,3} the same columns of the second.
  const int r0 = m0 + 16 * warp + lane / 4;
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
    const int col = col0 + 8 * j;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = r0 + 8 * h;
      float x0 = d[4 * j + 2 * h] + bias_v[2 * j], x1 = d[4 * j + 2 * h + 1] + bias_v[2 * j + 1];
      if (flags & kGelu) {
        x0 = 0.5f * x0 * (1.f + erff(x0 * 0.70710678118654752f));
        x1 = 0.5f * x1 * (1.f + erff(x1 * 0.70710678118654752f));
      }
      if (r < m) {
        T pair[2] = {from_float<T>(x0), from_float<T>(x1)};
        *reinterpret_cast<uint32_t*>(out + static_cast<int64_t>(r) * ldo + col) = *reinterpret_cast<uint32_t*>(pair);
      }
    }
  }
#endif
}

}  // namespace wgmma_bench
