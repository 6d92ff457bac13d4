"""`python -m coat_ds.profile` as a new user meets it: started outside the source tree, without
--budget-gb on a CPU, reading the table from --out, looking at the chart."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import ROOT

from coat_ds.profile import SideMeasurement, parse_options
from coat_ds.profile.report import chart_stacks
from coat_ds.config.shipped import resolve_ds_config


@pytest.fixture(scope="module")
def outside(tmp_path_factory):
    """A real (tiny) profile run started in a directory that is not the repository."""
    cwd = tmp_path_factory.mktemp("elsewhere")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "coat_ds.profile", "--model", "tiny", "--seq-len", "16", "--budget-gb", "0.02",
           "--throughput-steps", "0", "--in-process", "--out", "out"]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return cwd / "out", proc


@pytest.mark.slow
def test_runs_outside_the_repo_and_writes_the_table(outside):
    out, proc = outside
    result = json.loads((out / "profile.json").read_text())
    assert os.path.samefile(result["sides"]["coat"]["config"], os.path.join(ROOT, "ds_configs", "coat_zero2.json"))
    table = (out / "profile.md").read_text()
    assert table == result["markdown"] + "\n"
    assert table.strip() in proc.stdout
    assert (out / "profile.png").stat().st_size > 0


@pytest.mark.slow
def test_chart_draws_each_side_at_its_own_max_batch(outside):
    out, _ = outside
    result = json.loads((out / "profile.json").read_text())
    label, (base_gb, coat_gb) = chart_stacks(result)[-1]
    assert "max micro-batch" in label
    maxes = {n: result["sides"][n]["max_micro_batch"] for n in ("baseline", "coat")}
    assert maxes["coat"] > maxes["baseline"]  # the budget is chosen so that they differ
    for name, gb in (("baseline", base_gb), ("coat", coat_gb)):
        m = SideMeasurement.from_dict(result["sides"][name]["ranks"][0])
        assert gb == pytest.approx(m.activations_at(maxes[name]) / 1e9, rel=1e-12)
    coat = SideMeasurement.from_dict(result["sides"]["coat"]["ranks"][0])
    assert coat_gb > coat.activations_at(maxes["baseline"]) / 1e9 * 1.5


@pytest.mark.skipif(torch.cuda.is_available(), reason="--budget-gb is optional on a GPU")
def test_missing_budget_on_cpu_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_options(["--model", "tiny"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m coat_ds.profile") and "--budget-gb is required" in err


def test_bad_config_is_a_usage_error_naming_it(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_options(["--model", "tiny", "--budget-gb", "1", "--config", "ds_configs/no_such.json"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--config: no such file 'ds_configs/no_such.json'" in err and "usage:" in err


def test_shipped_configs_resolve_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    found = resolve_ds_config("ds_configs/bf16_zero3.json")
    assert os.path.isabs(found)
    with open(found) as a, open(os.path.join(ROOT, "ds_configs", "bf16_zero3.json")) as b:
        assert a.read() == b.read()
    (tmp_path / "ds_configs").mkdir()
    (tmp_path / "ds_configs" / "bf16_zero3.json").write_text("{}")
    assert resolve_ds_config("ds_configs/bf16_zero3.json") == "ds_configs/bf16_zero3.json"  # the user's own wins
    assert resolve_ds_config("other/coat_zero2.json") == "other/coat_zero2.json"
