// The C entry points of libtcfm_cutlass.so (tcfm_cutlass.h): the config table, argument checks and
// dispatch to the kernels that gemm_<config>.cu instantiate.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdarg>
#include <cstdint>
#include <cstdio>

#include "config_entry.h"
#include "tcfm_cutlass.h"

namespace tcfm_cutlass {

// One accessor per gemm_<config>.cu; the order here is the config index of the C ABI.
ConfigEntry const& config_coop_128x128();
ConfigEntry const& config_coop_128x256();
ConfigEntry const& config_coop_128x256_c2x1();
ConfigEntry const& config_pingpong_128x128();
ConfigEntry const& config_streamk_128x128();
ConfigEntry const& config_streamk_128x256();

namespace {

using Accessor = ConfigEntry const& (*)();
constexpr Accessor kConfigs[] = {&config_coop_128x128,      &config_coop_128x256,    &config_coop_128x256_c2x1,
                                 &config_pingpong_128x128,  &config_streamk_128x128, &config_streamk_128x256};
constexpr int kNumConfigs = static_cast<int>(sizeof(kConfigs) / sizeof(kConfigs[0]));
constexpr int kMaxDevices = 64;

thread_local char last_error[512] = "";

ConfigEntry const* find_config(int config) {
  return config >= 0 && config < kNumConfigs ? &kConfigs[config]() : nullptr;
}

bool valid_kind(int epilogue, int dtype) {
  return (epilogue == TCFM_EPI_BIAS || epilogue == TCFM_EPI_BIAS_GELU) &&
         (dtype == TCFM_DTYPE_F16 || dtype == TCFM_DTYPE_BF16);
}

// Make `device` current for this library's runtime (statically linked: its current device is its own).
int use_device(int device) {
  int current = -1;
  cudaError_t err = cudaGetDevice(&current);
  if (err == cudaSuccess && current != device) err = cudaSetDevice(device);
  if (err != cudaSuccess) {
    cudaGetLastError();
    set_error("device %d: %s", device, cudaGetErrorString(err));
    return TCFM_ERR_CUDA;
  }
  return TCFM_OK;
}

// SMs of `device` (0: not an SM90 GPU), settled once per device.
int sm90_sm_count(int device) {
  static std::atomic<int> cached[kMaxDevices] = {};
  int value = cached[device].load(std::memory_order_relaxed);
  if (value != 0) return value > 0 ? value : 0;
  int major = 0, minor = 0, sms = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  value = (major == 9 && minor == 0 && sms > 0) ? sms : -1;
  cached[device].store(value, std::memory_order_relaxed);
  return value > 0 ? value : 0;
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// The checks every call shares; fills `call` (sizes, device, SM count) on success.
int prepare(int config, int epilogue, int dtype, int m, int n, int k, int device, ConfigEntry const** entry,
            GemmCall* call) {
  *entry = find_config(config);
  if (*entry == nullptr) {
    set_error("config %d is not one of the %d configs", config, kNumConfigs);
    return TCFM_ERR_CONFIG;
  }
  if (!valid_kind(epilogue, dtype)) {
    set_error("epilogue %d / dtype %d unknown (epilogue 0 bias, 1 bias+gelu; dtype 0 fp16, 1 bf16)", epilogue, dtype);
    return TCFM_ERR_ARGUMENT;
  }
  if ((*entry)->launch[epilogue][dtype] == nullptr) {
    set_error("config %s has no kernel for epilogue %d, dtype %d", (*entry)->name, epilogue, dtype);
    return TCFM_ERR_CONFIG;
  }
  if (m < 1 || n < 1 || k < 1 || n % 8 || k % 8) {
    set_error("M, N, K must be positive with N and K multiples of 8, got M=%d N=%d K=%d", m, n, k);
    return TCFM_ERR_ARGUMENT;
  }
  if (device < 0 || device >= kMaxDevices) {
    set_error("device %d out of range", device);
    return TCFM_ERR_ARGUMENT;
  }
  if (int rc = use_device(device)) return rc;
  const int sms = sm90_sm_count(device);
  if (sms == 0) {
    set_error("device %d is not an SM90 (Hopper) GPU", device);
    return TCFM_ERR_UNSUPPORTED;
  }
  *call = GemmCall{};
  call->m = m;
  call->n = n;
  call->k = k;
  call->lda = k;
  call->ldb = k;
  call->ldd = n;
  call->device = device;
  call->sm_count = sms;
  return TCFM_OK;
}

}  // namespace

void set_error(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_error, sizeof(last_error), fmt, ap);
  va_end(ap);
}

}  // namespace tcfm_cutlass

