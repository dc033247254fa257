// Torch binding of the stand-alone wgmma + TMA GEMM (wgmma_gemm_kernel.cuh), JIT-built by
// bench/wgmma_gemm.py on the GPU box: gemm(a, w, bias, out, block_n, pdl, flags).
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>
#include <torch/extension.h>

#include "wgmma_gemm_kernel.cuh"

namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  if (fn == nullptr) {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
    TORCH_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) ==
                        cudaSuccess &&
                    q == cudaDriverEntryPointSuccess && p != nullptr,
                "cuTensorMapEncodeTiled not found");
    fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }
  return fn;
}

// A 2D map over a row-major (rows, cols) matrix with row stride `ld` elements: boxes of 64 columns x
// box_rows rows, 128-byte swizzle, zero fill past the edges.
CUtensorMap make_map(const at::Tensor& t, int64_t rows, int64_t cols, int64_t ld, int box_rows) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld * t.element_size())};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(wgmma_bench::kBK), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t estrides[2] = {1, 1};
  const CUtensorMapDataType dt =
      t.scalar_type() == at::kHalf ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const CUresult r = encode_fn()(&map, dt, 2, t.data_ptr(), dims, strides, box, estrides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                 CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                 CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(r == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed: ", static_cast<int>(r));
  return map;
}

template <typename T, int BN>
void launch(const at::Tensor& a, const at::Tensor& w, const at::Tensor& bias, at::Tensor& out, bool pdl, int flags,
            int cluster, cudaStream_t stream) {
  const int m = static_cast<int>(a.size(0)), k = static_cast<int>(a.size(1)), n = static_cast<int>(w.size(0));
  const CUtensorMap map_a = make_map(a, m, k, a.stride(0), wgmma_bench::kBM);
  const CUtensorMap map_w = make_map(w, n, k, w.stride(0), BN);
  auto kernel = wgmma_bench::wgmma_gemm_kernel<T, BN>;
  const int smem = wgmma_bench::smem_bytes<BN>(k / wgmma_bench::kBK);
  static int opted_in = 0;  // host-side attribute, raised before any capture (the bench warms up first)
  if (smem > opted_in) {
    TORCH_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) == cudaSuccess,
                "smem opt-in failed");
    opted_in = smem;
  }
  cudaLaunchConfig_t config = {};
  const int row_tiles = (m + wgmma_bench::kBM - 1) / wgmma_bench::kBM;
  config.gridDim = dim3((row_tiles + cluster - 1) / cluster * cluster, n / BN, 1);
  config.blockDim = dim3(wgmma_bench::kThreads, 1, 1);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attributes[2];
  int count = 0;
  if (pdl) {
    attributes[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[count++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster > 1) {
    attributes[count].id = cudaLaunchAttributeClusterDimension;
    attributes[count].val.clusterDim.x = cluster;
    attributes[count].val.clusterDim.y = 1;
    attributes[count++].val.clusterDim.z = 1;
  }
  config.attrs = attributes;
  config.numAttrs = count;
  const T* b = reinterpret_cast<const T*>(bias.data_ptr());
  T* o = reinterpret_cast<T*>(out.data_ptr());
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, map_a, map_w, b, o, m, static_cast<int>(out.stride(0)), k, flags);
  TORCH_CHECK(err == cudaSuccess, "wgmma_gemm launch: ", cudaGetErrorString(err));
}

// out = a @ w.T + bias (GELU when flags & 2): a (M, K), w (N, K), bias (N,), out (M, N); fp16 or bf16,
// K a multiple of 64 up to 512, N a multiple of block_n (32, 64, 96 or 128), rows 16-byte aligned;
// cluster > 1 multicasts each weight tile to that many consecutive row tiles.
void gemm(const at::Tensor& a, const at::Tensor& w, const at::Tensor& bias, at::Tensor& out, int64_t block_n,
          bool pdl, int64_t flags, int64_t cluster) {
  TORCH_CHECK(a.is_cuda() && a.dim() == 2 && w.dim() == 2 && out.dim() == 2 && bias.dim() == 1, "shapes");
  TORCH_CHECK(a.scalar_type() == w.scalar_type() && a.scalar_type() == out.scalar_type() &&
                  a.scalar_type() == bias.scalar_type() &&
                  (a.scalar_type() == at::kHalf || a.scalar_type() == at::kBFloat16),
              "fp16 or bf16, one dtype");
  const int64_t m = a.size(0), k = a.size(1), n = w.size(0);
  TORCH_CHECK(w.size(1) == k && out.size(0) == m && out.size(1) == n && bias.size(0) == n, "shape mismatch");
  TORCH_CHECK(k % 64 == 0 && k <= 64 * wgmma_bench::kMaxStages, "K must be a multiple of 64, at most 512");
  TORCH_CHECK(n % block_n == 0, "N must be a multiple of block_n");
  TORCH_CHECK(cluster >= 1 && cluster <= 8, "cluster: 1 to 8 CTAs");
  TORCH_CHECK(a.stride(1) == 1 && w.stride(1) == 1 && out.stride(1) == 1 && bias.is_contiguous(), "row-major");
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const int f = static_cast<int>(flags);
#define WG_CASE(T, BN)                                     \
  if (block_n == BN) {                                     \
    launch<T, BN>(a, w, bias, out, pdl, f, static_cast<int>(cluster), stream);        \
    C10_CUDA_KERNEL_LAUNCH_CHECK();                        \
    return;                                                \
  }
  if (a.scalar_type() == at::kHalf) {
    WG_CASE(__half, 32) WG_CASE(__half, 64) WG_CASE(__half, 96) WG_CASE(__half, 128)
  } else {
    WG_CASE(__nv_bfloat16, 32) WG_CASE(__nv_bfloat16, 64) WG_CASE(__nv_bfloat16, 96) WG_CASE(__nv_bfloat16, 128)
  }
#undef WG_CASE
  TORCH_CHECK(false, "block_n must be 32, 64, 96 or 128");
}

// cudaOccupancyMaxActiveClusters of the fp16 kernel at block_n with clusters of `cluster` CTAs and K = k.
int64_t max_active_clusters(int64_t block_n, int64_t cluster, int64_t k) {
  cudaLaunchConfig_t config = {};
  config.blockDim = dim3(wgmma_bench::kThreads, 1, 1);
  config.gridDim = dim3(static_cast<unsigned>(cluster * 16), 1, 1);
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = static_cast<unsigned>(cluster);
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  config.attrs = &attribute;
  config.numAttrs = 1;
  int count = -1;
  cudaError_t err = cudaErrorInvalidValue;
#define WG_OCC(BN)                                                                              \
  if (block_n == BN) {                                                                          \
    auto kernel = wgmma_bench::wgmma_gemm_kernel<__half, BN>;                                   \
    config.dynamicSmemBytes = wgmma_bench::smem_bytes<BN>(static_cast<int>(k) / wgmma_bench::kBK); \
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, config.dynamicSmemBytes); \
    err = cudaOccupancyMaxActiveClusters(&count, kernel, &config);                              \
  }
  WG_OCC(32) WG_OCC(64) WG_OCC(96) WG_OCC(128)
#undef WG_OCC
  TORCH_CHECK(err == cudaSuccess, "cudaOccupancyMaxActiveClusters: ", cudaGetErrorString(err));
  return count;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("max_active_clusters", &max_active_clusters, "cudaOccupancyMaxActiveClusters(block_n, cluster, k)");
  m.def("gemm", &gemm, "out = a @ w.T + bias on the stand-alone wgmma + TMA kernel (bench/wgmma_gemm_kernel.cuh)");
}
