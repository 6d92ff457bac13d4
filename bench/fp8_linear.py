"""FP8 linear layers end to end: HF LlamaForCausalLM (from a config), FP32 master weights + BF16
autocast, every decoder layer compiled (--eager: not), one training step timed per side, each
side in a process of its own (honest peaks).

    python bench/fp8_linear.py --shape 7b                      # default sides, then the table
    python bench/fp8_linear.py --shape 7b 1b --sides bf16 coat_fp8 torchao --tree .oldwt --rounds 2
    python bench/fp8_linear.py --shape 7b --sides coat_fp8 --profile      # top kernels of one step
    python bench/fp8_linear.py --shape 7b --sides coat_fp8 --trace DIR    # one step's trace, for trace_gaps.py
    python bench/fp8_linear.py --saved-bytes                   # CPU: FP8 input codes held for backward
    python bench/fp8_linear.py --census                        # CPU: ops and launches per eager step
    python bench/fp8_linear.py --shape tiny --sides bf16 coat_fp8 --eager  # CPU check of the script

Sides: bf16 (torch AdamW fused), bf16_ckpt (+ full activation checkpointing), torchao (float8
tensorwise linears + torch AdamW), coat (CoatAdamW + compress_activations on the layers),
coat_fp8 (coat + convert_to_fp8_linear), coat_fp8_triton (backend="triton": our quantize
kernels as custom ops), coat_fp8_keepw (keep_weight_codes=True), coat_fp8_sib (CoatAdamW
step_in_backward=True), coat_fp8_fused (coat_fp8 + fuse_rms_norms + fuse_swiglu: eager
speed only), coat_fp8_headloss (coat_fp8 + fuse_lm_head_loss: no full logits), coat_fp8_sib_headloss
(coat_fp8_sib + fuse_lm_head_loss).
Each side also reports forward, backward and step() medians
(CUDA events between the phases; with step_in_backward the update is in the backward column). Median of --steps
CUDA-event-timed steps after 3 warm-up steps; ratios against BF16 of the same call. With --tree,
the --ab-sides also run from the other checkout, alternating with this tree for --rounds rounds.
"""
from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import re
import sys

import _common as C
import torch

SIDES = ("bf16", "bf16_ckpt", "torchao", "coat", "coat_fp8", "coat_fp8_triton", "coat_fp8_keepw", "coat_fp8_sib",
         "coat_fp8_fused", "coat_fp8_headloss", "coat_fp8_sib_headloss", "coat_fp8_headloss8",
         "coat_fp8_sib_headloss8", "coat_fp8_headloss8x", "coat_fp8_nocomp_headloss",
         "coat_fp8_keepw_headloss", "coat_fp8_nocomp_keepw_headloss", "coat_fp8_nocomp_headloss8x",
         "coat_fp8_nocomp_keepwmlp_headloss", "coat_fp8_nocomp_headloss_c8192", "coat_fp8_cqkv", "coat_fp8_fused_cqkv",
         # The eager crossover: FP8 GEMMs forced on (f8) or off (nof8), compression forced on (ca)
         # or off (noca), whatever the size (coat_fp8_fused leaves both to the defaults).
         "coat_fp8_fused_f8_ca", "coat_fp8_fused_f8_noca", "coat_fp8_fused_nof8_ca", "coat_fp8_fused_nof8_noca")
_NEVER = 2 ** 62


def eager_limits(side: str) -> tuple[dict, dict]:
    """(Fp8LinearConfig, ActivationConfig) keyword arguments of a crossover side's tags."""
    tags = side.split("_")
    lin = {"eager_min_macs": 0} if "f8" in tags else {"eager_min_macs": _NEVER} if "nof8" in tags else {}
    act = ({"eager_min_region_numel": 0} if "ca" in tags else
           {"eager_min_region_numel": _NEVER} if "noca" in tags else {})
    return lin, act


