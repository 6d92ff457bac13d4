"""Where compression's gradient error goes, eager and compiled: a model trained with torch
AdamW, then one batch's weight gradients with `compress_activations` against without it.

    python bench/grad_error.py --preset 350m --device cuda --batch-size 12 --seq-len 1024 --pair-vocab 32000
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import datetime
import json
import statistics
import sys

import _common as C  # (first: puts the measured tree's coat_ds on the path)
import torch

from coat_ds import ActivationConfig, compress_activations  # noqa: E402
from coat_ds.train.determinism import deterministic_kernels  # noqa: E402
from coat_ds.train.data import DataConfig, batch_seed, load_data  # noqa: E402
from coat_ds.models.llama import Llama, model_config  # noqa: E402
from coat_ds.plan import compile_layer  # noqa: E402


def _sqnr_db(want: torch.Tensor, got: torch.Tensor) -> float:
    err = (want - got).pow(2).sum().clamp_min(1e-30)
    return (10 * torch.log10(want.pow(2).sum() / err)).item()


def run_grad_error(args, argv) -> int:
    """Train a model with torch AdamW, then one batch's weight gradients with
    `compress_activations` against without it, eagerly and with every block compiled: per
    parameter kind (over layers) the SQNR in dB and the norm ratio. Where compression's error
    goes, without a whole training run per question. On CUDA with deterministic kernels, so
    that the difference is compression's alone."""
    act = C.act_overrides(args.act_config)
    modes = args.modes.split(",")
    if any(m not in ("eager", "compiled", "compiled_cqkv") for m in modes):
        raise SystemExit(f"--modes {args.modes!r}: choose from eager, compiled, compiled_cqkv")
    device = torch.device(args.device)
    if device.type == "cuda":
        deterministic_kernels()  # else two uncompressed runs already differ (SDPA's and the embedding's backward)
    torch.manual_seed(args.seed)
    data = load_data(DataConfig(max_bytes=args.max_data_bytes))
    if args.pair_vocab:
        data = C.pair_tokens(data, args.pair_vocab)
    base = Llama(model_config(args.preset, max_seq_len=max(args.seq_len, 16), vocab_size=data.vocab_size)).to(device)
    bf16 = device.type == "cuda"
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    opt = torch.optim.AdamW(base.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    loss = float("nan")
    for step in range(args.train_steps):
        for g in opt.param_groups:
            g["lr"] = C.lr_at(step, args.train_steps, args.warmup, args.lr)
        x, y = (t.to(device) for t in data.batch("train", args.batch_size, args.seq_len,
                                                  batch_seed(args.seed, step, 0, 0, "train")))
        with autocast():
            loss = base(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(base.parameters(), 1.0)
        opt.step()
        loss = loss.item()
    del opt
    base.zero_grad(set_to_none=True)
    x, y = (t.to(device) for t in data.batch("train", args.grad_batch_size, args.seq_len,
                                              batch_seed(args.seed, 10**6, 0, 0, "train")))

    def grads(compress: bool, compiled: bool, cqkv: bool = False) -> dict:
        model = copy.deepcopy(base)
        cfg = ActivationConfig(**{"eager_min_region_numel": 0, **act, **({"compress_attention_inputs": True}
                                                                           if cqkv else {})})
        handle = compress_activations(model, config=cfg) if compress else None
        if compiled:
            for block in model.blocks:
                compile_layer(block)
        with autocast():
            model(x, y).backward()
        out = {n: p.grad.float() for n, p in model.named_parameters()}
        if handle is not None:
            handle.remove()
        torch._dynamo.reset()
        return out

    rows, uncompressed = collections.defaultdict(list), {}
    for mode in modes:
        compiled = mode.startswith("compiled")
        if compiled not in uncompressed:  # compiled and compiled_cqkv share their reference
            uncompressed[compiled] = grads(False, compiled)
        want, got = uncompressed[compiled], grads(True, compiled, mode == "compiled_cqkv")
        for n in want:
            kind = n.split(".", 2)[2] if n.startswith("blocks.") else n
            rows[kind, mode].append((_sqnr_db(want[n], got[n]), (got[n].norm() / want[n].norm()).item()))
    print(json.dumps(dict(command="python bench/grad_error.py " + " ".join(argv), device=str(
        torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"), torch=torch.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), preset=args.preset,
        train_steps=args.train_steps, train_loss=loss, act_config=act)))
    print("| parameter | " + " | ".join(f"{m}: SQNR dB, mean (min) | {m}: norm ratio, mean" for m in modes) + " |")
    print("|---|" + "---|---|" * len(modes))
    for kind in dict.fromkeys(k for k, _ in rows):
        cells = []
        for m in modes:
            v = rows[kind, m]
            cells += [f"{statistics.mean(d for d, _ in v):.1f} ({min(d for d, _ in v):.1f})",
                      f"{statistics.mean(r for _, r in v):.4f}"]
        print(f"| {kind} | " + " | ".join(cells) + " |")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    g = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g.add_argument("--preset", default="tiny")
    g.add_argument("--device", default="cpu")
    g.add_argument("--train-steps", type=int, default=150)
    g.add_argument("--batch-size", type=int, default=16)
    g.add_argument("--grad-batch-size", type=int, default=4)
    g.add_argument("--seq-len", type=int, default=128)
    g.add_argument("--lr", type=float, default=3e-4)
    g.add_argument("--warmup", type=int, default=30)
    g.add_argument("--seed", type=int, default=1341)
    g.add_argument("--max-data-bytes", type=int, default=32_000_000)
    g.add_argument("--pair-vocab", type=int, default=0)
    g.add_argument("--modes", default="eager,compiled,compiled_cqkv", help="comma-separated: eager, compiled, "
                   "compiled_cqkv (compiled with compress_attention_inputs=True)")
    g.add_argument("--act-config", action="append", default=[], metavar="KEY=VALUE",
                   help="an ActivationConfig field (repeatable)")
    return run_grad_error(g.parse_args(argv), argv)


if __name__ == "__main__":
    sys.exit(main())
