#!/usr/bin/env bash
# The GPU check on a CUDA machine: launch/gpu_check.py (a preflight of every import, the gpu-marked tests plain
# and under the CUDA stream sanitizer, the probes, two-rank Megatron and DeepSpeed jobs with Chameleon,
# bench_gpu.py), one JSON under the folder given (default runs/gpu_check), in under 8 minutes on one GPU,
# installing the carried packages included.
#
#     bash launch/gpu_check.sh runs/gpu_check [launch.gpu_check options]
#
# Python: $GPU_CHECK_PYTHON when set, else .venv/bin/python when it exists and sees a GPU, else python3 (a GPU
# image's own PyTorch). Packages that image lacks (or holds older) come as wheels in .whl/ (launch/gpu_wheels.sh:
# Python 3.12, manylinux), installed into a private folder first (launch/carried_wheels.py picks them; DeepSpeed's
# source archive is built after them, against the carried setuptools); the project itself is used from this
# checkout. A module still missing then ends the check before any device time (the preflight names it).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${1:-runs/gpu_check}"
max_minutes="${GPU_CHECK_MAX_MINUTES:-8}"
python="${GPU_CHECK_PYTHON:-python3}"
if [ -z "${GPU_CHECK_PYTHON:-}" ] && [ -x .venv/bin/python ] \
   && .venv/bin/python -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  python=.venv/bin/python
fi
if compgen -G ".whl/*.whl" >/dev/null || compgen -G ".whl/*.tar.gz" >/dev/null; then
  site="$(mktemp -d)"
  pip_install=("$python" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir
               --target "$site")
  mapfile -t wheels < <("$python" -m launch.carried_wheels .whl wheels)
  mapfile -t sdists < <("$python" -m launch.carried_wheels .whl sdists)
  echo "[gpu_check] installing ${#wheels[@]} carried wheel(s) and ${#sdists[@]} source archive(s) into $site" >&2
  if [ "${#wheels[@]}" -gt 0 ]; then
    "${pip_install[@]}" "${wheels[@]}" || { echo "[gpu_check] installing .whl/ wheels failed" >&2; exit 2; }
  fi
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  if [ "${#sdists[@]}" -gt 0 ]; then  # (built with the carried setuptools, which PYTHONPATH now holds)
    "${pip_install[@]}" "${sdists[@]}" || { echo "[gpu_check] building .whl/ source archives failed" >&2; exit 2; }
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
left_minutes="$("$python" -c "import sys; print(f'{max(float(sys.argv[1]) - int(sys.argv[2]) / 60, 1.0):.2f}')" \
                "$max_minutes" "$SECONDS")"  # (the install's time comes out of the time box)
exec "$python" -m launch.gpu_check --out "$out" --max-minutes "$left_minutes" "${@:2}"
