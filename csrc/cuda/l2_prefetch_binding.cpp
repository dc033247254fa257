// torch binding of the L2 prefetch kernel (csrc/cuda/l2_prefetch.cu), part of torch_cfm._C_cuda
// (registered in cfm_attention.cpp's module).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <vector>

#include "l2_prefetch.h"

namespace torch_cfm {
namespace cuda_prefetch {

// Prefetch every tensor's bytes into L2 on the current stream (SM90+; a no-op kernel below). Each
// tensor must be contiguous; its range is trimmed to whole 16-byte units inside it.
void l2_prefetch(const std::vector<at::Tensor>& tensors, int64_t ctas) {
  TORCH_CHECK_VALUE(!tensors.empty() && static_cast<int>(tensors.size()) <= kMaxRanges,
                    "l2_prefetch: 1 to ", kMaxRanges, " tensors");
  TORCH_CHECK_VALUE(ctas >= 1 && ctas <= 1024, "l2_prefetch: ctas in [1, 1024]");
  PrefetchList list{};
  for (const at::Tensor& t : tensors) {
    TORCH_CHECK_VALUE(t.is_cuda() && t.is_contiguous() && t.device() == tensors[0].device(),
                      "l2_prefetch: contiguous CUDA tensors on one device");
    const uintptr_t start = reinterpret_cast<uintptr_t>(t.data_ptr());
    const uintptr_t end = start + t.numel() * t.element_size();
    const uintptr_t first = (start + 15) & ~uintptr_t(15), last = end & ~uintptr_t(15);
    if (last <= first) continue;
    list.ptr[list.count] = reinterpret_cast<const char*>(first);
    list.bytes[list.count] = static_cast<int64_t>(last - first);
    ++list.count;
  }
  if (list.count == 0) return;
  const c10::cuda::CUDAGuard guard(tensors[0].device());
  launch_l2_prefetch(list, static_cast<int>(ctas), c10::cuda::getCurrentCUDAStream(tensors[0].device().index()).stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda_prefetch
}  // namespace torch_cfm
