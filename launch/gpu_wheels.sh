#!/usr/bin/env bash
# Fills .whl/ (git-ignored) with what a GPU image that has PyTorch but not our other dependencies needs to run
# launch/gpu_check.sh: the versions this checkout's .venv holds, as Python 3.12 manylinux wheels (DeepSpeed
# ships only a source archive: it is built there without network, with its CUDA ops left to JIT, against the
# setuptools carried here).
#
#     bash launch/gpu_wheels.sh            # here, once; then carry .whl to the GPU machine
#
# The list is every distribution a part of the check imports that PyTorch does not bring (launch/gpu_preflight.py
# imports them all there before any device time is spent, and names what is missing): chameleon-dist's own
# (pydantic and its parts, PyYAML, packaging, numpy), megatron-core, DeepSpeed's requirements (einops, hjson,
# msgpack, ninja, psutil, py-cpuinfo, tqdm; tests/test_gpu_check.py checks them against DeepSpeed's metadata)
# and setuptools to build DeepSpeed. gpu_check.sh installs a carried wheel only where the image lacks that
# distribution or has an older one, so an image's own packages are not shadowed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python_version="${GPU_PYTHON_VERSION:-3.12}"
mkdir -p .whl
version() { .venv/bin/python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
wheels=()
for name in pydantic pydantic_core annotated-types typing-inspection typing_extensions PyYAML packaging numpy \
            megatron-core einops hjson msgpack ninja psutil py-cpuinfo tqdm setuptools; do
  wheels+=("$name==$(version "$name")")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$python_version" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
  --platform manylinux1_x86_64 -d .whl "${wheels[@]}"
python3 -m pip download -q --no-deps --no-binary=:all: -d .whl "deepspeed==$(version deepspeed)"
ls -1 .whl
