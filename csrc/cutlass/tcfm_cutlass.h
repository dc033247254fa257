// Plain C ABI of libtcfm_cutlass.so: Hopper (sm_90a) GEMMs of the DiT body built on CUTLASS 3.x
// collective builders, loadable with ctypes into any process (no torch headers, static cudart).
//
//   D (M, N) = epilogue(A (M, K) @ B (N, K)^T + bias (N,))
//
// A row-major with row stride lda, B row-major (an nn.Linear weight, N x K) with row stride ldb, D
// row-major with row stride ldd; all three 16-bit (fp16 or bf16, one dtype), fp32 accumulation and
// epilogue math, D rounded to nearest once. bias: (N,) in the operand dtype, or NULL for none.
// Pointers and leading dimensions must be 16-byte aligned (TMA); M, N, K >= 1, K and N multiples of 8.
#ifndef TCFM_CUTLASS_H_
#define TCFM_CUTLASS_H_

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TCFM_CUTLASS_ABI_VERSION 1

// dtype
#define TCFM_DTYPE_F16 0
#define TCFM_DTYPE_BF16 1
// epilogue
#define TCFM_EPI_BIAS 0       // D = acc + bias           (bias NULL: D = acc)
#define TCFM_EPI_BIAS_GELU 1  // D = gelu_tanh(acc + bias)
// return codes (0: launched)
#define TCFM_OK 0
#define TCFM_ERR_CONFIG -1       // no such config, or the config has no kernel for this epilogue/dtype
#define TCFM_ERR_ARGUMENT -2     // a bad size, alignment or pointer (the message names it)
#define TCFM_ERR_WORKSPACE -3    // workspace smaller than tcfm_cutlass_workspace_size()
#define TCFM_ERR_CUDA -4         // a CUDA runtime call or the launch failed (the message has the CUDA error)
#define TCFM_ERR_UNSUPPORTED -5  // the device is not an SM90 GPU, or the library has no sm_90a code

int tcfm_cutlass_abi_version(void);
int tcfm_cutlass_num_configs(void);
// The config's name, e.g. "coop_128x256": schedule (coop, pingpong, streamk) and CTA tile M x N
// (K = 64 per stage), then the cluster when it is not 1x1 ("_c2x1"). NULL for an unknown config.
const char* tcfm_cutlass_config_name(int config);
// Tile and cluster of a config into the out-pointers (any may be NULL); TCFM_ERR_CONFIG if unknown.
// schedule: 0 cooperative, 1 ping-pong, 2 stream-K (cooperative).
int tcfm_cutlass_config_info(int config, int* tile_m, int* tile_n, int* cluster_m, int* cluster_n, int* schedule);
// 1 when the config has a kernel for (epilogue, dtype), else 0.
int tcfm_cutlass_config_supports(int config, int epilogue, int dtype);
// Bytes of device workspace the call needs (0 for all but stream-K), or a negative TCFM_ERR_*.
long long tcfm_cutlass_workspace_size(int config, int epilogue, int dtype, int m, int n, int k, int device);
// Launch one GEMM on `stream` (a cudaStream_t) of `device`. Asynchronous; no allocation, no sync:
// capturable into a CUDA graph. pdl != 0 launches with programmatic dependent launch.
int tcfm_cutlass_gemm(int config, int epilogue, int dtype, const void* a, long long lda, const void* b, long long ldb,
                      const void* bias, void* d, long long ldd, int m, int n, int k, void* workspace,
                      size_t workspace_bytes, int pdl, int device, void* stream);
// The message of this thread's last failed call ("" when none).
const char* tcfm_cutlass_last_error(void);

#ifdef __cplusplus
}
#endif

#endif  // TCFM_CUTLASS_H_
