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
cmake -S "$root/src" -B "$root/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >&2
cmake --build "$root/build" --target llama-server -j "$(nproc)" >&2
echo "$server"
