"""Fp8Linear under real FSDP2, FSDP1 and DeepSpeed ZeRO-1/2/3: one torchrun launch of 2 CPU
ranks over gloo runs every scenario (one launch: DeepSpeed's import and start-up are most of
the cost).

Run as a script this file is the worker; under pytest it launches the workers and checks
the JSON each rank writes."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from helpers import end_worker, free_port

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# FP8 gradients of a 3-layer chain against FP32: one layer's bound (21 dB, test_fp8_linear.py)
# less ~2 dB for the two FP8 input-gradient GEMMs the first layer's gradient passes through.
CHAIN_DB = 18.0


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.SiLU(), nn.Linear(128, 64), nn.SiLU(), nn.Linear(64, 32))


def _fsdp2(rank: int) -> dict:
    """Converted before fully_shard (the first model) and after it (the second, with the
    first linear sharded on its own): gradients equal those of the same converted model run
    unsharded on both ranks' data, and stay within FP8's error of nn.Linear's."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import coat_ds
    from helpers import sqnr_db

    all_ = lambda m, fqn: True  # noqa: E731
    cfg = coat_ds.Fp8LinearConfig(fp8_gemm="on", backend="torch")
    before = coat_ds.convert_to_fp8_linear(_mlp(), config=cfg, module_filter_fn=all_)
    fully_shard(before)
    after = _mlp()
    fully_shard(after[0])
    fully_shard(after)
    coat_ds.convert_to_fp8_linear(after, config=cfg, module_filter_fn=all_)
    local = coat_ds.convert_to_fp8_linear(_mlp(), config=cfg, module_filter_fn=all_)
    plain = _mlp()
    torch.manual_seed(1)
    xs = torch.randn(2, 24, 64)  # each rank takes its row; 24 tokens pad to 32 in the transposed copies
    out = {"after_class": type(after[0]).__name__}
    for m in (before, after):
        m(xs[rank]).pow(2).sum().backward()
    for m in (local, plain):
        for r in range(2):
            (m(xs[r]).pow(2).sum() / 2).backward()  # FSDP averages gradients over ranks
    worst_exact, worst_fp8 = float("inf"), float("inf")
    for m in (before, after):
        for (name, p), q, q_plain in zip(m.named_parameters(), local.parameters(), plain.parameters()):
            g = p.grad.full_tensor()
            assert torch.isfinite(g).all(), name
            worst_exact = min(worst_exact, sqnr_db(q.grad, g))
            worst_fp8 = min(worst_fp8, sqnr_db(q_plain.grad, g))
    out.update(fsdp_vs_local_db=worst_exact, fsdp_vs_nn_linear_db=worst_fp8)
    opt = coat_ds.CoatAdamW(after.parameters(), lr=1e-2, min_quant_numel=128)
    opt.step()
    out["stepped_finite"] = all(torch.isfinite(p.full_tensor()).all().item() for p in after.parameters())
    dist.barrier()
    return out


def _fsdp1(rank: int) -> dict:
    """FSDP1 (flat parameters, converted before wrapping): gradients equal those of the same
    converted model run unsharded on both ranks' data."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    import coat_ds
    from helpers import sqnr_db

    all_ = lambda m, fqn: True  # noqa: E731
    cfg = coat_ds.Fp8LinearConfig(fp8_gemm="on", backend="torch")
    wrapped = FSDP(coat_ds.convert_to_fp8_linear(_mlp(), config=cfg, module_filter_fn=all_), use_orig_params=True,
                   device_id=torch.device("cpu"))
    local = coat_ds.convert_to_fp8_linear(_mlp(), config=cfg, module_filter_fn=all_)
    torch.manual_seed(1)
    xs = torch.randn(2, 24, 64)
    wrapped(xs[rank]).pow(2).sum().backward()
    for r in range(2):
        (local(xs[r]).pow(2).sum() / 2).backward()
    worst = float("inf")
    with FSDP.summon_full_params(wrapped, with_grads=True):
        for p, q in zip(wrapped.parameters(), local.parameters()):
            assert torch.isfinite(p.grad).all()
            worst = min(worst, sqnr_db(q.grad, p.grad))
    converted = sum(isinstance(m, coat_ds.Fp8Linear) for m in wrapped.modules())
    return {"fsdp1_vs_local_db": worst, "fsdp1_converted": converted}


def _zero(rank: int, stage: int) -> dict:
    """ZeRO-`stage` (BF16 weights; stage 3 gathers the parameters for each layer): the
    converted tiny Llama trains, and its first loss matches the unconverted model's (run
    without DeepSpeed) within FP8's error."""
    import coat_ds
    from coat_ds.train.data import DataConfig, batch_seed, load_data
    from coat_ds.integrations.deepspeed.engine import initialize
    from coat_ds.models.llama import Llama, model_config

    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
              "optimizer": {"type": "CoatAdamW", "params": {"lr": 1e-2, "min_quant_numel": 1024}},
              "zero_optimization": {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})},
              "steps_per_print": 10**9}
    data = load_data(DataConfig(max_bytes=300_000))
    batches = [data.batch("train", 4, 32, batch_seed(0, step, rank, 0)) for step in range(5)]
    torch.manual_seed(0)
    plain = Llama(model_config("tiny", max_seq_len=32)).to(torch.bfloat16)
    with torch.no_grad():
        plain_loss = float(plain(*batches[0]))
    torch.manual_seed(0)
    model = Llama(model_config("tiny", max_seq_len=32))
    coat_ds.convert_to_fp8_linear(model, config=coat_ds.Fp8LinearConfig(fp8_gemm="on", backend="torch"))
    converted = sum(isinstance(m, coat_ds.Fp8Linear) for m in model.modules())
    engine, *_ = initialize(model=model, config=config)
    losses = []
    for x, y in batches:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {f"zero{stage}_losses": losses, "plain_loss": plain_loss, "converted": converted}


def worker(out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    import time

    t0 = time.perf_counter()
    result = {"rank": rank, **_fsdp2(rank), **_fsdp1(rank)}
    t1 = time.perf_counter()
    for stage in (1, 2, 3):
        result.update(_zero(rank, stage))
    result["seconds"] = {"fsdp": t1 - t0, "zero": time.perf_counter() - t1}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    end_worker()


@pytest.mark.slow
def test_fsdp_and_zero_two_ranks(tmp_path):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           __file__, str(tmp_path)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    print(ranks[0]["seconds"], {k: v for k, v in ranks[0].items() if "db" in k or "losses" in k})
    for r in ranks:
        assert r["after_class"] == "FSDPFp8Linear"
        assert r["fsdp_vs_local_db"] > 60, r  # same FP8 computation, sharded or not
        assert r["fsdp_vs_nn_linear_db"] > CHAIN_DB, r
        assert r["stepped_finite"]
        assert r["fsdp1_vs_local_db"] > 60, r
        assert r["fsdp1_converted"] == 3
        assert r["converted"] == 2 * 5  # wqkv, wo, w_gate, w_up, w_down per block; head skipped
        for stage in (1, 2, 3):
            fp8 = r[f"zero{stage}_losses"]
            assert all(x == x for x in fp8), stage
            assert abs(fp8[0] - r["plain_loss"]) < 0.02 * r["plain_loss"], (stage, r)
            assert fp8[-1] < fp8[0] - 0.1, (stage, fp8)


if __name__ == "__main__":
    worker(sys.argv[1])
