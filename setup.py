"""Builds kvcache's C++ CPU kernels (csrc/) when the package is installed, as PyTorch extension modules:

- `kvcache._native._C`: the bindings (csrc/bindings.cpp), for the target's baseline;
- `kvcache._native._C_<isa>`: every kernel source, once per instruction-set variant (x86-64: `avx512` = x86-64-v4
  with VNNI, `avx2` = x86-64-v3, and `scalar` = the baseline; elsewhere `scalar` only). kvcache.native imports the
  variant the CPU runs (`KVCACHE_CPU_ISA` forces one).

torch must be importable while building (its headers and libraries): install torch first, then this package with
`pip install --no-build-isolation -e .` (the Makefile does). Without torch or a C++ compiler the package installs
without the kernels and says why; kvcache then runs on PyTorch's ops and says so once. An install in place (editable,
or `python setup.py build_ext --inplace`) keeps one build per Python environment (kvcache/_native/env_<hash>/), so
that two environments sharing a checkout never load, or rebuild over, each other's. Each build writes a manifest
(kvcache/native/manifest.py) that kvcache.native checks before loading. KVCACHE_BUILD_KERNELS=0 skips the build.
"""
from __future__ import annotations

import copy
import glob
import importlib.util
import os
import platform
import shlex
import shutil
import sys
import sysconfig

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
COMMON_FLAGS = ["-O3", "-g0", "-std=c++20", "-fopenmp", "-fvisibility=hidden", "-fvisibility-inlines-hidden"]
# the attention sources assume finite floats and contract a * b + c into FMAs; the rest rounds as written (the
# linear kernels give the same floats on every variant)
FAST_MATH = ("csrc/attention/", ["-ffast-math"])
LINK_FLAGS = ["-fopenmp", "-Wl,-Bsymbolic-functions"]


def isa_variants() -> dict[str, list[str]]:
    """Each variant's compile flags, for this target."""
    if platform.machine().lower() in ("x86_64", "amd64"):
        return {"avx512": ["-march=x86-64-v4", "-mavx512vnni", "-mtune=generic"],
                "avx2": ["-march=x86-64-v3", "-mtune=generic"],
                "scalar": ["-mtune=generic"]}
    return {"scalar": []}


