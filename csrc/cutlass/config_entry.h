// What the C entry points (api.cu) and the kernel instantiations (gemm_<config>.cu) share: one
// launch's arguments and one config's table of kernels. No CUTLASS headers: api.cu compiles fast.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace tcfm_cutlass {

// One launch, as the C entry point received it (validated there).
struct GemmCall {
  const void* a;
  const void* b;
  const void* bias;
  void* d;
  int64_t lda, ldb, ldd;
  int m, n, k;
  void* workspace;
  size_t workspace_bytes;
  bool pdl;
  int device;
  int sm_count;
  cudaStream_t stream;
};

void set_error(const char* fmt, ...);  // this thread's tcfm_cutlass_last_error() text (api.cu)

enum class Schedule : int { kCooperative = 0, kPingpong = 1, kStreamK = 2 };

using LaunchFn = int (*)(const GemmCall&);
using WorkspaceFn = long long (*)(const GemmCall&);

// One config: its kernels indexed [epilogue][dtype] (nullptr where not built).
struct ConfigEntry {
  const char* name;
  int tile_m, tile_n, cluster_m, cluster_n;
  Schedule schedule;
  LaunchFn launch[2][2];
  WorkspaceFn workspace[2][2];
};

}  // namespace tcfm_cutlass
