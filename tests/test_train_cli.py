"""The main job, as a user runs it: out of memory without Chameleon, trains with it, bit-identical."""

import contextlib
import io
import json

import pytest

from chameleon_dist.cli import train
from chameleon_dist.schema_version import SCHEMA_VERSION

MiB = 2**20
# warm-up 2 + one policy trial: iteration 4 is the first Stable one, under the chosen policy
SHORT_JOB = "chameleon:\n  profiler:\n    warmup_iterations: 2\n    policy_trials: 1\n"


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("train")
    job = tmp_path / "job.yaml"
    job.write_text(SHORT_JOB)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = train.main(["--config", str(job), "--iterations", "4", "--run-dir", str(tmp_path / "runs")])
    (run_dir,) = (tmp_path / "runs").iterdir()
    return code, out.getvalue(), run_dir, json.loads((run_dir / "report.json").read_text())


@pytest.mark.slow
def test_chameleon_train_shows_the_contrast(short_run):
    code, out, run_dir, report = short_run
    assert code == 0, out
    assert "EMULATED device" in out
    assert "OUT OF MEMORY in iteration 1 at aten." in out
    assert "bit-identical to the reference: yes (losses 4/4 torch.equal" in out
    assert report["emulated"] is True and report["parity"]["bit_identical"] is True
    assert list(report)[0] == "schema_version" and report["schema_version"] == SCHEMA_VERSION
    assert all(row["schema_version"] == SCHEMA_VERSION for row in report["runs"]["with"]["iterations"])
    assert report["runs"]["without"]["out_of_memory"]["iteration"] == 1
    runs = report["runs"]
    capacity = report["device"]["capacity_bytes"]
    assert runs["reference"]["peak_device_bytes"] > capacity >= runs["with"]["peak_device_bytes"]
    assert runs["with"]["iterations"][0]["swap_out_bytes"] > 0
    assert (run_dir / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_the_plot_shows_a_stable_iteration_under_the_policy_on_the_models_own_ops(short_run):
    _, out, _, report = short_run
    curves = {curve["run"] + "/" + curve["stage"]: curve for curve in report["plot"]["curves"]}
    assert set(curves) == {"reference/stable", "with/stable", "with/warmup"}, list(curves)
    for curve in curves.values():
        ran = report["runs"][curve["run"]]["iterations"][curve["iteration"] - 1]
        assert ran["iteration"] == curve["iteration"] and ran["stage"] == curve["stage"]
        assert curve["policy"] == ran["policy"]
        # the legend's peak is the plotted curve's maximum
        assert curve["peak_bytes"] == max(curve["samples_bytes"])
        assert f"peak {curve['peak_bytes'] / MiB:.1f} MiB" in curve["label"]
        # one sample per op of the model: at most the signature's ops (detach, a view, is not sampled)
        assert 0 < len(curve["samples_bytes"]) <= ran["num_ops"]
    stable = curves["with/stable"]
    assert stable["policy"] != "", "the plotted iteration runs under the chosen policy"
    assert stable["iteration"] == 4
    lengths = {len(curve["samples_bytes"]) for curve in curves.values()}
    assert len(lengths) == 1, "every curve has one sample per model op: the same x axis"
    assert stable["peak_bytes"] < curves["reference/stable"]["peak_bytes"]


def test_bad_job_config_names_the_field(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text("train:\n  iteratons: 3\nchameleon:\n  device:\n    capacity: lots\n")
    assert train.main(["--config", str(job), "--run-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "train.iteratons" in err and "iterations" in err
    assert "chameleon.device.capacity" in err
    assert not any(tmp_path.glob("chameleon-train-*")), "no run folder for a job that never started"
