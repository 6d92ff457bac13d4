"""Writes the checked-in CoatAdamW checkpoints that tests/test_old_checkpoints.py loads.

They pin the checkpoint formats: whatever the code becomes, a checkpoint written by an older
coat_ds must keep loading. Written by commit a02c119 (main, before the optimizer state became
one object), torch 2.13 CPU, DeepSpeed 0.19.8; `checkpoints/MANIFEST.json` records
the commit and versions of the last run. Do not rewrite them with newer code unless the format
changes on purpose: then add new fixtures beside these instead.

Each fixture comes with its FP32 view as written (`CoatAdamW.fp32_state_dict()` moments, or
DeepSpeed's consolidation), which the test compares with what today's code loads:

    checkpoints/plain/         torch.save of model.state_dict() and optimizer.state_dict() after
                               3 steps (one group skipped a NaN gradient), and fp32.pt
    checkpoints/zero2/, zero3/ coat_ds.integrations.deepspeed.checkpoint.save_checkpoint of a
                               2-rank BF16 engine after 3 steps (save folder, checkpoint step3),
                               fp32_rank{0,1}.pt (each rank's partitions' FP32 moments) and
                               consolidated.pt (consolidate_checkpoint of it)
    checkpoints/fsdp2/         coat_ds.integrations.fsdp.save_checkpoint on 2 ranks after 3 steps
                               (DCP folder step3) and fp32_rank{0,1}.pt (local FP32 moments)

Rerun (CPU, about a minute; replaces tests/data/checkpoints):

    PYTHONPATH=$PWD python tests/data/make_checkpoints.py
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
OUT = os.path.join(HERE, "checkpoints")
STEPS = 3
LR = 1e-2


class Tiny(nn.Module):
    """fc1.weight (8192 elements) gets FP8 moments at the default min_quant_numel (4096);
    the biases and fc2.weight keep FP32 ones."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 128)
        self.fc2 = nn.Linear(128, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class FsdpNet(nn.Module):
    """tests/test_fsdp.py's awkward shapes: a (1, 130) weight (rank 1's shard is empty), 2-D
    weights (compact metadata), a quantized 200-element bias (per-element metadata) and a
    3-element bias with FP32 moments (min_quant_numel 128)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Parameter(torch.randn(1, 130) * 0.5 + 1)
        self.blocks = nn.ModuleList([nn.Linear(130, 200), nn.Linear(200, 3)])

    def forward(self, x):
        return self.blocks[1](torch.relu(self.blocks[0](x * self.gate)))


FSDP_MIN_QUANT = 128


def batch(step: int, inputs: int, outputs: int):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, inputs, generator=g), torch.randn(8, outputs, generator=g)


def tiny_groups(model: Tiny) -> list[dict]:
    """Two param groups, so that each DeepSpeed ZeRO partition of the small one (644
    elements) keeps FP32 moments while the large one's are FP8."""
    return [{"params": [model.fc1.weight]}, {"params": [model.fc1.bias, model.fc2.weight, model.fc2.bias]}]


def ds_config(stage: int) -> dict:
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    return {
        "train_micro_batch_size_per_gpu": 8,
        "bf16": {"enabled": True},
        "optimizer": {"type": "CoatAdamW", "params": {"lr": LR, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }


def ds_engine(stage: int):
    from coat_ds.integrations.deepspeed.engine import initialize

    torch.manual_seed(0)
    model = Tiny()
    engine, *_ = initialize(model=model, model_parameters=tiny_groups(model), config=ds_config(stage))
    return engine


def ds_train(engine, steps: range) -> None:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    for s in steps:
        x, y = batch(s, 64, 4)
        out = engine(x.chunk(world)[rank].to(torch.bfloat16))
        engine.backward(((out.float() - y.chunk(world)[rank]) ** 2).mean())
        engine.step()


def ds_fp32_view(engine) -> list[dict]:
    """Each local partition's state in torch.optim.AdamW's layout (FP32 moments, skips folded)."""
    from coat_ds.integrations.deepspeed.engine import coat_optimizer, group_state_config, local_partitions
    from coat_ds.optim.state import to_fp32

    opt = coat_optimizer(engine)
    return [to_fp32(opt.state[t], group_state_config(g), tuple(g["betas"])) for t, g in local_partitions(engine)]


def fsdp_fp32_view(optim) -> dict:
    """This rank's FP32 view of the optimizer state: local tensors keyed by state-dict id."""
    return {pid: {k: (v.to_local() if hasattr(v, "to_local") else v).clone() for k, v in state.items()}
            for pid, state in optim.fp32_state_dict()["state"].items()}


def fsdp_train(model, optim, steps: range) -> None:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    for s in steps:
        x, y = batch(s, 130, 3)
        ((model(x.chunk(world)[rank]) - y.chunk(world)[rank]) ** 2).mean().backward()
        optim.step()
        optim.zero_grad()


# -- writers -----------------------------------------------------------------------------------


def write_plain(out: str) -> None:
    import coat_ds

    torch.manual_seed(0)
    model = Tiny()
    optim = coat_ds.CoatAdamW(model.parameters(), lr=LR, betas=(0.9, 0.95))
    for s in range(STEPS):
        x, y = batch(s, 64, 4)
        ((model(x) - y) ** 2).mean().backward()
        if s == 1:  # one group of fc1.weight skips a step: its group_skips count is 1
            model.fc1.weight.grad[0, 0] = float("nan")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            optim.step()
        optim.zero_grad()
    os.makedirs(out)
    torch.save(model.state_dict(), os.path.join(out, "model.pt"))
    torch.save(optim.state_dict(), os.path.join(out, "optim.pt"))
    torch.save(optim.fp32_state_dict(), os.path.join(out, "fp32.pt"))


def worker_ds(stage: int, out: str) -> None:
    from coat_ds.integrations.deepspeed.checkpoint import consolidate_checkpoint, save_checkpoint

    engine = ds_engine(stage)
    ds_train(engine, range(STEPS))
    save_checkpoint(engine, out, f"step{STEPS}", client_state={"step": STEPS})
    torch.save(ds_fp32_view(engine), os.path.join(out, f"fp32_rank{engine.global_rank}.pt"))
    torch.distributed.barrier()
    if engine.global_rank == 0:
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):  # DeepSpeed's copies of its own scripts
            os.remove(os.path.join(out, script))
        torch.save(consolidate_checkpoint(out), os.path.join(out, "consolidated.pt"))


def worker_fsdp2(out: str) -> None:
    import coat_ds
    from coat_ds.integrations.fsdp import save_checkpoint, setup_fsdp

    torch.manual_seed(0)
    model = setup_fsdp(FsdpNet(), mode="fsdp2")
    optim = coat_ds.CoatAdamW(model.parameters(), lr=LR, min_quant_numel=FSDP_MIN_QUANT)
    fsdp_train(model, optim, range(STEPS))
    save_checkpoint(os.path.join(out, f"step{STEPS}"), model, optim, step=STEPS)
    torch.save(fsdp_fp32_view(optim), os.path.join(out, f"fp32_rank{torch.distributed.get_rank()}.pt"))


def _launch(*args: str) -> None:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533",
           os.path.abspath(__file__), *args]
    subprocess.run(cmd, env=env, cwd=ROOT, check=True)


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def main() -> None:
    import deepspeed

    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(OUT)
    write_plain(os.path.join(OUT, "plain"))
    for stage in (2, 3):
        _launch("zero", str(stage), os.path.join(OUT, f"zero{stage}"))
    _launch("fsdp2", os.path.join(OUT, "fsdp2"))
    with open(os.path.join(OUT, "MANIFEST.json"), "w") as f:
        json.dump({"commit": _commit(), "torch": torch.__version__, "deepspeed": deepspeed.__version__}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    if len(sys.argv) == 1:
        main()
    else:
        torch.set_num_threads(1)
        if sys.argv[1] == "zero":
            worker_ds(int(sys.argv[2]), sys.argv[3])
        else:
            torch.distributed.init_process_group("gloo")
            worker_fsdp2(sys.argv[2])
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        os._exit(0)  # skip interpreter finalization: a gloo group torn down there can SIGABRT
