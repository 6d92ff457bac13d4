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


def _launcher(engine: str) -> list[str]:
    launcher = _LAUNCH[engine]()
    if not os.path.exists(launcher[0]):
        pytest.skip(f"{os.path.basename(launcher[0])} not installed")
    return launcher


def _losses(tmp_path, launcher: list[str], runs: dict, limit: float = 300) -> tuple[dict, dict]:
    """Per run name, train.py's loss at each of its 4 steps under `launcher` with the run's
    flags, and its output."""
    losses, outs = {}, {}
    for name, flags in runs.items():
        metrics = tmp_path / f"{name}.jsonl"
        out = run_in_repo([*launcher, *flags, "--metrics-file", str(metrics)], limit, DS_ACCELERATOR="cpu").stdout
        assert "step 4/4 (100%)" in out, (name, out[-2000:])
        losses[name] = {s: m["loss"] for s, m in read_metrics(metrics).items()}
        outs[name] = out
    return losses, outs


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """`plain(engine)`: train.py's losses without a plan under `engine`, run once for this file's
    tests (two of them compared with the same command, fsdp2's and zero3's, each running it)."""
    runs = {}

    def get(engine: str) -> dict:
        if engine not in runs:
            runs[engine] = _losses(tmp_path_factory.mktemp(f"plain_{engine}"), _launcher(engine), {"plain": ()},
                                   400)[0]["plain"]
        return runs[engine]

    return get


def _with_plain(plain, engine: str, losses: dict) -> dict:
    return {"plain": plain(engine), **losses}


def _like_plain(losses: dict, name: str) -> None:
    for step in range(1, 5):
        assert math.isfinite(losses[name][step])
        assert losses[name][step] == pytest.approx(losses["plain"][step], rel=0.01), (name, step, losses)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["fsdp2", "zero1", "zero2", "zero3"])
def test_mixed_plan_trains_like_no_plan(tmp_path, plain, engine):
    launcher = _launcher(engine)
    plan = tmp_path / "plan.json"
    Plan((("blocks.0", "recompute"), ("blocks.1", "fp8_linear")), 8, 64).save(str(plan))
    losses, outs = _losses(tmp_path, launcher, {"plan": ("--plan", str(plan))})
    losses = _with_plain(plain, engine, losses)
    assert "blocks.0: recompute" in outs["plan"] and "blocks.1: fp8_linear" in outs["plan"]
    _like_plain(losses, "plan")


def _fp8_inputs(tmp_path) -> tuple[str, ...]:
    """train.py flags: every block recomputed from FP8 inputs."""
    plan = tmp_path / "plan.json"
    Plan((("blocks.0", "recompute"), ("blocks.1", "recompute")), 8, 64).save(str(plan))
    return ("--plan", str(plan), "--recompute-input-fp8")


@pytest.mark.slow
def test_recomputed_from_fp8_inputs_under_fsdp2_eager_compiled_and_in_backward(tmp_path, plain):
    """Every block recomputed from FP8 inputs under FSDP2 on 2 ranks: eagerly, with compiled
    blocks (compile_layer), and with the optimizer step in backward (the 7B fit's setting),
    each within 1% of the run without a plan."""
    launcher = _launcher("fsdp2")
    fp8 = _fp8_inputs(tmp_path)
    runs = {"fp8": fp8, "compiled": (*fp8, "--compile"), "in_backward": (*fp8, "--step-in-backward")}
    losses, outs = _losses(tmp_path, launcher, runs, limit=400)
    losses = _with_plain(plain, "fsdp2", losses)
    for name in ("fp8", "compiled", "in_backward"):
        assert "recompute_input_fp8: true" in outs[name] and "blocks.1: recompute" in outs[name]
        _like_plain(losses, name)
    # Forward reads the exact inputs: the first step's loss is that of the run without a plan.
    assert losses["fp8"][1] == losses["plain"][1]


@pytest.mark.slow
def test_recomputed_from_fp8_inputs_under_zero3(tmp_path, plain):
    """ZeRO-3 gathers each block's weights again for the recomputation: from FP8 inputs too,
    4 steps within 1% of the run without a plan on 2 ranks."""
    losses, outs = _losses(tmp_path, _launcher("zero3"), {"fp8": _fp8_inputs(tmp_path)})
    losses = _with_plain(plain, "zero3", losses)
    assert "recompute_input_fp8: true" in outs["fp8"]
    _like_plain(losses, "fp8")
    assert losses["fp8"][1] == losses["plain"][1]
