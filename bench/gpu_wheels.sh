#!/usr/bin/env bash
# The wheels bench/gpu.sh needs on a GPU machine without a package registry (Python 3.12, x86-64,
# torch and transformers already there) beyond the project's core dependencies: TRL and datasets
# for vs_trl, the openai client and the ASGI stack for gateway, py-spy for profiling by hand.
# Versions as constraints-cpu.txt pins them. Run here, where pip reaches a registry:
#
#   bash bench/gpu_wheels.sh [DIR]        # default DIR: .gpu-kit/whl
#
# then, on the GPU machine: python3 -m pip install --no-index --no-deps --target SITE DIR/*.whl
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.gpu-kit/whl}
mkdir -p "$DIR"
PACKAGES="trl datasets dill multiprocess xxhash openai httpx2 httpcore2 jiter distro sniffio truststore
          starlette uvicorn httptools uvloop hiredis"
pins=()
for name in $PACKAGES; do
  pin=$(grep -i "^${name}==" constraints-cpu.txt || true)
  [ -n "$pin" ] || { echo "constraints-cpu.txt pins no $name" >&2; exit 2; }
  pins+=("$pin")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d "$DIR" "${pins[@]}" py-spy==0.4.1 2> >(grep -v "^WARNING: Location" >&2)
ls "$DIR"
