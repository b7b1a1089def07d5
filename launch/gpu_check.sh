#!/usr/bin/env bash
# The GPU check on a CUDA machine: launch/gpu_check.py (gpu-marked tests, two-rank Megatron and DeepSpeed jobs
# with Chameleon, bench_gpu.py), one JSON under the folder given (default runs/gpu_check), in under 8 minutes
# on one GPU.
#
#     bash launch/gpu_check.sh runs/gpu_check
#
# Python: .venv/bin/python when it exists and sees a GPU, else python3 (a GPU image's own PyTorch). Packages
# that image lacks (pydantic, megatron-core, deepspeed, ...) can come as wheels in .whl/ (Python 3.12,
# manylinux), installed into a private folder first; the project itself is used from this checkout.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${1:-runs/gpu_check}"
python=python3
if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  python=.venv/bin/python
fi
if compgen -G ".whl/*.whl" >/dev/null || compgen -G ".whl/*.tar.gz" >/dev/null; then
  site="$(mktemp -d)"
  "$python" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --target "$site" .whl/* \
    || { echo "[gpu_check] installing .whl/ failed" >&2; exit 2; }
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$python" -m launch.gpu_check --out "$out" "${@:2}"
