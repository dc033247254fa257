// One Hopper GEMM kernel type per (dtype, CTA tile, cluster, schedule, epilogue), assembled from the
// CUTLASS 3.x collective builders, and its host launcher. Each gemm_<config>.cu instantiates one
// config (its kernels for fp16 and bf16, bias and bias + GELU) through TCFM_CONFIG below.
//
// Operands (the DiT body's nn.Linear calls): A (M, K) row-major, B = the weight (N, K) row-major
// (CUTLASS's column-major B, K-major for wgmma), D (M, N) row-major, fp32 accumulation. The epilogue
// is an epilogue-visitor tree: D = op(acc, bias) with the (N,) bias broadcast along M and converted to
// fp32 (a NULL bias reads as zeros), op = add or add + GELU (tanh form), D rounded to nearest once.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "config_entry.h"
#include "tcfm_cutlass.h"

namespace tcfm_cutlass {

// 2^a on the SFU alone (one MUFU.EX2, ~2 ulp): the .ftz form drops the 3 instructions that __expf /
// exp2f add to keep subnormal results, which here arise only for x > ~10, where the sigmoid is 1 in fp32.
CUTLASS_DEVICE float ex2_approx_ftz(float a) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(a));
  return y;
}

// gelu_tanh(x + b) = 0.5 (x + b) (1 + tanh(u)) written as (x + b) * sigmoid(2u): no cancellation for
// negative arguments and no tanh.approx (whose 2^-11 relative error is that of the fp16 output).
// Straight-line code, 8 instructions per element (FADD, FMUL, FFMA, FMUL, MUFU.EX2, FADD, MUFU.RCP, FMUL):
// - log2(e) is folded into the polynomial: sigmoid(2u) = 1 / (1 + 2^t), t = -2u log2(e) = x (C1 + C3 x^2).
// - __fdividef (MUFU.RCP + FMUL), not x / y: an IEEE division branches to a slow-path subroutine per
//   element, which keeps the compiler from interleaving the elements of a fragment.
// Error: <= ~1e-6 relative for |x| <= 4, ~5e-6 at x = -6 (output ~1e-10): >= 100x below the output
// rounding (fp16 2^-11, bf16 2^-8 relative).
// Limits: x -> -inf: 2^t -> +inf, rcp(inf) = 0, out -> -0, no NaN for finite x; x = -inf gives NaN, as the
// formula does; x -> +inf: out = x; x = 0: 0.
template <class T>
struct AddGeluTanh;

template <int N>
struct AddGeluTanh<cutlass::Array<float, N>> {
  CUTLASS_DEVICE cutlass::Array<float, N> operator()(cutlass::Array<float, N> const& acc,
                                                     cutlass::Array<float, N> const& bias) const {
    constexpr float kC1 = -2.302208198144325f;    // -2 sqrt(2/pi) log2(e)
    constexpr float kC3 = -0.1029432395800235f;   // -2 sqrt(2/pi) 0.044715 log2(e)
    cutlass::Array<float, N> out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) {
      const float x = acc[i] + bias[i];
      const float t = x * fmaf(x * x, kC3, kC1);  // -2u log2(e), u = sqrt(2/pi) (x + 0.044715 x^3)
      out[i] = __fdividef(x, 1.0f + ex2_approx_ftz(t));
    }
    return out;
  }
};

template <class Element, class TileShape, class ClusterShape, Schedule kSchedule,
          template <class> class EpilogueOp>
struct Sm90Gemm {
  static constexpr int kAlign = 16 / sizeof(Element);
  using MainloopSchedule = cute::conditional_t<kSchedule == Schedule::kPingpong,
                                               cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                                               cutlass::gemm::KernelTmaWarpSpecializedCooperative>;
  using EpilogueSchedule = cute::conditional_t<kSchedule == Schedule::kPingpong, cutlass::epilogue::TmaWarpSpecialized,
                                               cutlass::epilogue::TmaWarpSpecializedCooperative>;
  using TileScheduler = cute::conditional_t<kSchedule == Schedule::kStreamK, cutlass::gemm::StreamKScheduler,
                                            cutlass::gemm::PersistentScheduler>;

  using BiasStride = cute::Stride<cute::_0, cute::_1, int64_t>;
  using Bias = cutlass::epilogue::fusion::Sm90RowBroadcast<0, TileShape, Element, float, BiasStride, kAlign>;
  using Fusion = cutlass::epilogue::fusion::Sm90EVT<
      cutlass::epilogue::fusion::Sm90Compute<EpilogueOp, Element, float, cutlass::FloatRoundStyle::round_to_nearest>,
      cutlass::epilogue::fusion::Sm90AccFetch, Bias>;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, cutlass::layout::RowMajor, kAlign,
      Element, cutlass::layout::RowMajor, kAlign, EpilogueSchedule, Fusion>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, kAlign, Element,
      cutlass::layout::ColumnMajor, kAlign, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue, TileScheduler>;
  using Adapter = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static typename Adapter::Arguments arguments(const GemmCall& c) {
    using StrideA = typename Kernel::StrideA;
    using StrideB = typename Kernel::StrideB;
    using StrideD = typename Kernel::StrideD;
    const StrideA sa = cute::make_stride(c.lda, cute::Int<1>{}, c.lda * c.m);
    const StrideB sb = cute::make_stride(c.ldb, cute::Int<1>{}, c.ldb * c.n);
    const StrideD sd = cute::make_stride(c.ldd, cute::Int<1>{}, c.ldd * c.m);
    cutlass::KernelHardwareInfo hw;
    hw.device_id = c.device;
    hw.sm_count = c.sm_count;
    typename Adapter::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {c.m, c.n, c.k, 1},
        {static_cast<const Element*>(c.a), sa, static_cast<const Element*>(c.b), sb},
        {{}, nullptr, sd, static_cast<Element*>(c.d), sd},
        hw};
    // EVT arguments nest as the tree: {acc fetch, bias broadcast, compute}
    args.epilogue.thread = {{}, {static_cast<const Element*>(c.bias), Element(0), BiasStride{}}, {}};
    return args;
  }
};

