// Device-side building blocks shared by the hand-written CUDA kernels (cfm_attention_kernel.cuh,
// dit_gemm_kernel.cuh): async copies, ldmatrix, mma.sync per dtype, 16-bit packing, and the SM90
// mbarrier / bulk-copy / cluster primitives. No torch headers, so the kernels compile standalone.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace torch_cfm {
namespace cuda_device {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy; src_bytes = 0 writes zeros and reads nothing.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(src_bytes));
}
// *p when p is not null, else `fallback`, without a branch (a branch would end the basic block
// and pull the value's first use, and its wait, in front of the copies issued after it).
__device__ __forceinline__ int load_or(const int32_t* p, int offset, int fallback) {
  int v = fallback;
  asm volatile(
      "{\n .reg .pred has;\n setp.ne.u64 has, %1, 0;\n @has ld.global.nc.b32 %0, [%2];\n}\n"
      : "+r"(v)
      : "l"(p), "l"(reinterpret_cast<uintptr_t>(p) + 4 * static_cast<int64_t>(offset)));
  return v;
}
// min(max(x, 0), hi) as volatile asm, so the compiler keeps it (and the wait for x) in program
// order behind the copies issued before it.
__device__ __forceinline__ int clamp_in_order(int x, int hi) {
  int y;
  asm volatile("{\n max.s32 %0, %1, 0;\n min.s32 %0, %0, %2;\n}\n" : "=r"(y) : "r"(x), "r"(hi));
  return y;
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// An fp32 value as a TF32 mma operand: the tensor core reads the top 19 bits (round toward zero),
// as Triton's TF32 dots do; a cvt.rna per operand cost more than the dots at these sizes.
__device__ __forceinline__ uint32_t tf32_operand(float x) { return __float_as_uint(x); }

// Per-dtype pieces: the m16n8kK MMA, the P conversion and the output store.

// c += a · b for one m16n8kK tile; SUFFIX is the PTX shape and types, e.g. "m16n8k16.row.col.f32.f16.f16.f32".
#define TORCH_CFM_MMA_SYNC(SUFFIX, c, a, b0, b1)                                                         \
  asm volatile("mma.sync.aligned." SUFFIX " {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"    \
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                           \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))

// Two fp32 values as one register of two 16-bit values (round to nearest).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

template <typename T>
struct Mma;

template <>
struct Mma<__half> {
  static constexpr int K = 16;
  __device__ __forceinline__ static void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    TORCH_CFM_MMA_SYNC("m16n8k16.row.col.f32.f16.f16.f32", c, a, b0, b1);
  }
};

template <>
struct Mma<__nv_bfloat16> {
  static constexpr int K = 16;
  __device__ __forceinline__ static void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    TORCH_CFM_MMA_SYNC("m16n8k16.row.col.f32.bf16.bf16.f32", c, a, b0, b1);
  }
};

template <>
struct Mma<float> {
  static constexpr int K = 8;
  __device__ __forceinline__ static void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    TORCH_CFM_MMA_SYNC("m16n8k8.row.col.f32.tf32.tf32.f32", c, a, b0, b1);
  }
};
#undef TORCH_CFM_MMA_SYNC

// Four consecutive outputs (16-byte aligned for fp32, 8-byte for 16-bit).
template <typename T>
__device__ __forceinline__ void store4(T* dst, float a, float b, float c, float d) {
  if constexpr (sizeof(T) == 4) {
    *reinterpret_cast<float4*>(dst) = make_float4(a, b, c, d);
  } else {
    *reinterpret_cast<uint2*>(dst) = make_uint2(pack2<T>(a, b), pack2<T>(c, d));
  }
}

// mbarrier and bulk-copy primitives of the C > 1 path (SM90 PTX). Older targets compile them as
// traps: the C > 1 instantiations exist there but the Python side never launches them (clusters
// need SM90).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define TORCH_CFM_SM90_ONLY(...) __trap()
#else
#define TORCH_CFM_SM90_ONLY(...) __VA_ARGS__
#endif
__device__ __forceinline__ void mbarrier_init(uint32_t bar, int count) {
  TORCH_CFM_SM90_ONLY(asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory"));
}
__device__ __forceinline__ void mbarrier_expect_tx(uint32_t bar, uint32_t bytes) {
  TORCH_CFM_SM90_ONLY(
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory"));
}
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
  TORCH_CFM_SM90_ONLY(asm volatile(
      "{\n .reg .pred done;\n WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory"));
}
// `bytes` from global `src` to shared offset `dst` of every CTA in `cta_mask`, each completing on
// the mbarrier at offset `bar` of its own shared memory.
__device__ __forceinline__ void bulk_copy_multicast(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar,
                                                    uint16_t cta_mask) {
  TORCH_CFM_SM90_ONLY(asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, [%3], "
      "%4;\n" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar), "h"(cta_mask)
      : "memory"));
}
__device__ __forceinline__ void fence_mbarrier_init() {
  TORCH_CFM_SM90_ONLY(asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"));
}
// Orders this thread's generic-proxy shared-memory writes before later bulk copies (async proxy).
__device__ __forceinline__ void fence_proxy_async() {
  TORCH_CFM_SM90_ONLY(asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"));
}
__device__ __forceinline__ void cluster_sync_all() {
  TORCH_CFM_SM90_ONLY(
      asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory"));
}
#undef TORCH_CFM_SM90_ONLY

}  // namespace cuda_device
}  // namespace torch_cfm
