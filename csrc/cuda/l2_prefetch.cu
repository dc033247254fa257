// Pull byte ranges of global memory into L2 ahead of their use (SM90 bulk prefetch, no shared memory,
// no registers of data): the DiT body prefetches the next block's weights on a side stream while the
// current block runs, so that the next block's GEMMs read their weights from L2 instead of HBM (the
// 16 blocks' 147 MB of fp16 weights do not fit the 50 MB L2; bench/NOTES.md, session 14).
#include "l2_prefetch.h"

namespace torch_cfm {
namespace cuda_prefetch {

// Each thread walks chunk c = thread, thread + threads, ... of every range: one bulk prefetch
// instruction per chunk (starts and sizes are multiples of 16 bytes: the host rounds them).
__global__ void l2_prefetch_kernel(const PrefetchList list) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int r = 0; r < list.count; ++r) {
    const int64_t bytes = list.bytes[r];
    for (int64_t off = thread * kChunkBytes; off < bytes; off += threads * kChunkBytes) {
      const uint32_t size = static_cast<uint32_t>(bytes - off < kChunkBytes ? bytes - off : kChunkBytes);
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(list.ptr[r] + off), "r"(size) : "memory");
    }
  }
#endif
}

void launch_l2_prefetch(const PrefetchList& list, int ctas, cudaStream_t stream) {
  l2_prefetch_kernel<<<ctas, 32, 0, stream>>>(list);
}

}  // namespace cuda_prefetch
}  // namespace torch_cfm
