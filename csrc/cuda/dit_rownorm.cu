// The DiT body's row-norm boundary as a hand-written CUDA kernel: one warp per token row of C = 512
// channels (16 per lane, as two 8-channel vectors), the LayerNorm statistics reduced with warp
// shuffles only, no shared memory and no CTA barrier. Semantics are the Triton kernel's
// (`_rownorm_rows` in torch_cfm/kernels/dit_body.py), argument by argument (dit_rownorm_params.h):
//
//   y      = GEMM row [+ bias]                 (plain)  or  tap0[t] + tap1[t+1] + tap2[t+2] [+ bias] (taps)
//   y      = y * gate[n]                       (gate_off >= 0)
//   y      = y + h[row]; h[row] = y            (has_res / write_h; h is float32)
//   z      = (y - mean) * rsqrt(var + eps)     (float32 statistics over the row's C channels)
//   out    = z * (1 + scale[n]) + shift[n]     (norm 0, the table holds 1 + scale)
//          | mish(z * ln_w + ln_b)             (norm 1)
//   head:  out rows n*out_t + {0, 1} <- old conv cache frames (zeros without one), at t == 0
//   emit:  new conv cache <- history frames T_n, T_n + 1, at t == 0
//
// Loads that the GEMM in front does not write (bias, the modulation table, LayerNorm weights) are
// issued before griddepcontrol.wait, so under programmatic dependent launch they overlap that
// GEMM's tail. No torch headers: compiles standalone with nvcc (nvcc -Xptxas -v).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "dit_rownorm_params.h"

namespace torch_cfm {
namespace cuda_rownorm {

namespace {

constexpr int kRowsPerCta = 4;  // one warp per row
constexpr int kThreads = kRowsPerCta * 32;
constexpr int kHalf = kChannels / 2;  // a lane's second vector starts here

template <typename T>
__device__ __forceinline__ void load8(const T* p, float* x);
template <>
__device__ __forceinline__ void load8<__half>(const __half* p, float* x) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const __half2* v = reinterpret_cast<const __half2*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(v[i]);
    x[2 * i] = f.x;
    x[2 * i + 1] = f.y;
  }
}
template <>
__device__ __forceinline__ void load8<__nv_bfloat16>(const __nv_bfloat16* p, float* x) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* v = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(v[i]);
    x[2 * i] = f.x;
    x[2 * i + 1] = f.y;
  }
}
template <>
__device__ __forceinline__ void load8<float>(const float* p, float* x) {
  const float4 a = reinterpret_cast<const float4*>(p)[0];
  const float4 b = reinterpret_cast<const float4*>(p)[1];
  x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
}

