// Host side of the DiT GEMM kernel (dit_linear_kernel.cuh): tensor maps, tile configs, launch.
#include "dit_linear.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <atomic>
#include <initializer_list>
#include <mutex>
#include <unordered_map>

#include "dit_linear_kernel.cuh"

namespace torch_cfm {
namespace dit_linear {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
#if CUDART_VERSION >= 12050
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q);
#else
    const cudaError_t err = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &p, cudaEnableDefault, &q);
#endif
    TORCH_CHECK(err == cudaSuccess && q == cudaDriverEntryPointSuccess && p != nullptr,
                "dit_linear: cuTensorMapEncodeTiled not found in the driver");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// A 2D map over the row-major (rows, cols) matrix t (row stride ld elements): boxes of 128 bytes of
// columns x box_rows rows, 128-byte swizzle (the wgmma descriptors' layout), zero fill past the edges.
// fp32 tensors map as TFLOAT32: the TMA unit rounds each element to TF32 (to nearest) as it loads.
CUtensorMap make_map(const at::Tensor& t, int64_t rows, int64_t cols, int64_t ld, int box_rows) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld * t.element_size())};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(128 / t.element_size()), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t estrides[2] = {1, 1};
  const CUtensorMapDataType dt = t.scalar_type() == at::kHalf    ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                 : t.scalar_type() == at::kFloat ? CU_TENSOR_MAP_DATA_TYPE_TFLOAT32
                                                                 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const CUresult r = encode_fn()(&map, dt, 2, t.data_ptr(), dims, strides, box, estrides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                 CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                 CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(r == CUDA_SUCCESS, "dit_linear: cuTensorMapEncodeTiled failed (", static_cast<int>(r), ")");
  return map;
}

// out: (M, N) in T (kQkvCache: the queries (M, N / 3)), or with kPartials the fp32 (splits, M, N)
// partial sums (one K chunk per split).
template <typename T, int BN, int kMode>
void launch(const at::Tensor& a, const at::Tensor& w, const T* bias, at::Tensor& out, bool pdl, int flags, int cluster,
            int splits, cudaStream_t stream, const QkvCacheArgs<T>& qc = QkvCacheArgs<T>()) {
  const int m = static_cast<int>(a.size(0)), k = static_cast<int>(a.size(1)), n = static_cast<int>(w.size(0));
  const CUtensorMap map_a = make_map(a, m, k, a.stride(0), kBM);
  const CUtensorMap map_w = make_map(w, n, k, w.stride(0), BN);
  auto kernel = linear_kernel<T, BN, kMode>;
  const int k_cta = k / splits;
  const int smem = smem_bytes<T, BN>(k_cta / stage_k<T>());
  // The shared-memory opt-in is a per-device host-side attribute, set once at the largest size (K = 512)
  // on the first call, which comes before any capture (the body warms up eagerly).
  static std::atomic<uint64_t> opted_in{0};
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const uint64_t bit = uint64_t{1} << (device & 63);
  if (!(opted_in.load() & bit)) {
    TORCH_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     smem_bytes<T, BN>(kMaxK / stage_k<T>())) == cudaSuccess,
                "dit_linear: shared-memory opt-in failed");
    opted_in.fetch_or(bit);
  }
  cudaLaunchConfig_t config = {};
  const int row_tiles = (m + kBM - 1) / kBM;
  config.gridDim = dim3((row_tiles + cluster - 1) / cluster * cluster, n / BN, splits);
  config.blockDim = dim3(kThreads, 1, 1);
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
  const int ldo = static_cast<int>(out.stride(out.dim() - 2));
  const cudaError_t err =
      cudaLaunchKernelEx(&config, kernel, map_a, map_w, bias, out.data_ptr(), m, ldo, k_cta, flags, qc);
  TORCH_CHECK(err == cudaSuccess, "dit_linear: launch failed: ", cudaGetErrorString(err));
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The TMA loads' needs of both operands (row-major): unit column strides, 16-byte aligned bases and rows.
void check_tma_operands(const at::Tensor& a, const at::Tensor& w) {
  TORCH_CHECK(a.stride(1) == 1 && w.stride(1) == 1 && aligned16(a.data_ptr()) && aligned16(w.data_ptr()) &&
                  (a.stride(0) * a.element_size()) % 16 == 0 && (w.stride(0) * w.element_size()) % 16 == 0,
              "dit_linear: a and w need unit column strides, 16-byte aligned bases and rows (TMA)");
}