template <class G>
long long workspace_size(const GemmCall& c) {
  return static_cast<long long>(G::Adapter::get_workspace_size(G::arguments(c)));
}

template <class G>
int launch(const GemmCall& c) {
  using Kernel = typename G::Kernel;
  using Adapter = typename G::Adapter;
  const typename Adapter::Arguments args = G::arguments(c);
  if (Adapter::can_implement(args) != cutlass::Status::kSuccess) {
    set_error("the kernel cannot take M=%d N=%d K=%d lda=%lld ldb=%lld ldd=%lld (CUTLASS can_implement)", c.m, c.n,
              c.k, static_cast<long long>(c.lda), static_cast<long long>(c.ldb), static_cast<long long>(c.ldd));
    return TCFM_ERR_ARGUMENT;
  }
  const size_t need = Adapter::get_workspace_size(args);
  if (need > 0 && (c.workspace == nullptr || c.workspace_bytes < need)) {
    set_error("workspace of %zu bytes needed, got %zu", need, c.workspace ? c.workspace_bytes : size_t{0});
    return TCFM_ERR_WORKSPACE;
  }
  // The stream-K scheduler zeroes its tile counters here (a memset on the stream: capturable).
  if (Kernel::initialize_workspace(args, c.workspace, c.stream) != cutlass::Status::kSuccess) {
    set_error("workspace initialisation failed: %s", cudaGetErrorString(cudaGetLastError()));
    return TCFM_ERR_CUDA;
  }
  typename Kernel::Params params = Kernel::to_underlying_arguments(args, c.workspace);
  // The shared-memory opt-in is per device and kernel: set once, on the first launch.
  static std::atomic<uint64_t> opted_in{0};
  const uint64_t bit = uint64_t{1} << (c.device & 63);
  if (!(opted_in.load(std::memory_order_acquire) & bit)) {
    const cudaError_t err = cudaFuncSetAttribute(cutlass::device_kernel<Kernel>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(Kernel::SharedStorageSize));
    if (err != cudaSuccess) {
      cudaGetLastError();
      set_error("cudaFuncSetAttribute(%d bytes of shared memory): %s", static_cast<int>(Kernel::SharedStorageSize),
                cudaGetErrorString(err));
      return err == cudaErrorNoKernelImageForDevice || err == cudaErrorInvalidDeviceFunction ? TCFM_ERR_UNSUPPORTED
                                                                                           : TCFM_ERR_CUDA;
    }
    opted_in.fetch_or(bit, std::memory_order_acq_rel);
  }
  if (Adapter::run(params, c.stream, nullptr, c.pdl) != cutlass::Status::kSuccess) {
    set_error("launch failed: %s", cudaGetErrorString(cudaGetLastError()));
    return TCFM_ERR_CUDA;
  }
  return TCFM_OK;
}

template <class Tile, class Cluster, Schedule S, bool kWithGelu>
ConfigEntry make_config(const char* name) {
  using F16 = Sm90Gemm<cutlass::half_t, Tile, Cluster, S, cutlass::plus>;
  using B16 = Sm90Gemm<cutlass::bfloat16_t, Tile, Cluster, S, cutlass::plus>;
  ConfigEntry e{name,
                cute::size<0>(Tile{}),
                cute::size<1>(Tile{}),
                cute::size<0>(Cluster{}),
                cute::size<1>(Cluster{}),
                S,
                {{&launch<F16>, &launch<B16>}, {nullptr, nullptr}},
                {{&workspace_size<F16>, &workspace_size<B16>}, {nullptr, nullptr}}};
  if constexpr (kWithGelu) {
    using F16G = Sm90Gemm<cutlass::half_t, Tile, Cluster, S, AddGeluTanh>;
    using B16G = Sm90Gemm<cutlass::bfloat16_t, Tile, Cluster, S, AddGeluTanh>;
    e.launch[TCFM_EPI_BIAS_GELU][TCFM_DTYPE_F16] = &launch<F16G>;
    e.launch[TCFM_EPI_BIAS_GELU][TCFM_DTYPE_BF16] = &launch<B16G>;
    e.workspace[TCFM_EPI_BIAS_GELU][TCFM_DTYPE_F16] = &workspace_size<F16G>;
    e.workspace[TCFM_EPI_BIAS_GELU][TCFM_DTYPE_BF16] = &workspace_size<B16G>;
  }
  return e;
}

}  // namespace tcfm_cutlass

// Defines `ConfigEntry const& tcfm_cutlass::config_<ident>()` in one translation unit.
#define TCFM_CONFIG(ident, TILE_M, TILE_N, CLUSTER_M, CLUSTER_N, SCHEDULE, WITH_GELU)                              \
  namespace tcfm_cutlass {                                                                                         \
  ConfigEntry const& config_##ident() {                                                                            \
    static const ConfigEntry entry =                                                                               \
        make_config<cute::Shape<cute::Int<TILE_M>, cute::Int<TILE_N>, cute::_64>,                                  \
                    cute::Shape<cute::Int<CLUSTER_M>, cute::Int<CLUSTER_N>, cute::_1>, SCHEDULE, WITH_GELU>(#ident); \
    return entry;                                                                                                  \
  }                                                                                                                \
  }
