"""The main job, as a user runs it: out of memory without Chameleon, trains with it, bit-identical."""

import json

import pytest

from chameleon_dist.cli import train


@pytest.mark.slow
def test_chameleon_train_shows_the_contrast(tmp_path, capsys):
    code = train.main(["--iterations", "3", "--run-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "EMULATED device" in out
    assert "OUT OF MEMORY in iteration 1 at aten." in out
    assert "bit-identical to the reference: yes (losses 3/3 torch.equal" in out
    (run_dir,) = tmp_path.iterdir()
    report = json.loads((run_dir / "report.json").read_text())
    assert report["emulated"] is True and report["parity"]["bit_identical"] is True
    assert report["runs"]["without"]["out_of_memory"]["iteration"] == 1
    runs = report["runs"]
    capacity = report["device"]["capacity_bytes"]
    assert runs["reference"]["peak_device_bytes"] > capacity >= runs["with"]["peak_device_bytes"]
    assert runs["with"]["iterations"][0]["swap_out_bytes"] > 0
    assert (run_dir / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_job_config_names_the_field(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text("train:\n  iteratons: 3\nchameleon:\n  device:\n    capacity: lots\n")
    assert train.main(["--config", str(job), "--run-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "train.iteratons" in err and "iterations" in err
    assert "chameleon.device.capacity" in err
    assert not any(tmp_path.glob("chameleon-train-*")), "no run folder for a job that never started"
