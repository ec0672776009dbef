// Module init of the extension setup.py builds when asked (VLLM_KVPRUNE_CUDA_SLOT_OPS=1), so that
// `import vllm_kvprune._cuda_C` loads the shared object and with it the TORCH_LIBRARY
// registrations of slot_ops.cu (the ops live in torch.ops.kvprune_cuda; the module itself
// exposes nothing). Not part of the JIT build of benchmarks/cuda_ops.py's load_cuda_ops, which
// loads the library with torch.ops.load_library instead.
#include <Python.h>

static struct PyModuleDef kvprune_cuda_module = {PyModuleDef_HEAD_INIT, "_cuda_C",
                                                 "vllm_kvprune CUDA ops (see torch.ops.kvprune_cuda)", -1,
                                                 nullptr};

PyMODINIT_FUNC PyInit__cuda_C(void) { return PyModule_Create(&kvprune_cuda_module); }
