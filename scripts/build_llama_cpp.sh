#!/usr/bin/env bash
# Build llama.cpp's server (CPU only) from the llama.cpp that the llama-cpp-python source distribution on PyPI
# vendors, for the benchmarks' llama.cpp baseline. Cached: a second run only prints the path. About 20 minutes
# on 2 cores the first time. Prints the llama-server binary's path on its last line.
#   LLAMA_CPP_PYTHON_VERSION  the sdist to take (default 0.3.36)
#   KVCACHE_CACHE             where to build (default ~/.cache/kvcache)
set -euo pipefail
version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
root=${KVCACHE_CACHE:-$HOME/.cache/kvcache}/llama.cpp-$version
server=$root/build/bin/llama-server
if [ -x "$server" ]; then echo "$server"; exit 0; fi
python=${PYTHON:-python3}
mkdir -p "$root"
if [ ! -d "$root/src" ]; then
  tmp=$(mktemp -d)
  "$python" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$tmp" >&2
  tar -xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
  mv "$tmp"/llama_cpp_python-*/vendor/llama.cpp "$root/src"
  rm -rf "$tmp"
fi
command -v cmake >/dev/null || { echo "cmake is needed (apt-get install cmake, or pip install cmake)" >&2; exit 2; }
# -march=native, except on CPUs with AMX: ggml then compiles its AMX kernels, and where the hypervisor does not grant
# the process AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM) they die with SIGILL at the first matrix product (seen
# on a Sapphire Rapids VM). There the ISA options are named one by one from /proc/cpuinfo, AMX left out.
isa=(-DGGML_NATIVE=ON)
flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
has() { [[ " $flags " == *" $1 "* ]]; }
if has amx_tile; then
  isa=(-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
  for pair in avx:GGML_AVX avx2:GGML_AVX2 fma:GGML_FMA f16c:GGML_F16C bmi2:GGML_BMI2 avx_vnni:GGML_AVX_VNNI \
              avx512f:GGML_AVX512 avx512vbmi:GGML_AVX512_VBMI avx512_vnni:GGML_AVX512_VNNI avx512_bf16:GGML_AVX512_BF16; do
    has "${pair%%:*}" && isa+=("-D${pair#*:}=ON")
  done
fi
cmake -S "$root/src" -B "$root/build" -DCMAKE_BUILD_TYPE=Release "${isa[@]}" -DLLAMA_CURL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >&2
cmake --build "$root/build" --target llama-server -j "$(nproc)" >&2
echo "$server"
