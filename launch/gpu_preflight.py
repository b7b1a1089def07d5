"""The GPU check's preflight (``launch/gpu_check.py``): before any device time is spent, every module each part
needs is imported in a fresh interpreter (the one the parts run under), and a missing one fails the whole check
at once with one message naming the distributions to carry (``launch/gpu_wheels.sh`` fills ``.whl/`` with them).

A GPU image may hold some of these already (PyTorch, pytest, transformers); the check must not depend on which:
``PART_MODULES`` lists what each part imports, DeepSpeed's own imports included (DeepSpeed 0.19 imports einops,
msgpack, hjson, psutil, pydantic and tqdm on its training path; ninja only to build an op, py-cpuinfo only to
describe the CPU: both are carried with its other requirements). ``OPTIONAL_MODULES`` are reported, not required:
transformers and accelerate (no part trains through the Trainer; their versions and the Trainer callback's
records are recorded, so a GPU image's transformers is known to match ``integrations/hf/upstream.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

COMMON = ("torch", "numpy", "yaml", "packaging", "pydantic", "pydantic_core", "annotated_types", "typing_inspection",
          "chameleon_dist", "chameleon_dist.runtime")
DEEPSPEED_OWN = ("einops", "msgpack", "hjson", "psutil", "tqdm", "ninja", "cpuinfo")
"""DeepSpeed 0.19's requirements (``importlib.metadata.requires('deepspeed')``) other than torch, numpy,
packaging and pydantic, by import name."""


def gpu_test_files() -> list[str]:
    """The test files with ``gpu``-marked tests (what the ``gpu_tests`` parts run)."""
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_*.py")
                  if "pytest.mark.gpu" in p.read_text())


PART_MODULES: dict[str, tuple[str, ...]] = {
    "gpu_tests": (*COMMON, "pytest", "tests.conftest", *(f.removesuffix(".py").replace("/", ".") for f in gpu_test_files())),
    "probes": (*COMMON, "launch.bench.gpu_probes"),
    "megatron_2rank": (*COMMON, "megatron.core", "launch.train_megatron", "launch.bench.compare_reports"),
    "deepspeed_2rank": (*COMMON, *DEEPSPEED_OWN, "deepspeed", "deepspeed.runtime.zero.stage_1_and_2",
                        "launch.train_deepspeed", "launch.bench.compare_reports"),
    "bench_gpu": (*COMMON, "launch.bench.bench_gpu"),
}
PART_MODULES["gpu_tests_sanitized"] = (*PART_MODULES["gpu_tests"], "torch.cuda._sanitizer")
OPTIONAL_MODULES = ("transformers", "accelerate")
DISTRIBUTIONS = {"yaml": "PyYAML", "cpuinfo": "py-cpuinfo", "megatron": "megatron-core", "pydantic_core": "pydantic-core",
                 "annotated_types": "annotated-types", "typing_inspection": "typing-inspection"}
"""Import names whose distribution is named otherwise (the rest: the same name)."""
OWN_PACKAGES = ("chameleon_dist", "launch", "tests")

_PROBE = r"""
import importlib, json, sys, traceback
modules, optional = json.loads(sys.argv[1]), json.loads(sys.argv[2])
result = {"missing": {}, "failed": {}, "versions": {}, "optional": {}}
def attempt(name):
    try:
        importlib.import_module(name)
        return None
    except ModuleNotFoundError as exc:
        return ("missing", exc.name or name, str(exc))
    except Exception as exc:
        return ("failed", name, f"{type(exc).__name__}: {exc}")
for name in modules:
    problem = attempt(name)
    if problem is not None:
        kind, missing, text = problem
        result[kind][name] = {"module": missing, "error": text}
import importlib.metadata as md
for dist in ("torch", "deepspeed", "megatron-core", "pydantic", "pytest", "transformers", "accelerate"):
    try:
        result["versions"][dist] = md.version(dist)
    except md.PackageNotFoundError:
        result["versions"][dist] = None
for name in optional:
    problem = attempt(name)
    result["optional"][name] = "ok" if problem is None else problem[2]
if result["optional"].get("transformers") == "ok":
    try:
        from chameleon_dist.integrations.hf.upstream import verify_transformers
        import transformers.trainer  # noqa: F401
        verify_transformers()
        result["optional"]["hf_trainer_records"] = "ok"
    except Exception as exc:
        result["optional"]["hf_trainer_records"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(result))
"""


def distribution_of(module: str) -> str:
    top = module.split(".")[0]
    return DISTRIBUTIONS.get(top, top)


def preflight(parts: list[str], python: str = sys.executable, timeout_s: float = 180.0,
              part_modules: dict[str, tuple[str, ...]] | None = None) -> dict:
    """Import every module of ``parts`` in one fresh ``python``; ``ok`` false with ``message`` naming what to carry
    (or what failed to import for another reason) when any is missing."""
    table = PART_MODULES if part_modules is None else part_modules
    needed = list(dict.fromkeys(m for part in parts for m in table.get(part, ())))
    command = [python, "-c", _PROBE, json.dumps(needed), json.dumps(list(OPTIONAL_MODULES))]
    try:
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"ok": False, "message": f"preflight: importing the parts' modules took over {timeout_s:.0f} s",
                "modules": needed}
    if done.returncode != 0 or not done.stdout.strip():
        return {"ok": False, "message": f"preflight: the import probe failed: {(done.stdout + done.stderr)[-2000:]}",
                "modules": needed}
    found = json.loads(done.stdout.strip().splitlines()[-1])
    carry = sorted({distribution_of(v["module"]) for v in found["missing"].values()
                    if v["module"].split(".")[0] not in OWN_PACKAGES})
    by_part = {part: sorted({distribution_of(found["missing"][m]["module"]) for m in table.get(part, ())
                             if m in found["missing"]}) for part in parts}
    lines = []
    if carry:
        lines.append(f"missing distributions: {', '.join(carry)} (needed by "
                     f"{', '.join(p for p, names in by_part.items() if names)}): add them to launch/gpu_wheels.sh, "
                     "run it where there is a network, and carry .whl/ (launch/gpu_check.sh installs it first)")
    own = sorted(m for m, v in found["missing"].items() if v["module"].split(".")[0] in OWN_PACKAGES)
    if own:
        lines.append(f"this checkout's own modules are missing: {', '.join(own)} (run from the repository root)")
    if found["failed"]:
        lines.append("modules that failed to import: " + "; ".join(f"{m} ({v['error'][:300]})"
                                                                     for m, v in found["failed"].items()))
    return {"ok": not lines, "message": "preflight: " + " | ".join(lines) if lines else "preflight: every module imports",
            "carry": carry, "missing_by_part": by_part, "missing": found["missing"], "failed": found["failed"],
            "versions": found["versions"], "optional": found["optional"], "modules": needed}
