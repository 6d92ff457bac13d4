"""Checkpoints written by an older coat_ds (tests/data/checkpoints, see tests/data/make_checkpoints.py)
load with today's code: the loaded state's FP32 view equals the one written beside each
checkpoint, bit for bit, and training continues with finite parameters.

Run as a script this file is the 2-rank worker that `torchrun` starts for the DeepSpeed and
FSDP2 fixtures.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "data", "checkpoints")

_spec = importlib.util.spec_from_file_location("make_checkpoints", os.path.join(HERE, "data", "make_checkpoints.py"))
gen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen)


def _assert_same(got, want, where: str) -> None:
    """Equal structure, and tensors equal in dtype, shape and bits."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), (where, sorted(got), sorted(want))
        for k in want:
            _assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            _assert_same(a, b, f"{where}[{i}]")
    elif torch.is_tensor(want):
        assert torch.is_tensor(got) and got.dtype == want.dtype and got.shape == want.shape, where
        bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16}.get(want.dtype)
        a, b = (got.view(bits), want.view(bits)) if bits else (got, want)
        assert torch.equal(a, b), where
    else:
        assert got == want, (where, got, want)


def _load(*path: str):
    return torch.load(os.path.join(FIXTURES, *path), weights_only=True)


# -- plain torch.save of the optimizer (one process) ------------------------------------------


def _plain_model_and_optim():
    import coat_ds

    model = gen.Tiny()
    model.load_state_dict(_load("plain", "model.pt"))
    return model, coat_ds.CoatAdamW(model.parameters(), lr=gen.LR, betas=(0.9, 0.95))


def _step_is_finite(model, optim, step: int) -> None:
    x, y = gen.batch(step, 64, 4)
    ((model(x) - y) ** 2).mean().backward()
    optim.step()
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_plain_state_dict_loads_bit_exactly():
    saved = _load("plain", "optim.pt")
    model, optim = _plain_model_and_optim()
    optim.load_state_dict(saved)
    w = optim.state[model.fc1.weight]
    assert w["exp_avg_codes"].dtype == torch.uint8 and int(w["group_skips"].sum()) == 1  # the fixture's NaN step
    _assert_same(optim.state_dict(), saved, "state_dict")  # the flat keys come back as written
    _assert_same(optim.fp32_state_dict(), _load("plain", "fp32.pt"), "fp32_state_dict")
    _step_is_finite(model, optim, gen.STEPS)


def test_plain_fp32_view_loads_within_one_fp8_rounding():
    """The FP32 view written beside the fixture, quantized again: every moment comes back
    within E4M3's rounding (DRE keeps the error relative, no moment flushes to zero)."""
    fp32 = _load("plain", "fp32.pt")
    model, optim = _plain_model_and_optim()
    optim.load_fp32_state_dict(fp32)
    assert "exp_avg_codes" in optim.state[model.fc1.weight] and "exp_avg" in optim.state[model.fc2.weight]
    again = optim.fp32_state_dict()["state"]
    for pid, want in fp32["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            ref, got = want[k], again[pid][k]
            nonzero = ref != 0
            assert torch.equal(got[~nonzero], ref[~nonzero])
            rel = ((got - ref).abs() / ref.abs())[nonzero]
            assert rel.max().item() < 0.35 and rel.mean().item() < 0.05, (pid, k, rel.max(), rel.mean())
    _step_is_finite(model, optim, gen.STEPS)


# -- DeepSpeed consolidation (one process) ----------------------------------------------------


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_consolidation_unchanged(stage, tmp_path):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from coat_ds.integrations.deepspeed.checkpoint import consolidate_checkpoint

    ckpt = shutil.copytree(os.path.join(FIXTURES, f"zero{stage}"), tmp_path / "ckpt")
    want = _load(f"zero{stage}", "consolidated.pt")
    assert want["zero_stage"] == stage and want["world_size"] == 2
    _assert_same(consolidate_checkpoint(str(ckpt)), want, "consolidated")


# -- 2-rank loads: DeepSpeed ZeRO-2/3, FSDP2 DCP ------------------------------------------------


def worker_zero(stage: int, ckpt: str) -> None:
    from coat_ds.integrations.deepspeed.engine import local_partitions
    from coat_ds.integrations.deepspeed.checkpoint import load_checkpoint

    engine = gen.ds_engine(stage)
    _, client = load_checkpoint(engine, ckpt)
    assert client["step"] == gen.STEPS
    want = torch.load(os.path.join(ckpt, f"fp32_rank{engine.global_rank}.pt"), weights_only=True)
    _assert_same(gen.ds_fp32_view(engine), want, f"rank {engine.global_rank}")
    gen.ds_train(engine, range(gen.STEPS, gen.STEPS + 1))
    assert all(bool(torch.isfinite(t).all()) for t, _ in local_partitions(engine))


def worker_fsdp2(ckpt: str) -> None:
    import coat_ds
    from coat_ds.integrations.fsdp import load_checkpoint, setup_fsdp

    torch.manual_seed(1)  # other initial weights: everything must come from the checkpoint
    model = setup_fsdp(gen.FsdpNet(), mode="fsdp2")
    optim = coat_ds.CoatAdamW(model.parameters(), lr=gen.LR, min_quant_numel=gen.FSDP_MIN_QUANT)
    assert load_checkpoint(ckpt, model, optim) == gen.STEPS
    rank = torch.distributed.get_rank()
    want = torch.load(os.path.join(ckpt, f"fp32_rank{rank}.pt"), weights_only=True)
    _assert_same(gen.fsdp_fp32_view(optim), want, f"rank {rank}")
    gen.fsdp_train(model, optim, range(gen.STEPS, gen.STEPS + 1))
    assert all(bool(torch.isfinite(p.to_local()).all()) for p in model.parameters())


def _launch(*args: str) -> None:
    from helpers import run_ranks

    run_ranks(__file__, *args, timeout=600, DS_ACCELERATOR="cpu")


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_checkpoint_loads_bit_exactly(stage, tmp_path):
    ckpt = shutil.copytree(os.path.join(FIXTURES, f"zero{stage}"), tmp_path / "ckpt")
    _launch("zero", str(stage), str(ckpt))


@pytest.mark.slow
def test_fsdp2_dcp_checkpoint_loads_bit_exactly(tmp_path):
    ckpt = shutil.copytree(os.path.join(FIXTURES, "fsdp2"), tmp_path / "ckpt")
    _launch("fsdp2", str(ckpt))


if __name__ == "__main__":
    from helpers import end_worker

    torch.set_num_threads(1)
    if sys.argv[1] == "zero":
        worker_zero(int(sys.argv[2]), sys.argv[3])
    else:
        torch.distributed.init_process_group("gloo")
        worker_fsdp2(sys.argv[2])
    end_worker()
