// Host/device interface of the L2 prefetch kernel (l2_prefetch.cu). Plain C++: the binding
// (l2_prefetch_binding.cpp) includes it without nvcc.
#pragma once

#include <cuda_runtime_api.h>
#include <stdint.h>

namespace torch_cfm {
namespace cuda_prefetch {

constexpr int kMaxRanges = 40;            // one kernel argument block (≤ 4 KB of parameters)
constexpr int64_t kChunkBytes = 64 << 10;  // bytes per bulk prefetch instruction

struct PrefetchList {
  const char* ptr[kMaxRanges];
  int64_t bytes[kMaxRanges];  // multiples of 16, starts 16-byte aligned
  int count;
};

void launch_l2_prefetch(const PrefetchList& list, int ctas, cudaStream_t stream);

}  // namespace cuda_prefetch
}  // namespace torch_cfm