using namespace tcfm_cutlass;

extern "C" {

int tcfm_cutlass_abi_version(void) { return TCFM_CUTLASS_ABI_VERSION; }

int tcfm_cutlass_num_configs(void) { return kNumConfigs; }

const char* tcfm_cutlass_config_name(int config) {
  ConfigEntry const* e = find_config(config);
  return e ? e->name : nullptr;
}

int tcfm_cutlass_config_info(int config, int* tile_m, int* tile_n, int* cluster_m, int* cluster_n, int* schedule) {
  ConfigEntry const* e = find_config(config);
  if (e == nullptr) return TCFM_ERR_CONFIG;
  if (tile_m) *tile_m = e->tile_m;
  if (tile_n) *tile_n = e->tile_n;
  if (cluster_m) *cluster_m = e->cluster_m;
  if (cluster_n) *cluster_n = e->cluster_n;
  if (schedule) *schedule = static_cast<int>(e->schedule);
  return TCFM_OK;
}

int tcfm_cutlass_config_supports(int config, int epilogue, int dtype) {
  ConfigEntry const* e = find_config(config);
  return e != nullptr && valid_kind(epilogue, dtype) && e->launch[epilogue][dtype] != nullptr;
}

long long tcfm_cutlass_workspace_size(int config, int epilogue, int dtype, int m, int n, int k, int device) {
  last_error[0] = '\0';
  ConfigEntry const* e = nullptr;
  GemmCall call;
  if (int rc = prepare(config, epilogue, dtype, m, n, k, device, &e, &call)) return rc;
  return e->workspace[epilogue][dtype](call);
}

int tcfm_cutlass_gemm(int config, int epilogue, int dtype, const void* a, long long lda, const void* b, long long ldb,
                      const void* bias, void* d, long long ldd, int m, int n, int k, void* workspace,
                      size_t workspace_bytes, int pdl, int device, void* stream) {
  last_error[0] = '\0';
  ConfigEntry const* e = nullptr;
  GemmCall call;
  if (int rc = prepare(config, epilogue, dtype, m, n, k, device, &e, &call)) return rc;
  const struct {
    const char* name;
    const void* ptr;
    long long ld, min_ld;
  } mats[] = {{"a", a, lda, k}, {"b", b, ldb, k}, {"d", d, ldd, n}};
  for (const auto& t : mats) {
    if (t.ptr == nullptr || !aligned16(t.ptr) || t.ld < t.min_ld || t.ld % 8) {
      set_error("%s must be a non-null 16-byte aligned pointer with a row stride >= %lld and a multiple of 8 "
                "elements, got %p with row stride %lld", t.name, t.min_ld, t.ptr, t.ld);
      return TCFM_ERR_ARGUMENT;
    }
  }
  if (bias != nullptr && (reinterpret_cast<uintptr_t>(bias) & 1u)) {
    set_error("bias must be 2-byte aligned, got %p", bias);
    return TCFM_ERR_ARGUMENT;
  }
  call.a = a;
  call.b = b;
  call.bias = bias;
  call.d = d;
  call.lda = lda;
  call.ldb = ldb;
  call.ldd = ldd;
  call.workspace = workspace;
  call.workspace_bytes = workspace_bytes;
  call.pdl = pdl != 0;
  call.stream = static_cast<cudaStream_t>(stream);
  return e->launch[epilogue][dtype](call);
}

const char* tcfm_cutlass_last_error(void) { return last_error; }

}  // extern "C"
