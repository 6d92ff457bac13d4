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


@pytest.mark.slow
def test_recomputed_from_fp8_inputs_under_fsdp2_eager_compiled_and_in_backward(tmp_path):
    """Every block recomputed from FP8 inputs under FSDP2 on 2 ranks: eagerly, with compiled
    blocks (compile_layer), and with the optimizer step in backward (the 7B fit's setting),
    each within 1% of the run without a plan."""
    launcher = _LAUNCH["fsdp2"]()
    if not os.path.exists(launcher[0]):
        pytest.skip("torchrun not installed")
    plan = tmp_path / "plan.json"
    Plan((("blocks.0", "recompute"), ("blocks.1", "recompute")), 8, 64).save(str(plan))
    fp8 = ("--plan", str(plan), "--recompute-input-fp8")
    runs = {"plain": (), "fp8": fp8, "compiled": (*fp8, "--compile"), "in_backward": (*fp8, "--step-in-backward")}
    losses = {}
    for name, flags in runs.items():
        metrics = tmp_path / f"{name}.jsonl"
        out = run_in_repo([*launcher, *flags, "--metrics-file", str(metrics)], 400, DS_ACCELERATOR="cpu").stdout
        assert "step 4/4 (100%)" in out, (name, out[-2000:])
        losses[name] = {s: m["loss"] for s, m in read_metrics(metrics).items()}
        if flags:
            assert "recompute_input_fp8: true" in out and "blocks.1: recompute" in out
    for name in ("fp8", "compiled", "in_backward"):
        for step in range(1, 5):
            assert math.isfinite(losses[name][step])
            assert losses[name][step] == pytest.approx(losses["plain"][step], rel=0.01), (name, step, losses)
    # Forward reads the exact inputs: the first step's loss is that of the run without a plan.
    assert losses["fp8"][1] == losses["plain"][1]


@pytest.mark.slow
def test_recomputed_from_fp8_inputs_under_zero3(tmp_path):
    """ZeRO-3 gathers each block's weights again for the recomputation: from FP8 inputs too,
    4 steps within 1% of the run without a plan on 2 ranks."""
    launcher = _LAUNCH["zero3"]()
    if not os.path.exists(launcher[0]):
        pytest.skip("deepspeed not installed")
    plan = tmp_path / "plan.json"
    Plan((("blocks.0", "recompute"), ("blocks.1", "recompute")), 8, 64).save(str(plan))
    losses = {}
    for name, flags in (("plain", ()), ("fp8", ("--plan", str(plan), "--recompute-input-fp8"))):
        metrics = tmp_path / f"{name}.jsonl"
        out = run_in_repo([*launcher, *flags, "--metrics-file", str(metrics)], 300, DS_ACCELERATOR="cpu").stdout
        assert "step 4/4 (100%)" in out, (name, out[-2000:])
        losses[name] = {s: m["loss"] for s, m in read_metrics(metrics).items()}
    assert "recompute_input_fp8: true" in out
    for step in range(1, 5):
        assert math.isfinite(losses["fp8"][step])
        assert losses["fp8"][step] == pytest.approx(losses["plain"][step], rel=0.01), (step, losses)
    assert losses["fp8"][1] == losses["plain"][1]
