// The bindings module (kvcache/_native/_C), built for the target's baseline: what the CPU supports, and Kernels, one
// ISA variant's table of kernels (a capsule from its module, csrc/module.cpp) as Python methods. Each call releases
// the GIL while the kernel runs, so that a server's HTTP thread runs beside the engine's kernels.
#include <torch/csrc/utils/pybind.h>

#include <string>
#include <utility>
#include <vector>

#include "ops.h"

namespace py = pybind11;

namespace {

struct Kernels {
  const kvcache::Ops* ops;
};

// Binds the table's field `field` as method `name`, the GIL released during the call (after the arguments are
// converted, before the result is)
template <class R, class... A>
void bind(py::class_<Kernels>& cls, const char* name, R (*kvcache::Ops::*field)(A...)) {
  cls.def(
      name, [field](const Kernels& k, A... args) -> R { return (k.ops->*field)(std::move(args)...); },
      py::call_guard<py::gil_scoped_release>());
}

// The CPU features a variant needs and this CPU has (cpuid, and the OS's saving of the vector state: GCC's
// __builtin_cpu_supports checks both). Names as /proc/cpuinfo spells them.
std::vector<std::string> cpu_features() {
  std::vector<std::string> have;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
#define KVCACHE_FEATURE(gcc, name) \
  if (__builtin_cpu_supports(gcc)) have.emplace_back(name);
  KVCACHE_FEATURE("avx2", "avx2")
  KVCACHE_FEATURE("fma", "fma")
  KVCACHE_FEATURE("f16c", "f16c")
  KVCACHE_FEATURE("x86-64-v3", "x86-64-v3")
  KVCACHE_FEATURE("avx512f", "avx512f")
  KVCACHE_FEATURE("avx512bw", "avx512bw")
  KVCACHE_FEATURE("avx512vl", "avx512vl")
  KVCACHE_FEATURE("avx512dq", "avx512dq")
  KVCACHE_FEATURE("avx512cd", "avx512cd")
  KVCACHE_FEATURE("x86-64-v4", "x86-64-v4")
  KVCACHE_FEATURE("avx512vnni", "avx512_vnni")
  KVCACHE_FEATURE("avx512bf16", "avx512_bf16")
  KVCACHE_FEATURE("amx-tile", "amx_tile")
#undef KVCACHE_FEATURE
#endif
  return have;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kvcache's C++ CPU kernels: bindings over the ISA variants' tables";
  m.attr("ops_version") = kvcache::OPS_VERSION;
  m.def("cpu_features", &cpu_features, "the instruction-set features of this CPU that the variants need");
  py::class_<Kernels> cls(m, "Kernels", "one ISA variant's kernels (kvcache.native.kernels gives the chosen one)");
  cls.def(py::init([](py::capsule table) {
            if (std::string(table.name()) != "kvcache.Ops") throw py::value_error("not a kvcache.Ops capsule");
            const auto* ops = table.get_pointer<kvcache::Ops>();
            if (ops->version != kvcache::OPS_VERSION)
              throw py::value_error("an ISA module of table version " + std::to_string(ops->version) +
                                    " with bindings of version " + std::to_string(kvcache::OPS_VERSION) +
                                    ": built from other sources");
            return Kernels{ops};
          }),
          py::keep_alive<1, 2>());
  cls.def_property_readonly("isa", [](const Kernels& k) { return std::string(k.ops->isa); });
  bind(cls, "paged_decode", &kvcache::Ops::paged_decode);
  bind(cls, "paged_decode_quant", &kvcache::Ops::paged_decode_quant);
  bind(cls, "prefill_attention", &kvcache::Ops::prefill_attention);
  bind(cls, "pack_panels", &kvcache::Ops::pack_panels);
  bind(cls, "panel_linear", &kvcache::Ops::panel_linear);
  bind(cls, "code_panel_linear", &kvcache::Ops::code_panel_linear);
  bind(cls, "code_rows", &kvcache::Ops::code_rows);
  bind(cls, "gate_up_silu", &kvcache::Ops::gate_up_silu);
  bind(cls, "int8_linear", &kvcache::Ops::int8_linear);
  bind(cls, "int4_linear", &kvcache::Ops::int4_linear);
  bind(cls, "q8_linear", &kvcache::Ops::q8_linear);
  bind(cls, "has_int4", &kvcache::Ops::has_int4);
  bind(cls, "add_rms_norm", &kvcache::Ops::add_rms_norm);
  bind(cls, "rope_", &kvcache::Ops::rope_);
  bind(cls, "silu_mul", &kvcache::Ops::silu_mul);
  bind(cls, "attn_in", &kvcache::Ops::attn_in);
  bind(cls, "mlp", &kvcache::Ops::mlp);
  bind(cls, "decode_layers", &kvcache::Ops::decode_layers);
  bind(cls, "argmax_finite", &kvcache::Ops::argmax_finite);
}
