#!/usr/bin/env bash
# The quick tier (pytest --quick: a test of every module) on another PyTorch release, in a virtual environment of its own
# (.venv-torch<version>/, git-ignored; .venv is never touched): the check that a torch the package accepts really
# runs it. The registry's Linux torch is a CUDA build with its nvidia-* wheels (several GB), so this stays out of
# the default CI run; where PyTorch's CPU index is reachable, TORCH_INDEX_URL takes the CPU build (~200 MB).
#
#     bash launch/torch_quick_tier.sh 2.11                          # torch==2.11.*, then the quick tier
#     TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu bash launch/torch_quick_tier.sh 2.11
#     EXTRA_PACKAGES="transformers==5.17.0 accelerate==1.15.*" bash launch/torch_quick_tier.sh 2.11  # the GPU image's
#     bash launch/torch_quick_tier.sh 2.11 tests/test_hf_trainer.py -x   # arguments after the version go to pytest
#
# PYTHON picks the interpreter the environment is made from (default python3). The package's torch floor
# (pyproject.toml, torch>=2.11: the GPU image's release, the oldest the code ran on) goes lower only after this
# passes on the lower release (e.g. bash launch/torch_quick_tier.sh 2.6).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
version="${1:?give the torch release to test, e.g.: bash launch/torch_quick_tier.sh 2.11}"
venv=".venv-torch$version"
python="${PYTHON:-python3}"
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
install=("$venv/bin/python" -m pip install -q)
"${install[@]}" --upgrade pip setuptools wheel
if [ -n "${TORCH_INDEX_URL:-}" ]; then
  "${install[@]}" --index-url "$TORCH_INDEX_URL" "torch==$version.*"
else
  "${install[@]}" "torch==$version.*"
fi
# DeepSpeed builds from its source archive against the torch above (no build isolation: it would fetch another)
# shellcheck disable=SC2086
"${install[@]}" --no-build-isolation -e ".[test]" ${EXTRA_PACKAGES:-} "torch==$version.*"
"$venv/bin/python" -c "import torch; print(f'[torch_quick_tier] torch {torch.__version__} (CUDA build: {torch.version.cuda})')"
exec "$venv/bin/python" -m pytest -q --quick -p no:cacheprovider "${@:2}"
