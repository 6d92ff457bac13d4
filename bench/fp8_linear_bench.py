"""FP8 linear layers end to end: HF LlamaForCausalLM (from a config, nothing downloaded), FP32
master weights + BF16 autocast, every decoder layer compiled, one training step timed per
side, each side in a fresh process (honest peaks), plus a microbenchmark of the
quantize/transpose kernels against copy bandwidth.

    python bench/fp8_linear_bench.py --shape 7b            # every side, then the table
    python bench/fp8_linear_bench.py --shape 1b --sides bf16 coat_fp8
    python bench/fp8_linear_bench.py --kernels             # quantize/transpose vs copy
    python bench/fp8_linear_bench.py --shape 7b --side coat_fp8 --profile   # one side, top kernels
    python bench/fp8_linear_bench.py --shape 7b --side coat_fp8 --trace t.json.gz   # then bench/gpu_gaps.py

Sides: bf16 (torch AdamW fused), bf16_ckpt (+ full activation checkpointing), torchao
(float8 tensorwise linears + torch AdamW), coat (CoatAdamW + compress_activations),
coat_fp8 (coat + convert_to_fp8_linear; compiled, its casts are Inductor's from the torch twins),
coat_fp8_triton (the same with our Triton quantize/transpose kernels as custom ops),
coat_fp8_keepw (coat_fp8 with keep_weight_codes: backward reads forward's FP8 weight)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

SHAPES = {
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32,
               num_hidden_layers=6, vocab_size=32000),
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=16, num_key_value_heads=16,
               num_hidden_layers=16, vocab_size=32000),
}
SIDES = ("bf16", "bf16_ckpt", "torchao", "coat", "coat_fp8", "coat_fp8_triton", "coat_fp8_keepw")


def _layers_filter(m, fqn: str) -> bool:
    parts = fqn.split(".")
    return len(parts) == 3 and parts[:2] == ["model", "layers"]


def _build(shape: str, side: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    import coat_ds

    cfg = LlamaConfig(**SHAPES[shape], max_position_embeddings=2048, attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    if side == "bf16_ckpt":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if side == "torchao":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig(),
                                   module_filter_fn=lambda m, fqn: fqn != "lm_head")
    if side.startswith("coat_fp8"):
        backend = "triton" if side == "coat_fp8_triton" else "auto"
        coat_ds.convert_to_fp8_linear(model, config=coat_ds.Fp8LinearConfig(
            backend=backend, keep_weight_codes=side == "coat_fp8_keepw"))
    if side.startswith("coat"):
        coat_ds.compress_activations(model, module_filter_fn=_layers_filter)
        opt = coat_ds.CoatAdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=True)
    for layer in model.model.layers:
        layer.compile()
    return model, opt


def run_side(shape: str, side: str, bs: int, seq: int, steps: int, profile: bool, trace: str | None = None) -> dict:
    import logging

    logging.basicConfig(level=logging.INFO)
    torch._dynamo.config.automatic_dynamic_shapes = False
    torch._dynamo.config.recompile_limit = 64
    model, opt = _build(shape, side)
    ids = torch.randint(0, SHAPES[shape]["vocab_size"], (bs, seq), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    t0 = time.perf_counter()
    for _ in range(3):
        loss = step()
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        loss = step()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    out = {"shape": shape, "side": side, "bs": bs, "seq": seq, "ms": times[len(times) // 2],
           "peak_gb": torch.cuda.max_memory_allocated() / 1e9, "loss": float(loss), "warmup_s": warm_s,
           "params": sum(p.numel() for p in model.parameters())}
    if profile or trace:
        from torch.profiler import ProfilerActivity, profile as prof
    if profile:
        with prof(activities=[ProfilerActivity.CUDA]) as p:
            step()
            torch.cuda.synchronize()
        print(p.key_averages().table(sort_by="cuda_time_total", row_limit=70, max_name_column_width=220), flush=True)
    if trace:
        with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            step()
            torch.cuda.synchronize()
        p.export_chrome_trace(trace)
    return out


def _device_ms(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def bench_kernels() -> list[str]:
    """Quantize(+transpose) time against a same-size copy; GB/s counts each byte the
    kernels must move once (read x, write the codes): the amax pass reads x a second time,
    a held exponent guess (a weight's path) does not."""
    from coat_ds.kernels import reference
    from coat_ds.kernels.fp8_linear import linear_quantize, new_guess

    rows = ["| tensor | layouts | ours us | GB/s (unique bytes) | copy us | copy GB/s | ours/copy bandwidth | torch twin eager us |",
            "|---|---|---|---|---|---|---|---|"]
    cases = [("x 16384x4096 bf16", (16384, 4096), torch.bfloat16), ("x 16384x11008 bf16", (16384, 11008), torch.bfloat16),
             ("W 11008x4096 fp32", (11008, 4096), torch.float32), ("g 16384x4096 bf16", (16384, 4096), torch.bfloat16)]
    for name, shape, dtype in cases:
        x = torch.randn(shape, device="cuda", dtype=dtype)
        copy_ms = _device_ms(lambda: x.clone())
        copy_bw = 2 * x.numel() * x.element_size() / copy_ms / 1e6
        # "guessed": a weight's path, starting from the exponent it had last time (it holds).
        held = new_guess(reference.linear_quantize(x, "e4m3")[2])
        for rowwise, transposed, label, guess in ((True, False, "row", None), (False, True, "transposed", None),
                                                  (True, True, "both", None), (True, True, "both, guessed", held)):
            ms = _device_ms(lambda: linear_quantize(x, "e4m3", rowwise, transposed, guess=guess))
            twin = _device_ms(lambda: reference.linear_quantize(x, "e4m3", rowwise, transposed), 5)
            moved = x.numel() * (x.element_size() + rowwise + transposed)
            bw = moved / ms / 1e6
            rows.append(f"| {name} | {label} | {ms * 1e3:.0f} | {bw:.0f} | {copy_ms * 1e3:.0f} | {copy_bw:.0f} | "
                        f"{bw / copy_bw:.2f} | {twin * 1e3:.0f} |")
        # Hardware and interpreter/twin agree on the codes (the GPU casts with cvt.rn.satfinite).
        got, want = linear_quantize(x, "e4m3", True, True), reference.linear_quantize(x, "e4m3", True, True)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and int(got[2]) == int(want[2]), name
    return rows


def _table(results: list[dict]) -> list[str]:
    rows = ["| shape | side | micro-batch | ms/step | tokens/s | vs BF16 | peak GB | vs BF16 peak |",
            "|---|---|---|---|---|---|---|---|"]
    base = {r["shape"]: r for r in results if r["side"] == "bf16" and "ms" in r}
    for r in results:
        if "ms" not in r:
            rows.append(f"| {r['shape']} | {r['side']} | {r['bs']} | failed: {r['error'][:80]} | | | | |")
            continue
        tps = r["bs"] * r["seq"] / r["ms"] * 1e3
        b = base.get(r["shape"])
        ratio = f"{b['ms'] / r['ms']:.2f}x" if b else "-"
        mem = f"{r['peak_gb'] / b['peak_gb']:.2f}x" if b else "-"
        rows.append(f"| {r['shape']} | {r['side']} | {r['bs']} | {r['ms']:.1f} | {tps:,.0f} | {ratio} | "
                    f"{r['peak_gb']:.1f} | {mem} |")
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=list(SHAPES), nargs="*", default=[])
    ap.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES[:5]))
    ap.add_argument("--side", choices=SIDES, help="run this one side in this process and print its JSON")
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--profile", action="store_true", help="with --side: print the top CUDA kernels of one step")
    ap.add_argument("--trace", default=None,
                    help="with --side: write one step's CPU+CUDA chrome trace here (.json.gz); see bench/gpu_gaps.py")
    ap.add_argument("--kernels", action="store_true", help="microbenchmark the quantize/transpose kernels")
    ap.add_argument("--log-dir", default=None, help="write each side's full output here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    if args.side:
        res = run_side(args.shape[0], args.side, args.bs, args.seq, args.steps, args.profile, args.trace)
        print("RESULT " + json.dumps(res), flush=True)
        return
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    lines = bench_kernels() if args.kernels else []
    if lines:
        print("\n".join(lines), flush=True)
    results = []
    for shape in args.shape:
        for side in args.sides:
            cmd = [sys.executable, __file__, "--shape", shape, "--side", side, "--bs", str(args.bs), "--seq",
                   str(args.seq), "--steps", str(args.steps)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if args.log_dir:
                os.makedirs(args.log_dir, exist_ok=True)
                with open(os.path.join(args.log_dir, f"{shape}_{side}.log"), "w") as f:
                    f.write(proc.stdout + proc.stderr)
            found = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if found:
                results.append(json.loads(found[-1][7:]))
            else:
                err = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                results.append({"shape": shape, "side": side, "bs": args.bs, "error": err})
            print(json.dumps(results[-1]), flush=True)
    if results:
        print("\n".join(_table(results)))


if __name__ == "__main__":
    main()
