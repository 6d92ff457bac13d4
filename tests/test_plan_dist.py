"""A mixed plan applied by train.py under the engines it is meant for, 2 CPU ranks over gloo:
FSDP2 (torchrun) and DeepSpeed ZeRO-1, -2 and -3 (the deepspeed launcher). Each run is compared with
the same run without a plan: same data, same initial weights, so the losses may differ only
by FP8 rounding (one block's linears in FP8) and not at all through recomputation."""
from __future__ import annotations

import math
import os
import sys

import pytest

from coat_ds.plan import Plan
from helpers import free_port, read_metrics, run_in_repo

BIN = os.path.dirname(sys.executable)
_TRAIN = ["train.py", "--config", "configs/tiny.yaml", "--max-steps", "4", "--log-interval", "1",
          "--eval-interval", "0", "--eval-batches", "1"]
_LAUNCH = {
    "fsdp2": lambda: [os.path.join(BIN, "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()),
                      *_TRAIN, "--fsdp", "--deepspeed", "ds_configs/coat_zero2.json"],
}
for _stage in (1, 2, 3):
    _LAUNCH[f"zero{_stage}"] = lambda stage=_stage: [
        os.path.join(BIN, "deepspeed"), "--num_accelerators", "2", "--master_port", str(free_port()),
        *_TRAIN, "--deepspeed", f"ds_configs/coat_zero{stage}.json"]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["fsdp2", "zero1", "zero2", "zero3"])
def test_mixed_plan_trains_like_no_plan(tmp_path, engine):
    launcher = _LAUNCH[engine]()
    if not os.path.exists(launcher[0]):
        pytest.skip(f"{os.path.basename(launcher[0])} not installed")
    plan = tmp_path / "plan.json"
    Plan((("blocks.0", "recompute"), ("blocks.1", "fp8_linear")), 8, 64).save(str(plan))
    losses = {}
    for name, flags in (("plain", ()), ("plan", ("--plan", str(plan)))):
        metrics = tmp_path / f"{name}.jsonl"
        out = run_in_repo([*launcher, *flags, "--metrics-file", str(metrics)], 300, DS_ACCELERATOR="cpu").stdout
        assert "step 4/4 (100%)" in out
        losses[name] = {s: m["loss"] for s, m in read_metrics(metrics).items()}
    assert "blocks.0: recompute" in out and "blocks.1: fp8_linear" in out
    for step in range(1, 5):
        assert math.isfinite(losses["plan"][step])
        assert losses["plan"][step] == pytest.approx(losses["plain"][step], rel=0.01), (step, losses)
