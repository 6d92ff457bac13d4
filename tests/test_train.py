"""End to end: `deepspeed train.py --deepspeed ds_configs/coat_zero2.json` on the tiny preset,
2 CPU ranks, then a resume from its mid-run checkpoint that must reproduce the same losses."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from helpers import free_port, read_metrics, run_in_repo

DEEPSPEED = os.path.join(os.path.dirname(sys.executable), "deepspeed")


def _run(tmp_path, *flags) -> subprocess.CompletedProcess:
    cmd = [DEEPSPEED, "--num_accelerators", "2", "--master_port", str(free_port()), "train.py",
           "--deepspeed", "ds_configs/coat_zero2.json", "--config", "configs/tiny.yaml",
           "--max-steps", "12", "--log-interval", "2", "--eval-interval", "6", "--save-interval", "6", *flags]
    return run_in_repo(cmd, 300, DS_ACCELERATOR="cpu")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(DEEPSPEED), reason="deepspeed launcher not installed")
def test_train_py_coat_zero2_smoke_and_resume(tmp_path):
    save = tmp_path / "ckpt"
    full = _run(tmp_path, "--save-dir", str(save), "--metrics-file", str(tmp_path / "full.jsonl"))
    out = full.stdout
    assert "resolved config:" in out and "preset: tiny" in out
    assert "bytes/param" in out and "saves" in out  # start-up optimizer-state report
    assert "tok/s" in out and "peak mem" in out and "eval loss" in out and "step 12/12 (100%)" in out
    ref = read_metrics(tmp_path / "full.jsonl")
    assert ref[12]["loss"] < ref[2]["loss"] - 0.2
    assert "eval_loss" in ref[6] and "eval_loss" in ref[12]
    assert (save / "step6").is_dir() and (save / "step12").is_dir()

    # Resume a copy of the step-6 checkpoint in a new process: steps 7..12 must match bit for bit.
    shutil.copytree(save / "step6", tmp_path / "resume" / "step6")
    resumed = _run(tmp_path, "--resume", str(tmp_path / "resume" / "step6"),
                   "--metrics-file", str(tmp_path / "resumed.jsonl"))
    assert "resumed from" in resumed.stdout and "at step 6" in resumed.stdout
    got = read_metrics(tmp_path / "resumed.jsonl")
    assert sorted(k for k, m in got.items() if "loss" in m) == [8, 10, 12]
    assert got[7]["optimizer_state_gb"] == ref[1]["optimizer_state_gb"] > 0
    for step in (8, 10, 12):
        assert got[step]["loss"] == ref[step]["loss"], (step, got[step], ref[step])
    assert got[12]["eval_loss"] == ref[12]["eval_loss"]