def build(shape: str, side: str, seq: int, compiled: bool, backend: str | None = None, dev=None, **overrides):
    """`side`'s model and optimizer; `backend` (if given) for every coat_ds kernel, `overrides`
    of the shape's config."""
    import coat_ds

    model = C.hf_llama(shape, seq, dev, **overrides)
    be = {"backend": backend} if backend else {}
    if side == "bf16_ckpt":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if side == "torchao":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig(), module_filter_fn=lambda m, fqn: fqn != "lm_head")
    lin, act = eager_limits(side)
    if side.startswith("coat_fp8"):
        # Only the options a side sets: older trees (--tree) lack the newer ones.
        keep_mlp = "_keepwmlp" in side  # kept weight codes in the MLPs only: 2/3 of the bytes of _keepw
        kw = dict(lin, **({"backend": "triton"} if side == "coat_fp8_triton" else {}),
                  **({"keep_weight_codes": True} if "_keepw" in side and not keep_mlp else {}))
        cfg = coat_ds.Fp8LinearConfig(**{**kw, **be})
        if keep_mlp:
            coat_ds.convert_to_fp8_linear(model, config=coat_ds.Fp8LinearConfig(**kw, keep_weight_codes=True),
                                          module_filter_fn=lambda m, fqn: ".mlp." in fqn)
        coat_ds.convert_to_fp8_linear(model, config=cfg, **({"module_filter_fn": lambda m, fqn: ".mlp." not in fqn
                                                             and fqn != "lm_head"} if keep_mlp else {}))
        if side.startswith("coat_fp8_fused"):  # eager speed only: compiled, the modules run their own code
            coat_ds.fuse_rms_norms(model, **({"config": cfg} if be or lin else {}))
            coat_ds.fuse_swiglu(model, **({"config": cfg} if be or lin else {}))
    if side.startswith("coat"):
        if "_nocomp" not in side:  # _nocomp: activations saved as autograd keeps them
            layers = {id(m) for m in C.decoder_layers(model)}
            # _cqkv: attention's q, k and v compressed too (kept exact by default, compiled)
            act = {**act, **be, **({"compress_attention_inputs": True} if "_cqkv" in side else {})}
            coat_ds.compress_activations(model, **({"config": coat_ds.ActivationConfig(**act)} if act else {}),
                                         module_filter_fn=lambda m, fqn: id(m) in layers)
        opt = coat_ds.CoatAdamW(model.parameters(), lr=1e-4, weight_decay=0.0, **be,
                                **({"step_in_backward": True} if "_sib" in side else {}))
        # _headloss8: the head's GEMMs in FP8 too; 8x: exact accumulation; _cN: N tokens per chunk
        head = re.search(r"_headloss(8x?)?(?:_c(\d+))?$", side)
        if head:
            coat_ds.fuse_lm_head_loss(model, **({"fp8": coat_ds.Fp8LinearConfig(fast_accum=head[1] == "8")}
                                                if head[1] else {}),
                                      **({"chunk_tokens": int(head[2])} if head[2] else {}))
    else:
        # Fused on the census's CPU too: one step op per tensor list, as on a GPU.
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0,
                                fused=torch.cuda.is_available() or dev == "cpu")
    if compiled:
        C.compile_layers(model)
    return model, opt