def load_manifest():
    spec = importlib.util.spec_from_file_location("kvcache_native_manifest",
                                                  os.path.join(ROOT, "kvcache", "native", "manifest.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def why_not_build() -> str | None:
    """Why the kernels cannot be built here, or None."""
    if os.environ.get("KVCACHE_BUILD_KERNELS", "1") == "0":
        return "KVCACHE_BUILD_KERNELS=0"
    try:
        import torch  # noqa: F401
    except ImportError:
        return ("torch is not importable in the build environment (pip's build isolation hides the installed one): "
                "install torch first, then `pip install --no-build-isolation -e .`")
    cxx = shlex.split(os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++")[0]
    if shutil.which(cxx) is None:
        return (f"no C++ compiler ({cxx!r} is not on PATH): install one (Debian/Ubuntu: apt-get install g++; "
                "Fedora: dnf install gcc-c++; macOS: xcode-select --install), then reinstall kvcache")
    return None


def kernel_sources() -> list[str]:
    found = sorted(glob.glob("csrc/**/*.cpp", root_dir=ROOT, recursive=True))
    return [s for s in found if s != "csrc/bindings.cpp"]


def build_ext_class(base):
    manifest = load_manifest()

    class BuildKernels(base):
        """torch's BuildExtension, with every extension's sources compiled at once on all cores (the variants
        compile the same sources: objects apart per extension; a source whose object is newer than it and every
        header is not compiled again), -ffast-math for the attention sources, an environment's own directory for a
        build in place, modules put in place by a rename, and a manifest beside them."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, use_ninja=False, **kwargs)  # one compiler per source, in parallel below
            self._objects: dict[str, list[str]] | None = None

        @property
        def in_place(self) -> bool:
            """An editable install or `build_ext --inplace`: the modules go to this environment's own directory."""
            return bool(self.inplace or getattr(self, "editable_mode", False))

        def finalize_options(self) -> None:
            super().finalize_options()
            self.force = True  # always link: _compile_all decides what to compile again
            if self.in_place:
                key = manifest.env_key()
                for ext in self.extensions:
                    if ext.name.startswith("kvcache._native.") and ext.name.count(".") == 2:
                        ext.name = ext.name.replace("kvcache._native.", f"kvcache._native.{key}.", 1)

        def _compile_all(self) -> dict[str, list[str]]:
            """Every extension's objects, compiled in parallel (MAX_JOBS or one job a core), the longest first."""
            from concurrent.futures import ThreadPoolExecutor
            headers = [os.path.join(ROOT, h) for h in glob.glob("csrc/**/*.h", root_dir=ROOT, recursive=True)]
            newest_header = max([os.path.getmtime(h) for h in headers] + [os.path.getmtime(__file__)])
            jobs = []
            for ext in self.extensions:
                out = os.path.join(self.build_temp, ext.name.rsplit(".", 1)[-1])
                for src in ext.sources:
                    prefix, extra = FAST_MATH
                    jobs.append((ext, src, out, [*ext.extra_compile_args, *(extra if src.startswith(prefix) else [])]))
            jobs.sort(key=lambda j: -os.path.getsize(os.path.join(ROOT, j[1])))

            def compile_one(job) -> str:
                ext, src, out, flags = job
                obj = self.compiler.object_filenames([src], output_dir=out)[0]
                if os.path.exists(obj) and os.path.getmtime(obj) > max(newest_header, os.path.getmtime(src)):
                    return obj
                return self.compiler.compile([src], output_dir=out, macros=ext.define_macros,
                                             include_dirs=ext.include_dirs, extra_postargs=flags)[0]
            workers = int(os.environ.get("MAX_JOBS") or os.cpu_count() or 1)
            with ThreadPoolExecutor(workers) as pool:
                objects = list(pool.map(compile_one, jobs))
            done: dict[str, list[str]] = {}
            for (ext, *_), obj in zip(jobs, objects):
                done.setdefault(ext.name, []).append(obj)
            return done

        def build_extension(self, ext) -> None:
            if self._objects is None:
                self._objects = self._compile_all()
            ext = copy.copy(ext)
            ext.extra_objects = [*(ext.extra_objects or []), *self._objects[ext.name]]
            ext.sources = []  # compiled above: this links
            super().build_extension(ext)

        def copy_extensions_to_source(self) -> None:
            """Each module into its place by a rename: a process that has the old one loaded keeps its pages (a copy
            over it would truncate what that process has mapped)."""
            build_py = self.get_finalized_command("build_py")
            for ext in self.extensions:
                inplace_file, regular_file = self._get_inplace_equivalent(build_py, ext)
                os.makedirs(os.path.dirname(inplace_file), exist_ok=True)  # an environment's first build
                tmp = f"{inplace_file}.{os.getpid()}.tmp"
                shutil.copyfile(regular_file, tmp)
                shutil.copymode(regular_file, tmp)
                os.replace(tmp, inplace_file)

        def run(self) -> None:
            super().run()
            import torch
            digest = manifest.sources_digest(ROOT)
            places: dict[str, dict[str, str]] = {}  # directory -> module -> file: the build's, and its copy in place
            for ext in self.extensions:
                for inplace in (False, True):
                    saved, self.inplace = self.inplace, inplace
                    path = self.get_ext_fullpath(ext.name)
                    self.inplace = saved
                    if os.path.exists(path):
                        places.setdefault(os.path.dirname(path), {})[ext.name.rsplit(".", 1)[-1]] = \
                            os.path.basename(path)
            for directory, modules in places.items():
                written = manifest.write(directory, torch.__version__, digest, modules,
                                         {"common": COMMON_FLAGS, "variants": isa_variants()})
                print(f"kvcache: built the C++ kernels ({', '.join(sorted(modules))}) into {directory}; "
                      f"manifest {written}", file=sys.stderr)
            if self.in_place:  # the build directory's copies would ride along in a later wheel of this checkout
                shutil.rmtree(os.path.join(self.build_lib, "kvcache", "_native", manifest.env_key()),
                              ignore_errors=True)

    return BuildKernels


def extensions() -> tuple[list, dict]:
    reason = why_not_build()
    if reason is not None:
        print(f"kvcache: NOT building the C++ CPU kernels: {reason}. kvcache will run on PyTorch's ops (slower) and "
              "say so at start-up.", file=sys.stderr)
        return [], {}
    from torch.utils.cpp_extension import BuildExtension, CppExtension
    exts = [CppExtension("kvcache._native._C", ["csrc/bindings.cpp"], extra_compile_args=COMMON_FLAGS,
                         extra_link_args=LINK_FLAGS)]
    for isa, flags in isa_variants().items():
        exts.append(CppExtension(f"kvcache._native._C_{isa}", kernel_sources(),
                                 extra_compile_args=[*COMMON_FLAGS, *flags], extra_link_args=LINK_FLAGS,
                                 depends=sorted(glob.glob("csrc/**/*.h", root_dir=ROOT, recursive=True))))
    return exts, {"build_ext": build_ext_class(BuildExtension)}


if __name__ == "__main__":  # as pip's build backend and `python setup.py` run it (a test imports its functions)
    ext_modules, cmdclass = extensions()
    setup(ext_modules=ext_modules, cmdclass=cmdclass)
