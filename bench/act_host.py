"""Host (Python) time of the eager saved-tensor hooks per saved tensor, on CPU.

A small Hugging Face Llama (BF16, per-layer regions as in bench/act_memory.py) runs forward
and backward through the Triton launchers with the kernel launch itself removed, so that
what is timed is the pack and unpack hooks' own work: the policy's facts, the tables, the
ledger, the FP8Saved bookkeeping, and the launchers' checks and allocations. Each hook call is timed around
the compressor's `pack`/`unpack` and filed under what it returned.

    python bench/act_host.py                                      # this checkout
    PYTHONPATH=/work/main/.oldwt python bench/act_host.py         # another version's code
    python bench/act_host.py --tensors                            # one kind of saved tensor at a time

The figures are per call, in microseconds: the median over rounds of each round's mean
(a round is one forward and backward), and the best round. Run both sides back to back on
the same machine; on a shared CPU compare medians of a few runs.

`--tensors` calls the hooks directly on fresh tensors of one kind at a time (an activation
compressed per group, a linear input per tensor, a transposed activation, a weight view,
a tiny tensor), outside any model: less noise, no model around it; best of many batches.
"""
from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict

os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton launchers on CPU tensors; nothing launches

import torch  # noqa: E402

import coat_ds  # noqa: E402
from coat_ds import ActivationConfig  # noqa: E402


def _no_launch() -> None:
    """The activation launchers with their kernel launch removed: shapes, allocations and
    checks stay as the GPU path runs them; the launch itself is the same in every version."""
    from coat_ds.kernels import act_quant

    act_quant.launch = lambda *args, **kwargs: None


def _model(layers: int, dim: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=dim, intermediate_size=dim * 11 // 4, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).to(torch.bfloat16)


def _outcome(saved, counted: set) -> str:
    name = type(saved).__name__
    if name == "FP8Saved":
        if id(saved) in counted:
            return "dedup"
        counted.add(id(saved))
        return "compressed"
    if name == "FP8View":
        return "dedup"
    return "as is"


def _per_tensor_kind(batches: int) -> None:
    from coat_ds.activation.hooks import SavedTensorCompressor

    comp = SavedTensorCompressor(ActivationConfig(backend="triton"))
    x = torch.randn(2, 32, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(64, 64, dtype=torch.bfloat16))
    comp.note_alive_anyway(torch.randn(4))  # a region always has some

    def linear_input():
        h = x * 2
        comp.note_linear_input(h)
        return h.view(64, 64)  # what F.linear saves: a 2-D view of its input

    kinds = (("per group", lambda: x * 2), ("per tensor (linear)", linear_input),
             ("transposed", lambda: (x * 2).transpose(1, 2)), ("weight view", lambda: w.t()),
             ("tiny (kept)", lambda: x[0, :4] * 2))
    clock = time.perf_counter_ns
    print(f"coat_ds: {coat_ds.__file__}")
    print(f"{'saved tensor':<22}{'pack us':>9}{'unpack us':>11}   (best of {batches} batches of 40)")
    for name, make in kinds:
        best_p = best_u = float("inf")
        for _ in range(batches):
            ts = [make() for _ in range(40)]
            t0 = clock()
            out = [comp.pack(t) for t in ts]
            t1 = clock()
            for saved in out:
                comp.unpack(saved)
            t2 = clock()
            best_p, best_u = min(best_p, (t1 - t0) / 40), min(best_u, (t2 - t1) / 40)
            del ts, out
        print(f"{name:<22}{best_p / 1e3:>9.2f}{best_u / 1e3:>11.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--tensors", action="store_true", help="time one kind of saved tensor at a time, no model")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    if args.tensors:
        _no_launch()
        _per_tensor_kind(args.rounds)
        return
    model = _model(args.layers, args.dim)
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    _no_launch()
    handle = coat_ds.compress_activations(model, config=ActivationConfig(backend="triton"),
                                          module_filter_fn=lambda m, fqn: isinstance(m, LlamaDecoderLayer))
    comp = handle.compressor
    pack, unpack = comp.pack, comp.unpack
    clock = time.perf_counter_ns
    rec: dict = {}

    def timed_pack(t):
        t0 = clock()
        saved = pack(t)
        dt = clock() - t0
        rec["pack"].append((saved, dt))
        return saved

    def timed_unpack(saved):
        t0 = clock()
        x = unpack(saved)
        rec["unpack"].append(clock() - t0)
        return x

    comp.pack, comp.unpack = timed_pack, timed_unpack
    ids = torch.randint(0, 128, (2, args.seq))
    per_round = defaultdict(list)  # outcome -> per-round mean ns
    counts = {}
    for r in range(args.rounds + 5):
        rec["pack"], rec["unpack"] = [], []
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        if r < 5:
            continue
        by = defaultdict(list)
        seen: set = set()
        for saved, dt in rec["pack"]:
            by[_outcome(saved, seen)].append(dt)
            by["pack, all"].append(dt)
        by["unpack, all"] = rec["unpack"]
        for k, v in by.items():
            per_round[k].append(sum(v) / len(v))
            counts[k] = len(v)
    handle.remove()
    print(f"coat_ds: {coat_ds.__file__}")
    print(f"HF Llama BF16, {args.layers} layers, dim {args.dim}, seq {args.seq}, batch 2, launches removed; "
          f"{args.rounds} rounds")
    print(f"{'hook call':<14}{'calls/round':>12}{'median us':>11}{'best us':>9}")
    for k in ("compressed", "dedup", "as is", "pack, all", "unpack, all"):
        if k in per_round:
            v = sorted(per_round[k])
            print(f"{k:<14}{counts[k]:>12}{v[len(v) // 2] / 1e3:>11.2f}{v[0] / 1e3:>9.2f}")


if __name__ == "__main__":
    main()
