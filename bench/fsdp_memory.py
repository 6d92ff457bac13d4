"""FSDP2 memory and throughput: torch AdamW vs CoatAdamW vs CoatAdamW + FP8 activations.

    torchrun --nproc_per_node 2 bench/fsdp_memory.py [--preset 1b] [--seq-len 2048]
        [--micro-batch 4] [--steps 10] [--variants adamw,coat,coat_act] [--out fsdp.json]

Each variant builds the same Llama preset (coat_ds.model), shards it with FSDP2
(`setup_fsdp`, BF16 compute, FP32 master weights and gradient reduction) and trains on the
same random tokens. Reported per variant, the maximum over ranks: peak allocated and
reserved GPU memory, this rank's optimizer-state bytes (moments only), tokens/s over the
timed steps (after `--warmup` steps) and the last loss. Variants run one after another in
the same processes, each after freeing the previous one and resetting the peak counters.
Also runs on CPU with gloo (tiny presets) to check the script itself.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from coat_ds import ActivationConfig, CoatAdamW  # noqa: E402
from coat_ds.integrations.fsdp import setup_fsdp  # noqa: E402
from coat_ds.model import Llama, model_config  # noqa: E402

VARIANTS = ("adamw", "coat", "coat_act")


def state_bytes(optim) -> int:
    """Bytes of every optimizer state tensor but the step counters, on this rank."""
    total = 0
    for state in optim.state.values():
        for key, t in state.items():
            if torch.is_tensor(t) and key != "step":
                local = getattr(t, "_local_tensor", t)
                total += local.numel() * local.element_size()
    return total


def max_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor(float(value), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def run(variant: str, args, device: torch.device, rank: int, world: int) -> dict:
    torch.manual_seed(args.seed)
    with device:  # built on the GPU (fast init); sharding frees all but this rank's share
        model = Llama(model_config(args.preset, max_seq_len=args.seq_len))
    n_params = sum(p.numel() for p in model.parameters())
    param_dtype = torch.bfloat16 if device.type == "cuda" else None
    model = setup_fsdp(model, mode="fsdp2", param_dtype=param_dtype,
                       activation=ActivationConfig() if variant == "coat_act" else None)
    if variant == "adamw":
        optim = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    else:
        optim = CoatAdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed + rank)
    vocab = model.cfg.vocab_size
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0, loss = None, float("nan")
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        tokens = torch.randint(0, vocab, (args.micro_batch, args.seq_len + 1), generator=gen).to(device)
        out = model(tokens[:, :-1], tokens[:, 1:])
        out.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        loss = out.detach()
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    result = {
        "variant": variant,
        "preset": args.preset,
        "params": n_params,
        "world": world,
        "micro_batch": args.micro_batch,
        "seq_len": args.seq_len,
        "tokens_per_s": args.micro_batch * args.seq_len * world * args.steps / max_over_ranks(dt, device),
        "optimizer_state_gb": max_over_ranks(state_bytes(optim), device) / 1e9,
        "loss": float(loss),
    }
    if device.type == "cuda":
        result["peak_allocated_gb"] = max_over_ranks(torch.cuda.max_memory_allocated(), device) / 1e9
        result["peak_reserved_gb"] = max_over_ranks(torch.cuda.max_memory_reserved(), device) / 1e9
    del model, optim, out, loss
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"unknown variant {v!r}; choose from {', '.join(VARIANTS)}")

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    results = []
    for v in variants:
        r = run(v, args, device, rank, world)
        results.append(r)
        if rank == 0:
            print(json.dumps(r), flush=True)
    if rank == 0 and args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
