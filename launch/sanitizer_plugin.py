"""A pytest plugin for the GPU check's sanitized pass (``-p launch.sanitizer_plugin``): writes to the file named by
``GPU_CHECK_SANITIZER_STATE`` whether PyTorch's CUDA stream sanitizer was on in the test process (it turns on at
``import torch`` when ``TORCH_CUDA_SANITIZER`` is set), so a pass that ran without it is not taken for one with it."""

from __future__ import annotations

import json
import os
from pathlib import Path


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("GPU_CHECK_SANITIZER_STATE")
    if path:
        from torch.cuda import _sanitizer

        Path(path).write_text(json.dumps({"enabled": bool(_sanitizer.cuda_sanitizer.enabled)}))
