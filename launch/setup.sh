#!/usr/bin/env bash
# Idempotent setup for chameleon-dist on a machine with Python >= 3.11 and pip.
#  - creates .venv (sees the system's site-packages, so an installed torch, e.g. a CUDA build, is kept);
#  - installs the CPU build of torch only when no torch can be imported (never a multi-GB CUDA wheel);
#  - installs this package with its test extra (editable); skipped when pyproject.toml is unchanged.
# Everything is downloaded here, nothing at run time. Set PYTHON to choose the interpreter.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

log() { echo "[setup] $*" >&2; }

py="${PYTHON:-}"
if [ -z "$py" ]; then
  for cand in python3.11 python3 python; do
    if command -v "$cand" >/dev/null 2>&1; then py="$cand"; break; fi
  done
fi
[ -n "$py" ] || { log "no python found; set PYTHON=/path/to/python3.11"; exit 1; }
"$py" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' \
  || { log "$py is $("$py" -V 2>&1); chameleon-dist needs Python >= 3.11 (set PYTHON=...)"; exit 1; }

if [ ! -x .venv/bin/python ]; then
  log "creating .venv with $("$py" -V 2>&1)"
  "$py" -m venv --system-site-packages .venv
fi
vpy=.venv/bin/python
pipq() { "$vpy" -m pip install --disable-pip-version-check -q "$@"; }

torch_version="${CHAMELEON_TORCH_VERSION:-2.13.0}"
if "$vpy" -c 'import torch' >/dev/null 2>&1; then
  log "keeping installed torch $("$vpy" -c 'import torch; print(torch.__version__)')"
else
  log "no torch found: installing the CPU build torch==${torch_version}+cpu"
  # First from the configured indexes / local wheels; else from PyTorch's CPU index.
  pipq "torch==${torch_version}+cpu" 2>/dev/null \
    || pipq "torch==${torch_version}+cpu" --index-url https://download.pytorch.org/whl/cpu \
         --extra-index-url https://pypi.org/simple
fi

stamp=.venv/.chameleon-installed
want="$(cat pyproject.toml | "$vpy" -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$vpy" -c 'import chameleon_dist' >/dev/null 2>&1; then
  log "chameleon-dist already installed"
else
  log "installing chameleon-dist with test extras (DeepSpeed without compiled ops)"
  DS_BUILD_OPS=0 pipq -e ".[test]"
  echo "$want" > "$stamp"
fi
log "ready: $("$vpy" -c 'import torch, deepspeed, megatron.core as m; print(f"torch {torch.__version__}, deepspeed {deepspeed.__version__}, megatron-core {m.__version__}")' 2>/dev/null | tail -n 1)"
