#!/usr/bin/env bash
# Fills .whl/ (git-ignored) with what a GPU image that has PyTorch but not our other dependencies needs to run
# launch/gpu_check.sh: the versions this checkout's .venv holds, as Python 3.12 manylinux wheels (DeepSpeed
# ships only a source archive: it is built there without network, with its CUDA ops left to JIT).
#
#     bash launch/gpu_wheels.sh            # here, once; then carry .whl to the GPU machine
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python_version="${GPU_PYTHON_VERSION:-3.12}"
mkdir -p .whl
version() { .venv/bin/python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
wheels=()
for name in pydantic pydantic_core annotated-types typing-inspection hjson megatron-core; do
  wheels+=("$name==$(version "$name")")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$python_version" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "${wheels[@]}"
python3 -m pip download -q --no-deps --no-binary=:all: -d .whl "deepspeed==$(version deepspeed)"
ls -1 .whl
