"""Every file under configs/ loads with the loader its folder stands for."""

from pathlib import Path

import pytest

from chameleon_dist.config import ChameleonConfig, load_config
from chameleon_dist.planner import HardwareProfile, ModelProfile, load_hardware, load_model
from chameleon_dist.planner.cluster import ClusterProfile, load_cluster

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _load_job(path):
    from chameleon_dist.cli.train_job import TrainJob, load_job

    job = load_job(path)
    assert isinstance(job, TrainJob)
    return job.chameleon


LOADERS = {
    "chameleon": load_config,
    "deepspeed": ChameleonConfig.from_deepspeed_config,
    "jobs": _load_job,
    "models": load_model,
    "hardware": load_hardware,
    "clusters": load_cluster,
}
# Planner profiles are not Chameleon configs: each folder's loader must return its own type.
PROFILE_TYPES = {"models": ModelProfile, "hardware": HardwareProfile, "clusters": ClusterProfile}

FILES = sorted(p for p in CONFIGS.rglob("*") if p.is_file())


def test_every_config_folder_has_a_loader():
    folders = {p.relative_to(CONFIGS).parts[0] for p in FILES}
    assert folders <= set(LOADERS), f"add a loader for {folders - set(LOADERS)} in this test"
    assert len(FILES) >= 5


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_config_file_loads(path):
    folder = path.relative_to(CONFIGS).parts[0]
    config = LOADERS[folder](path)
    if folder in PROFILE_TYPES:
        assert isinstance(config, PROFILE_TYPES[folder]) and config.name == path.stem
        return
    assert isinstance(config, ChameleonConfig)
    assert config.enabled