// K of a (M, K) in whole 128-byte stages (64 16-bit or 32 fp32 elements) per split, at most kMaxK per CTA.
void check_k(const at::Tensor& a, int64_t splits) {
  const int64_t k = a.size(1), sk = 128 / a.element_size();
  TORCH_CHECK(k > 0 && k % (sk * splits) == 0 && k / splits <= kMaxK, "dit_linear: K must split ", splits,
              " way(s) into chunks that are multiples of ", sk, ", at most ", kMaxK);
}

}  // namespace

void linear_into(const at::Tensor& a, const at::Tensor& w, const std::optional<at::Tensor>& bias, at::Tensor& out,
                 int64_t block_n, bool pdl, int64_t flags, int64_t cluster) {
  TORCH_CHECK(a.is_cuda() && w.is_cuda() && out.is_cuda(), "dit_linear: CUDA tensors");
  TORCH_CHECK(a.dim() == 2 && w.dim() == 2 && out.dim() == 2, "dit_linear: a, w, out must be 2-D");
  const auto dt = a.scalar_type();
  TORCH_CHECK((dt == at::kHalf || dt == at::kBFloat16 || dt == at::kFloat) && w.scalar_type() == dt &&
                  out.scalar_type() == dt,
              "dit_linear: a, w, out must share one dtype, fp16, bf16 or fp32 (TF32)");
  const bool tf32 = dt == at::kFloat;
  const int64_t m = a.size(0), k = a.size(1), n = w.size(0);
  TORCH_CHECK(w.size(1) == k && out.size(0) == m && out.size(1) == n, "dit_linear: shapes (M, K) x (N, K) -> (M, N)");
  check_k(a, 1);
  TORCH_CHECK(block_n == 32 || block_n == 64 || block_n == 96 || (block_n == 128 && !tf32),
              "dit_linear: block_n must be 32, 64, 96 or (16-bit) 128");
  TORCH_CHECK(n % block_n == 0, "dit_linear: N must be a multiple of block_n");
  TORCH_CHECK(cluster >= 1 && cluster <= 8 && (cluster == 1 || !tf32), "dit_linear: cluster must be 1 to 8 (TF32: 1)");
  check_tma_operands(a, w);
  TORCH_CHECK(out.stride(1) == 1, "dit_linear: out needs a unit column stride");
  TORCH_CHECK(out.stride(0) % 2 == 0 && reinterpret_cast<uintptr_t>(out.data_ptr()) % (2 * out.element_size()) == 0,
              "dit_linear: out needs aligned column pairs");
  const bool has_bias = !(flags & kNoBias);
  if (has_bias) {
    TORCH_CHECK(bias.has_value() && bias->is_cuda() && bias->scalar_type() == dt && bias->dim() == 1 &&
                    bias->size(0) == n && bias->is_contiguous(),
                "dit_linear: bias must be a contiguous (N,) tensor of the same dtype (or pass flag 4, no bias)");
  }
  if (m == 0) return;
  const c10::cuda::CUDAGuard guard(a.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const int f = static_cast<int>(flags), c = static_cast<int>(cluster);
  const void* b = has_bias ? bias->data_ptr() : nullptr;
#define TORCH_CFM_LINEAR_CASE(T, BN)                                                \
  if (block_n == BN) {                                                              \
    launch<T, BN, kOut>(a, w, static_cast<const T*>(b), out, pdl, f, c, 1, stream);  \
    return;                                                                         \
  }
  if (tf32) {
    TORCH_CFM_LINEAR_CASE(float, 32) TORCH_CFM_LINEAR_CASE(float, 64) TORCH_CFM_LINEAR_CASE(float, 96)
  } else if (dt == at::kHalf) {
    TORCH_CFM_LINEAR_CASE(__half, 32) TORCH_CFM_LINEAR_CASE(__half, 64) TORCH_CFM_LINEAR_CASE(__half, 96)
    TORCH_CFM_LINEAR_CASE(__half, 128)
  } else {
    TORCH_CFM_LINEAR_CASE(__nv_bfloat16, 32) TORCH_CFM_LINEAR_CASE(__nv_bfloat16, 64)
    TORCH_CFM_LINEAR_CASE(__nv_bfloat16, 96) TORCH_CFM_LINEAR_CASE(__nv_bfloat16, 128)
  }
#undef TORCH_CFM_LINEAR_CASE
}

void linear_splitk_into(const at::Tensor& a, const at::Tensor& w, at::Tensor& partials, int64_t block_n, bool pdl,
                        int64_t flags, int64_t splits) {
  TORCH_CHECK(a.is_cuda() && w.is_cuda() && partials.is_cuda(), "dit_linear: CUDA tensors");
  TORCH_CHECK(a.dim() == 2 && w.dim() == 2 && partials.dim() == 3, "dit_linear: a, w 2-D and partials 3-D");
  const auto dt = a.scalar_type();
  TORCH_CHECK((dt == at::kHalf || dt == at::kBFloat16 || dt == at::kFloat) && w.scalar_type() == dt,
              "dit_linear: a and w must share one dtype, fp16, bf16 or fp32 (TF32)");
  const bool tf32 = dt == at::kFloat;
  TORCH_CHECK(partials.scalar_type() == at::kFloat && partials.is_contiguous(),
              "dit_linear: partials must be a contiguous float32 tensor");
  const int64_t m = a.size(0), k = a.size(1), n = w.size(0);
  TORCH_CHECK(splits >= 1 && splits <= 16, "dit_linear: splits must be 1 to 16");
  TORCH_CHECK(w.size(1) == k && partials.size(0) == splits && partials.size(1) == m && partials.size(2) == n,
              "dit_linear: shapes (M, K) x (N, K) -> (splits, M, N)");
  check_k(a, splits);
  TORCH_CHECK(block_n == 64 || (block_n == 128 && !tf32), "dit_linear: split-K block_n must be 64 or (16-bit) 128");
  TORCH_CHECK(n % block_n == 0, "dit_linear: N must be a multiple of block_n");
  check_tma_operands(a, w);
  if (m == 0) return;
  const c10::cuda::CUDAGuard guard(a.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const int f = static_cast<int>(flags & kTriggerEarly) | kNoBias, s = static_cast<int>(splits);
#define TORCH_CFM_SPLITK_CASE(T, BN)                                              \
  if (block_n == BN) {                                                            \
    launch<T, BN, kPartials>(a, w, nullptr, partials, pdl, f, 1, s, stream);      \
    return;                                                                       \
  }
  if (tf32) {
    TORCH_CFM_SPLITK_CASE(float, 64)
  } else if (dt == at::kHalf) {
    TORCH_CFM_SPLITK_CASE(__half, 64) TORCH_CFM_SPLITK_CASE(__half, 128)
  } else {
    TORCH_CFM_SPLITK_CASE(__nv_bfloat16, 64) TORCH_CFM_SPLITK_CASE(__nv_bfloat16, 128)
  }
#undef TORCH_CFM_SPLITK_CASE
}

namespace {

template <typename T>
void launch_qkv_cache(const at::Tensor& a, const at::Tensor& w, const at::Tensor& bias, const at::Tensor& qn_w,
                      const at::Tensor& qn_b, const at::Tensor& kn_w, const at::Tensor& kn_b, at::Tensor& q_out,
                      at::Tensor& cache, const at::Tensor& valid, const at::Tensor& cached, int t_len, float eps,
                      bool pdl, int flags, cudaStream_t stream) {
  QkvCacheArgs<T> qc;
  qc.qn_w = static_cast<const T*>(qn_w.data_ptr());
  qc.qn_b = static_cast<const T*>(qn_b.data_ptr());
  qc.kn_w = static_cast<const T*>(kn_w.data_ptr());
  qc.kn_b = static_cast<const T*>(kn_b.data_ptr());
  qc.cache = static_cast<T*>(cache.data_ptr());
  qc.s_n = cache.stride(0);
  qc.s_h = cache.stride(1);
  qc.s_f = cache.stride(2);
  qc.valid = valid.data_ptr<int>();
  qc.cached = cached.data_ptr<int>();
  qc.t_len = t_len;
  qc.heads = static_cast<int>(cache.size(1));
  qc.eps = eps;
  // 128-wide tiles: two heads
  launch<T, 128, kQkvCache>(a, w, static_cast<const T*>(bias.data_ptr()), q_out, pdl, flags, 1, 1, stream, qc);
}

}  // namespace

void linear_qkv_cache_into(const at::Tensor& a, const at::Tensor& w, const at::Tensor& bias, const at::Tensor& qn_w,
                           const at::Tensor& qn_b, const at::Tensor& kn_w, const at::Tensor& kn_b, at::Tensor& q_out,
                           at::Tensor& cache, const at::Tensor& valid, const at::Tensor& cached, int64_t t_len,
                           double eps, bool pdl, int64_t flags) {
  for (const at::Tensor* t :
       std::initializer_list<const at::Tensor*>{&a, &w, &bias, &qn_w, &qn_b, &kn_w, &kn_b, &q_out, &cache, &valid, &cached}) {
    TORCH_CHECK(t->is_cuda() && t->device() == a.device(), "dit_linear: every tensor on the device of a");
  }
  const auto dt = a.scalar_type();
  TORCH_CHECK(dt == at::kHalf || dt == at::kBFloat16, "dit_linear: a must be fp16 or bf16");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&w, &bias, &qn_w, &qn_b, &kn_w, &kn_b, &q_out, &cache}) {
    TORCH_CHECK(t->scalar_type() == dt, "dit_linear: w, bias, norms, q_out and cache share a's dtype");
  }
  TORCH_CHECK(a.dim() == 2 && w.dim() == 2 && q_out.dim() == 2 && cache.dim() == 4,
              "dit_linear: a, w, q_out 2-D and cache 4-D (N, heads, P, 128)");
  const int64_t m = a.size(0), k = a.size(1), n_rows = cache.size(0), heads = cache.size(1);
  const int64_t inner = heads * 64;
  TORCH_CHECK(cache.size(3) == 128 && cache.stride(3) == 1, "dit_linear: cache (N, heads, P, 2 x 64), unit channel stride");
  TORCH_CHECK(w.size(0) == 3 * inner && w.size(1) == k, "dit_linear: w (3 x heads x 64, K)");
  TORCH_CHECK(inner % 128 == 0, "dit_linear: heads must be even (128-wide tiles of whole heads)");
  TORCH_CHECK(t_len > 0 && m == n_rows * t_len, "dit_linear: a has N x t_len rows");
  TORCH_CHECK(q_out.size(0) == m && q_out.size(1) == inner && q_out.is_contiguous(),
              "dit_linear: q_out contiguous (M, heads x 64)");
  TORCH_CHECK(bias.dim() == 1 && bias.size(0) == 3 * inner && bias.is_contiguous(), "dit_linear: bias (3 x heads x 64,)");
  for (const at::Tensor* t : {&qn_w, &qn_b, &kn_w, &kn_b}) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == 64 && t->is_contiguous(), "dit_linear: norm weights (64,)");
  }
  for (const at::Tensor* t : {&valid, &cached}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->dim() == 1 && t->size(0) == n_rows && t->is_contiguous(),
                "dit_linear: valid and cached int32 (N,)");
  }
  check_k(a, 1);
  check_tma_operands(a, w);
  const int64_t pair_bytes = 2 * a.element_size();
  TORCH_CHECK(reinterpret_cast<uintptr_t>(cache.data_ptr()) % pair_bytes == 0 && cache.stride(2) % 2 == 0 &&
                  cache.stride(1) % 2 == 0 && cache.stride(0) % 2 == 0 &&
                  reinterpret_cast<uintptr_t>(q_out.data_ptr()) % pair_bytes == 0,
              "dit_linear: q_out and cache need aligned column pairs");
  if (m == 0) return;
  const c10::cuda::CUDAGuard guard(a.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const int f = static_cast<int>(flags & kTriggerEarly);
  if (dt == at::kHalf) {
    launch_qkv_cache<__half>(a, w, bias, qn_w, qn_b, kn_w, kn_b, q_out, cache, valid, cached, static_cast<int>(t_len),
                             static_cast<float>(eps), pdl, f, stream);
  } else {
    launch_qkv_cache<__nv_bfloat16>(a, w, bias, qn_w, qn_b, kn_w, kn_b, q_out, cache, valid, cached,
                                    static_cast<int>(t_len), static_cast<float>(eps), pdl, f, stream);
  }
}

bool available() {
  static std::mutex lock;
  static std::unordered_map<int, bool> by_device;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  std::lock_guard<std::mutex> hold(lock);
  auto found = by_device.find(device);
  if (found != by_device.end()) return found->second;
  cudaDeviceProp prop;
  bool ok = cudaGetDeviceProperties(&prop, device) == cudaSuccess && prop.major == 9 && prop.minor == 0;
  if (ok) {  // a synchronous probe on the legacy stream's side: called once per device, before any capture
    int* flag = nullptr;
    int host = 0;
    ok = cudaMalloc(&flag, sizeof(int)) == cudaSuccess;
    if (ok) {
      probe_kernel<<<1, 1>>>(flag);
      ok = cudaMemcpy(&host, flag, sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess && host == 1;
      cudaFree(flag);
    }
    cudaGetLastError();  // a build without sm_90 code fails the launch: clear it, report unavailable
  }
  by_device[device] = ok;
  return ok;
}

}  // namespace dit_linear
}  // namespace torch_cfm
