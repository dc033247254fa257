// Python module of the optional extension torch_cfm._C_cuda (hand-written CUDA kernels, csrc/cuda/).
#include <torch/extension.h>

#include "bindings.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "torch_cfm CUDA kernels (optional build, csrc/cuda/)";
  m.def("cfm_attention_fwd", &torch_cfm::cuda_attention::cfm_attention_fwd,
        "cfm_attention into a preallocated out (D = 64, validated inputs)", pybind11::arg("q"), pybind11::arg("k"),
        pybind11::arg("v"), pybind11::arg("key_lengths"), pybind11::arg("mask"), pybind11::arg("kv_rows"),
        pybind11::arg("out"), pybind11::arg("block_k"), pybind11::arg("q_groups"), pybind11::arg("key_splits"),
        pybind11::arg("buffers"), pybind11::arg("cluster") = 1, pybind11::arg("kv_groups") = 1,
        pybind11::arg("pdl") = false, pybind11::arg("ablate") = 0);
  m.def("configs", &torch_cfm::cuda_attention::configs,
        "instantiated (family, block_k, q_groups, key_splits, buffers, cluster, kv_groups, smem_bytes)");
  m.def("dit_rownorm", &torch_cfm::cuda_rownorm::dit_rownorm,
        "one DiT body row-norm boundary, C = 512 (validated inputs; kernels/dit_rownorm_cuda.py)",
        pybind11::arg("y"), pybind11::arg("bias"), pybind11::arg("h"), pybind11::arg("table"),
        pybind11::arg("gate_off"), pybind11::arg("shift_off"), pybind11::arg("scale_off"), pybind11::arg("ln_w"),
        pybind11::arg("ln_b"), pybind11::arg("out"), pybind11::arg("out_t"), pybind11::arg("out_off"),
        pybind11::arg("head"), pybind11::arg("cnn"), pybind11::arg("head_cbase"), pybind11::arg("emit_src"),
        pybind11::arg("emit_dst"), pybind11::arg("emit_cbase"), pybind11::arg("valid"), pybind11::arg("n_rows"),
        pybind11::arg("t_len"), pybind11::arg("eps"), pybind11::arg("taps"), pybind11::arg("has_res"),
        pybind11::arg("write_h"), pybind11::arg("pdl"));
}