template <typename T>
__device__ __forceinline__ void store8(T* p, const float* x);
template <>
__device__ __forceinline__ void store8<__half>(__half* p, const float* x) {
  uint4 u;
  __half2* v = reinterpret_cast<__half2*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = __floats2half2_rn(x[2 * i], x[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = u;
}
template <>
__device__ __forceinline__ void store8<__nv_bfloat16>(__nv_bfloat16* p, const float* x) {
  uint4 u;
  __nv_bfloat162* v = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = __floats2bfloat162_rn(x[2 * i], x[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = u;
}
template <>
__device__ __forceinline__ void store8<float>(float* p, const float* x) {
  reinterpret_cast<float4*>(p)[0] = make_float4(x[0], x[1], x[2], x[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(x[4], x[5], x[6], x[7]);
}

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(float x) { return x; }

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

template <typename T, bool TAPS, int NORM>
__global__ void __launch_bounds__(kThreads) dit_rownorm_kernel(const Params p) {
  constexpr int C = kChannels;
  const int lane = threadIdx.x % 32;
  const int r = blockIdx.x * kRowsPerCta + threadIdx.x / 32;
  if (r >= p.m) return;
  const int n = r / p.t_len, t = r - n * p.t_len;
  const int col[2] = {lane * 8, kHalf + lane * 8};

  // Not written by the GEMM in front: loaded before the dependency wait.
  float bias[16], gate[16], mod_a[16], mod_b[16];
  const float* tab = p.table != nullptr ? p.table + static_cast<int64_t>(n) * p.stride_tab : nullptr;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    if (p.bias != nullptr) load8(static_cast<const T*>(p.bias) + col[k], bias + 8 * k);
    if (p.gate_off >= 0) load8(tab + p.gate_off + col[k], gate + 8 * k);
    if constexpr (NORM == 0) {
      load8(tab + p.scale_off + col[k], mod_a + 8 * k);
      load8(tab + p.shift_off + col[k], mod_b + 8 * k);
    } else {
      load8(static_cast<const T*>(p.ln_w) + col[k], mod_a + 8 * k);
      load8(static_cast<const T*>(p.ln_b) + col[k], mod_b + 8 * k);
    }
  }
  grid_dependency_wait();

  const T* y_ptr = static_cast<const T*>(p.y);
  float y[16], res[16];
  if constexpr (TAPS) {  // the 3 conv taps of frame t, read at history rows t, t + 1, t + 2
    const int64_t hrow = static_cast<int64_t>(n) * (p.t_len + 2) + t;
    float tap[16];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      load8(y_ptr + hrow * p.stride_y + col[k], y + 8 * k);
      load8(y_ptr + (hrow + 1) * p.stride_y + C + col[k], tap + 8 * k);
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) y[i] += tap[i];
#pragma unroll
    for (int k = 0; k < 2; ++k) load8(y_ptr + (hrow + 2) * p.stride_y + 2 * C + col[k], tap + 8 * k);
#pragma unroll
    for (int i = 0; i < 16; ++i) y[i] += tap[i];
  } else {
#pragma unroll
    for (int k = 0; k < 2; ++k) load8(y_ptr + static_cast<int64_t>(r) * p.stride_y + col[k], y + 8 * k);
  }
  float* h_row = p.h + static_cast<int64_t>(r) * C;
  if (p.has_res) {
#pragma unroll
    for (int k = 0; k < 2; ++k) load8(h_row + col[k], res + 8 * k);
  }
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    if (p.bias != nullptr) y[i] += bias[i];
    if (p.gate_off >= 0) y[i] *= gate[i];
    if (p.has_res) y[i] += res[i];
  }
  if (p.write_h) {
#pragma unroll
    for (int k = 0; k < 2; ++k) store8(h_row + col[k], y + 8 * k);
  }

  // LayerNorm over C, float32 statistics
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 16; ++i) s += y[i];
  const float mean = warp_sum(s) / C;
  float q = 0.f;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    y[i] -= mean;
    q += y[i] * y[i];
  }
  const float rstd = rsqrtf(warp_sum(q) / C + p.eps);
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    float z = y[i] * rstd;
    if constexpr (NORM == 0) {
      z = z * mod_a[i] + mod_b[i];
    } else {  // affine LayerNorm then Mish: x * tanh(softplus(x)) = x * e(e+2) / (e(e+2) + 2), e = exp(x)
      z = z * mod_a[i] + mod_b[i];
      const float e = __expf(fminf(z, 20.f));
      const float pe = e * (e + 2.f);
      z = z > 20.f ? z : z * pe / (pe + 2.f);
    }
    y[i] = z;
  }
  T* out = static_cast<T*>(p.out);
  const int64_t orow = static_cast<int64_t>(n) * p.out_t + p.out_off + t;
#pragma unroll
  for (int k = 0; k < 2; ++k) store8(out + orow * C + col[k], y + 8 * k);

  if (t != 0) return;
  if (p.head) {  // history frames 0, 1 <- old conv cache (zeros without one)
    const T* cnn = static_cast<const T*>(p.cnn);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      float v[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const int c = col[i / 8] + i % 8;
        v[i] = cnn != nullptr
                   ? to_float(cnn[n * p.cnn_sn + (p.head_cbase + c) * p.cnn_sc + j * p.cnn_sj])
                   : 0.f;
      }
#pragma unroll
      for (int k = 0; k < 2; ++k) store8(out + (static_cast<int64_t>(n) * p.out_t + j) * C + col[k], v + 8 * k);
    }
  }
  if (p.emit) {  // new conv cache = history frames T_n, T_n + 1 (the last 2 of [cache ; chunk[:T_n]])
    const T* src = static_cast<const T*>(p.emit_src);
    T* dst = static_cast<T*>(p.emit_dst);
    const int64_t tn = p.valid[n];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const T* src_row = src + (static_cast<int64_t>(n) * (p.t_len + 2) + tn + j) * C;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const int c = col[i / 8] + i % 8;
        dst[n * p.emit_sn + (p.emit_cbase + c) * p.emit_sc + j * p.emit_sj] = src_row[c];
      }
    }
  }
}

template <typename T, bool TAPS, int NORM>
void launch_one(const Params& p, bool pdl, cudaStream_t stream) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3((p.m + kRowsPerCta - 1) / kRowsPerCta);
  config.blockDim = dim3(kThreads);
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = pdl ? 1 : 0;
  cudaLaunchKernelEx(&config, dit_rownorm_kernel<T, TAPS, NORM>, p);  // errors: the caller's launch check
}

template <typename T>
bool launch_dtype(const Params& p, bool taps, int norm, bool pdl, cudaStream_t stream) {
  if (norm == 0) {
    taps ? launch_one<T, true, 0>(p, pdl, stream) : launch_one<T, false, 0>(p, pdl, stream);
  } else if (norm == 1) {
    taps ? launch_one<T, true, 1>(p, pdl, stream) : launch_one<T, false, 1>(p, pdl, stream);
  } else {
    return false;
  }
  return true;
}

}  // namespace

bool launch(const Params& p, int dtype, bool taps, int norm, bool pdl, cudaStream_t stream) {
  if (p.m <= 0) return true;
  switch (dtype) {
    case 0:
      return launch_dtype<__half>(p, taps, norm, pdl, stream);
    case 1:
      return launch_dtype<__nv_bfloat16>(p, taps, norm, pdl, stream);
    case 2:
      return launch_dtype<float>(p, taps, norm, pdl, stream);
    default:
      return false;
  }
}

}  // namespace cuda_rownorm
}  // namespace torch_cfm
