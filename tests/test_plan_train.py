"""train.py with a plan: `--memory-budget-gb` (searched at start) and `--plan FILE`, on CPU."""
from __future__ import annotations

import re
import sys

import pytest

from coat_ds.train.engine_setup import read_ds_settings
from coat_ds.models.llama import Llama, model_config
from coat_ds.plan import Plan
from coat_ds.train.planning import plan_for_run
from coat_ds.train.config import parse_config
from helpers import run_in_repo

_BASE = [sys.executable, "train.py", "--fsdp", "--config", "configs/tiny.yaml", "--log-interval", "1",
         "--eval-batches", "1"]


@pytest.mark.slow
def test_train_py_memory_budget_plans_and_trains_two_steps():
    # tiny at micro-batch 8 x 64: all blocks kept peak near 9.4 MB, all FP8 near 4.6 MB.
    out = run_in_repo([*_BASE, "--max-steps", "2", "--memory-budget-gb", "0.007"], 300).stdout
    line = re.search(r"plan: 2 layers \(([^)]*)\), micro-batch 8 x 64, predicted peak ([\d.]+) GB", out)
    assert line, out[-3000:]
    assert "keep" not in line.group(1) or "," in line.group(1), line.group(0)  # not all kept: that would not fit
    assert float(line.group(2)) <= 0.007
    assert "blocks.0:" in out and "step 2/2" in out and "eval loss" in out
    assert "running the pick" in out and "to check its peak" in out  # measured before training on it


def test_plan_file_loaded_checked_against_the_model(tmp_path, capsys):
    path = tmp_path / "plan.json"
    plan = Plan((("blocks.0", "recompute"), ("blocks.1", "fp8")), 4, 64)
    plan.save(str(path))
    cfg = parse_config(["--fsdp", "--config", "configs/tiny.yaml", "--plan", str(path)])
    model = Llama(model_config("tiny"))
    assert plan_for_run(cfg, model, read_ds_settings(cfg.deepspeed, 1)) == plan
    assert "made for micro-batch 4 x 64; this run is 8 x 64" in capsys.readouterr().out
    Plan((("layers.0", "keep"),), 8, 64).save(str(path))
    with pytest.raises(SystemExit, match=r"--plan .*plan.json.*layers.0.*blocks.0"):
        plan_for_run(cfg, model, read_ds_settings(cfg.deepspeed, 1))
    path.write_text('{"layers": {"blocks.0": "bf16"}, "micro_batch": 8, "seq_len": 64}')
    with pytest.raises(SystemExit, match=r"--plan: .*layers\['blocks.0'\]: got 'bf16'"):
        plan_for_run(cfg, model, read_ds_settings(cfg.deepspeed, 1))


def test_plan_flags_conflicts_named():
    with pytest.raises(SystemExit, match="memory_budget_gb"):
        parse_config(["--plan", "p.json", "--memory-budget-gb", "1"])
    with pytest.raises(SystemExit, match="compress_activations"):
        parse_config(["--memory-budget-gb", "1", "--compress-activations"])
    with pytest.raises(SystemExit, match="memory_budget_gb"):
        parse_config(["--memory-budget-gb", "-1"])
    with pytest.raises(SystemExit, match="recompute_input_fp8.*off without a plan"):
        parse_config(["--recompute-input-fp8"])
    assert parse_config(["--plan", "p.json", "--recompute-input-fp8"]).recompute_input_fp8


@pytest.mark.slow
def test_plan_file_with_a_compile_budget_warns_without_compile(tmp_path):
    path = tmp_path / "plan.json"
    Plan((("blocks.0", "keep"), ("blocks.1", "fp8")), 8, 64, compile_memory_budget=0.5).save(str(path))
    out = run_in_repo([*_BASE, "--max-steps", "1", "--plan", str(path)], 300).stdout
    assert "torch.compile activation-memory budget 0.5" in out  # the plan's summary line
    assert "WARNING: the plan's torch.compile activation-memory budget (0.5) does nothing without compile" in out
    assert "step 1/1" in out