def train_step(model, opt, ids) -> torch.Tensor:
    """One BF16-autocast training step on `ids` as inputs and labels; its loss, detached."""
    with torch.autocast(C.device().type, dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def run_side(args, shape: str, side: str) -> dict:
    model, opt = build(shape, side, args.seq, not args.eager)
    ids = torch.randint(0, model.config.vocab_size, (args.bs, args.seq), device=C.device())
    losses = []

    def step():
        losses.append(train_step(model, opt, ids))

    ms = C.median_ms(step, args.steps)
    out = {"shape": shape, "side": side, "bs": args.bs, "seq": args.seq, "ms": ms, "peak_gb": C.peak_gb(),
           "loss": float(losses[-1]), "params": sum(p.numel() for p in model.parameters()),
           **phase_ms(model, opt, ids, args.steps)}
    if args.profile:
        print("\n".join(C.kernel_table(step, args.profile)), flush=True)
    if args.trace:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            C.sync()
        prof.export_chrome_trace(f"{args.trace}/{shape}_{side}.json.gz")
    return out


def phase_ms(model, opt, ids, steps: int) -> dict:
    """Median forward, backward and step() times over `steps` steps (CUDA events between the
    phases; on CPU, nothing)."""
    if not torch.cuda.is_available():
        return {}
    times = []
    for _ in range(steps):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        ev[0].record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        ev[1].record()
        loss.backward()
        ev[2].record()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ev[3].record()
        torch.cuda.synchronize()
        times.append([a.elapsed_time(b) for a, b in zip(ev, ev[1:])])
    med = [sorted(col)[len(col) // 2] for col in zip(*times)]
    return {"fwd_ms": med[0], "bwd_ms": med[1], "opt_ms": med[2]}


def saved_bytes(args) -> list[str]:
    """Bytes of FP8 input codes backward holds, sibling layers (q/k/v, gate/up) sharing one copy
    of their input or not: a 2-layer HF Llama on CPU."""
    from unittest import mock

    import coat_ds
    from coat_ds.linear import shared_input

    model = C.hf_llama("tiny", 128, "cpu", hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, vocab_size=32000)
    coat_ds.convert_to_fp8_linear(model, config=coat_ds.Fp8LinearConfig(fp8_gemm="on"))
    ids = torch.randint(0, 32000, (2, 128))

    def held(share: bool) -> int:
        seen = {}

        def pack(t):
            if t.dtype == torch.uint8:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        codes_for = shared_input.SharedInput.codes_for if share else lambda shared, recipe: None
        with mock.patch.object(shared_input.SharedInput, "codes_for", codes_for), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return sum(seen.values())

    shared, separate = held(True), held(False)
    return ["| FP8 input codes held for backward | bytes |", "|---|---|", f"| shared by siblings | {shared:,} |",
            f"| one copy per layer | {separate:,} |", f"| shared / separate | {shared / separate:.3f} |"]


# The census model: the "tiny" shape's dims (compute negligible) with 110m's 12 layers.
CENSUS_SIDES = ("bf16", "coat_fp8", "coat_fp8_fused")
CENSUS_LAYERS, CENSUS_BS, CENSUS_SEQ = 12, 2, 32


def census_side(side: str, layers: int, reps: int) -> dict:
    """One eager BF16-autocast step of `side` on CPU, every coat_ds kernel on Triton (launched
    through the interpreter, counted but not executed: _census.py): ops and launches counted
    in one step, coat_ds's Python calls profiled in another, host time the median of `reps`
    more. Two warm-up steps first: the first makes the optimizer's state and plans."""
    import _census

    model, opt = build("tiny", side, CENSUS_SEQ, False, backend="triton", dev="cpu", num_hidden_layers=layers)
    ids = torch.randint(0, model.config.vocab_size, (CENSUS_BS, CENSUS_SEQ))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    with _census.Census(ops=False, execute=False):
        for _ in range(2):
            step()
    with _census.Census(execute=False) as counted:
        step()
    calls, own_ms, top = _census.python_calls(step, os.path.join(str(C.TREE), "coat_ds"), execute=False)
    host = []
    for _ in range(reps):
        with _census.Census(ops=False, execute=False) as timed:
            t0 = timed.host_clock()
            step()
            host.append((timed.host_clock() - t0) * 1e3)
    kinds = collections.Counter()
    for op, n in counted.ops.items():
        kinds[_census.kind(op)] += n
    return {"side": side, "layers": layers, "ops": dict(counted.ops), "launches": dict(counted.launches),
            "kinds": dict(kinds), "py_calls": calls, "py_ms": own_ms, "top_py": top[:8],
            "host_ms": sorted(host)[len(host) // 2]}


def census(sides, reps: int) -> tuple[list[dict], list[str]]:
    """Per side, a 12-layer and a 1-layer step; per decoder layer = their difference / 11."""
    os.environ["TRITON_INTERPRET"] = "1"  # read when coat_ds's kernels are defined (imported)
    torch.manual_seed(0)
    results = [census_side(side, n, reps) for side in sides for n in (CENSUS_LAYERS, 1)]
    by = {(r["side"], r["layers"]): r for r in results}

    def per_layer(side, get):
        return (get(by[side, CENSUS_LAYERS]) - get(by[side, 1])) / (CENSUS_LAYERS - 1)

    lines = [f"{side}: coat_ds functions by own time (ms/calls), {CENSUS_LAYERS}-layer step: "
             + ", ".join(f"{n} {ms:.2f}/{c}" for n, c, ms in by[side, CENSUS_LAYERS]["top_py"][:6]) for side in sides]
    return results, lines + census_top_ops(by, sides, per_layer) + census_totals(by, sides, per_layer, reps)


def census_top_ops(by: dict, sides, per_layer, top: int = 24) -> list[str]:
    import _census

    names = collections.Counter()
    for side in sides:
        for key in ("launches", "ops"):
            for op in set(by[side, CENSUS_LAYERS][key]) | set(by[side, 1][key]):
                names[key, op] = max(names[key, op], abs(per_layer(side, lambda r: r[key].get(op, 0))))
    lines = ["", "Per decoder layer, top ops and launches (12-layer step less 1-layer step, / 11):",
             "| op | kind | " + " | ".join(sides) + " |", "|---|---|" + "---|" * len(sides)]
    for (key, op), _ in names.most_common(top):
        what = "launch" if key == "launches" else _census.kind(op)
        lines.append(f"| {op} | {what} | "
                     + " | ".join(f"{per_layer(s, lambda r: r[key].get(op, 0)):.1f}" for s in sides) + " |")
    return lines


def census_totals(by: dict, sides, per_layer, reps: int) -> list[str]:
    lines = ["", f"Eager step, HF Llama {CENSUS_LAYERS} x (hidden 64, intermediate 128), bs {CENSUS_BS} x "
             f"{CENSUS_SEQ}, CPU, kernels launched on Triton's interpreter, not run (host ms: median of {reps}):",
             "| side | per | Triton launches | ops | kernel ops | alloc ops | view ops | custom ops | "
             "coat_ds Python calls | coat_ds own ms | host ms |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    cols = (lambda r: sum(r["launches"].values()), lambda r: sum(r["ops"].values()),
            *(lambda r, k=k: r["kinds"].get(k, 0) for k in ("kernel", "alloc", "view", "custom")),
            lambda r: r["py_calls"], lambda r: r["py_ms"], lambda r: r["host_ms"])
    for side in sides:
        lines.append(f"| {side} | step | " + " | ".join(_num(c(by[side, CENSUS_LAYERS])) for c in cols) + " |")
        lines.append(f"| {side} | layer | " + " | ".join(_num(per_layer(side, c)) for c in cols) + " |")
    return lines


def _num(x) -> str:
    return f"{x:,}" if isinstance(x, int) else f"{x:,.1f}"


def table(results: list[dict]) -> list[str]:
    rows = ["| shape | tree | side | ms/step | tokens/s | vs BF16 | peak GB | vs BF16 peak | fwd / bwd / step() ms |",
            "|---|---|---|---|---|---|---|---|---|"]
    base = {r["shape"]: r for r in results if r["side"] == "bf16" and "ms" in r}
    for r in results:
        if "ms" not in r:
            rows.append(f"| {r['shape']} | {r['tree']} | {r['side']} | failed: {r['error'][:80]} | | | | | |")
            continue
        b = base.get(r["shape"])
        rows.append(f"| {r['shape']} | {r['tree']} | {r['side']} | {r['ms']:.1f} | {r['bs'] * r['seq'] / r['ms'] * 1e3:,.0f} | "
                    + (f"{b['ms'] / r['ms']:.2f}x | {r['peak_gb']:.1f} | {r['peak_gb'] / b['peak_gb']:.2f}x |" if b else
                       f"- | {r['peak_gb']:.1f} | - |")
                    + (f" {r['fwd_ms']:.1f} / {r['bwd_ms']:.1f} / {r['opt_ms']:.1f} |" if "fwd_ms" in r else " |"))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=list(C.SHAPES), nargs="*", default=[])
    ap.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES[:5]))
    ap.add_argument("--ab-sides", nargs="+", choices=SIDES, default=["coat_fp8"], help="with --tree: the sides "
                    "run from both trees (the other sides run from this tree only)")
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--eager", action="store_true", help="no torch.compile")
    ap.add_argument("--profile", nargs="?", type=int, const=70, default=None, metavar="ROWS",
                    help="print each side's top kernels of one step (70 rows, or ROWS)")
    ap.add_argument("--trace", default=None, help="write each side's chrome trace of one step into this folder")
    ap.add_argument("--saved-bytes", action="store_true", help="CPU: FP8 input codes held, shared or not")
    ap.add_argument("--census", action="store_true", help="CPU: ops, Triton launches and coat_ds Python calls of "
                    "one eager step per --sides (default bf16 coat_fp8 coat_fp8_fused), per decoder layer")
    ap.add_argument("--reps", type=int, default=5, help="--census: timed steps per side")
    ap.add_argument("--log-dir", default=None, help="write each side's full output here")
    C.add_common(ap)
    args = ap.parse_args(argv)
    if args.saved_bytes:
        return print("\n".join(saved_bytes(args)))
    if args.census:
        print(C.header(), flush=True)
        sides = args.sides if "--sides" in (sys.argv[1:] if argv is None else argv) else CENSUS_SIDES
        rows, lines = census(sides, args.reps)
        return C.finish(args, "fp8_linear_census", {"rows": rows}, lines)
    if args.child:
        # Which layers the eager size limits send to nn.Linear or leave uncompressed (INFO).
        logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
        logging.getLogger("coat_ds").setLevel(logging.INFO)
        shape, side = args.child.split(":")
        return C.emit(run_side(args, shape, side))
    if not torch.cuda.is_available() and any(s != "tiny" for s in args.shape):
        raise SystemExit("needs a CUDA GPU (or --shape tiny, --census, --saved-bytes)")
    print(C.header(), flush=True)
    argv = C.child_argv(sys.argv[1:] if argv is None else argv)
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
    results = []
    for shape in args.shape:
        for side in args.sides:
            runs = C.trees(args) if side in args.ab_sides else [("this", None)]
            for i, (label, tree) in enumerate(runs):
                log = args.log_dir and f"{args.log_dir}/{shape}_{side}_{label}{i // 2 + 1}.log"
                results.append({"shape": shape, "side": side, "bs": args.bs, "seq": args.seq,
                                **C.run_child(argv, f"{shape}:{side}", tree, log, echo=args.profile),
                                "tree": label, "round": i // 2 + 1})
                print(json.dumps(results[-1]), flush=True)
    C.finish(args, "fp8_linear", {"rows": results}, table(results))


if __name__ == "__main__":
    main()
