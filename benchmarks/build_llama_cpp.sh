#!/usr/bin/env bash
# Builds llama.cpp's llama-server and llama-quantize, the peer of
# benchmarks/cpu_compare.sh, and llama-perplexity, the peer of
# benchmarks/quality.py (benchmarks/llama_cpp_quality.sh), from the llama.cpp
# sources that the llama-cpp-python sdist on PyPI vendors (no other network
# source is needed):
#
#   bash benchmarks/build_llama_cpp.sh [DIR]        # default DIR: ~/.cache/sluice/llama.cpp
#   LLAMA_SERVER=DIR/bin/llama-server bash benchmarks/cpu_compare.sh
#   LLAMA_CPP=DIR/bin bash benchmarks/llama_cpp_quality.sh MODEL.gguf
#
# LLAMA_CPP_PYTHON_VERSION picks the sdist (default 0.3.36, the version of
# the figures in benchmarks/README.md). The build is for this CPU
# (GGML_NATIVE), static, without libcurl; needs cmake, ninja and a C++ compiler.
set -euo pipefail

dir=${1:-$HOME/.cache/sluice/llama.cpp}
version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
mkdir -p "$dir"
src=$dir/llama_cpp_python-$version
if [[ ! -d $src ]]; then
    python -m pip download --no-binary :all: --no-deps "llama-cpp-python==$version" -d "$dir"
    tar -xzf "$dir/llama_cpp_python-$version.tar.gz" -C "$dir"
fi
cmake -S "$src/vendor/llama.cpp" -B "$dir/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
tools=(llama-server llama-quantize llama-perplexity)
cmake --build "$dir/build" --target "${tools[@]}" -j "${JOBS:-$(nproc)}"
mkdir -p "$dir/bin"
for tool in "${tools[@]}"; do cp "$dir/build/bin/$tool" "$dir/bin/"; done
echo "built ${tools[*]} in $dir/bin"
