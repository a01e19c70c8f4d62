// One ISA variant's module (kvcache/_native/_C_<isa>): its table of kernels as a capsule ("ops") that the bindings
// module (_C) wraps, and the variant's name ("isa"). Importing it runs no instruction of its variant: kvcache.native
// imports only what the CPU runs.
#include <Python.h>

#include "isa.h"
#include "ops.h"

#define KVCACHE_CAT2(a, b) a##b
#define KVCACHE_CAT(a, b) KVCACHE_CAT2(a, b)
#define KVCACHE_STR2(a) #a
#define KVCACHE_STR(a) KVCACHE_STR2(a)

namespace {

const kvcache::Ops OPS = {
    .version = kvcache::OPS_VERSION,
    .isa = KVCACHE_ISA_NAME,
    .paged_decode = &kvcache::paged_decode,
    .paged_decode_quant = &kvcache::paged_decode_quant,
    .prefill_attention = &kvcache::prefill_attention,
    .pack_panels = &kvcache::pack_panels,
    .panel_linear = &kvcache::panel_linear,
    .code_panel_linear = &kvcache::code_panel_linear,
    .code_rows = &kvcache::code_rows,
    .gate_up_silu = &kvcache::gate_up_silu,
    .int8_linear = &kvcache::int8_linear,
    .int4_linear = &kvcache::int4_linear,
    .q8_linear = &kvcache::q8_linear,
    .has_int4 = &kvcache::has_int4,
    .add_rms_norm = &kvcache::add_rms_norm,
    .rope_ = &kvcache::rope_,
    .silu_mul = &kvcache::silu_mul,
    .attn_in = &kvcache::attn_in,
    .mlp = &kvcache::mlp,
    .decode_layers = &kvcache::decode_layers,
    .argmax_finite = &kvcache::argmax_finite,
};

PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, KVCACHE_STR(TORCH_EXTENSION_NAME),
                      "kvcache's C++ CPU kernels, " KVCACHE_ISA_NAME " variant (see csrc/isa.h)", -1, nullptr};

}  // namespace

PyMODINIT_FUNC KVCACHE_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  PyObject* m = PyModule_Create(&MODULE);
  if (m == nullptr) return nullptr;
  PyObject* capsule = PyCapsule_New(const_cast<kvcache::Ops*>(&OPS), "kvcache.Ops", nullptr);
  if (capsule == nullptr || PyModule_AddObject(m, "ops", capsule) < 0 ||
      PyModule_AddStringConstant(m, "isa", KVCACHE_ISA_NAME) < 0 ||
      PyModule_AddIntConstant(m, "ops_version", kvcache::OPS_VERSION) < 0) {
    Py_XDECREF(capsule);
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
