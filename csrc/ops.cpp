// torch_cfm op schemas: defined once here so C++ callers (AOTInductor packages) see them without
// Python. Python adds fake kernels, autocast rules and CUDA (Triton) kernels to these schemas;
// csrc/cpu/*.cpp register the CPU kernels.
#include <Python.h>
#include <torch/library.h>

extern "C" {
// `import torch_cfm._C` loads this shared object, which runs the registrations below.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(torch_cfm, m) {
  // Ragged, cache-aware attention (docs/design.md §4). Output (N, H, Q, D) stored as contiguous (N, Q, H, D).
  m.def(
      "cfm_attention(Tensor q, Tensor k, Tensor v, Tensor? key_lengths=None, Tensor? mask=None, "
      "Tensor? kv_rows=None, str precision=\"auto\") -> Tensor");
}
