#!/usr/bin/env bash
# On the development machine: fill the ignored folder .gpucarry/ (repository root) with what the GPU machine
# lacks — the llama.cpp source, the gguf and platformdirs wheels, the commit being measured — so that a device
# call carrying .gpucarry can run `bash packaging/gpu_sidebyside/driver.sh start`.
#   LLAMA_TARBALL=path/to/llama.cpp-0c1e57098-trim.tar.gz bash packaging/gpu_sidebyside/prepare.sh
set -euo pipefail
ROOT=$(git rev-parse --show-toplevel)
C=$ROOT/.gpucarry
mkdir -p "$C/whl"
grep -qx '/.gpucarry/' "$ROOT/.git/info/exclude" 2>/dev/null || echo '/.gpucarry/' >> "$ROOT/.git/info/exclude"
TAR=${LLAMA_TARBALL:-$ROOT/../shared/tools/gpu-sidebyside/llama.cpp-0c1e57098-trim.tar.gz}
[ -e "$C/llama.cpp.tar.gz" ] || cp "$TAR" "$C/llama.cpp.tar.gz"
if ! ls "$C"/whl/gguf-*.whl "$C"/whl/platformdirs-*.whl > /dev/null 2>&1; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
    -d "$C/whl" gguf==0.19.0 platformdirs
fi
echo "$(git -C "$ROOT" rev-parse --short HEAD)$(git -C "$ROOT" diff --quiet HEAD || echo +dirty)" > "$C/commit.txt"
echo "ready: $(ls "$C") (commit $(cat "$C/commit.txt"))"
