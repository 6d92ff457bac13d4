"""Where the compiled FP8 activation overhead goes: GPU kernels of one training step of the
~1.1B Llama from act_memory.py, every decoder layer compiled, BF16 vs FP8 activations.

    python bench/act_compiled_profile.py --bs 4
    TORCH_LOGS=output_code TORCH_LOGS_OUT=code.txt python bench/act_compiled_profile.py   # plus Inductor's code

Four sides, each with its own compiled graphs:
  bf16            torch's defaults (the baseline);
  bf16+recompute  the partitioner option FP8 regions set (ban_recompute_materialized_backward
                  off), applied to BF16 too: what the option alone does;
  fp8 (saved)     FP8 activations with compiled_recompute=False;
  fp8             FP8 activations, defaults.
Per side: median step time (forward + backward), memory held after forward, and a
torch.profiler table of one step's CUDA kernels grouped by name; then the kernels whose
time grew most from bf16 to fp8, and a summary table last.
"""
from __future__ import annotations

import argparse
import ast
import collections
import statistics
import time

import torch
import torch._functorch.config
import torch._inductor.config as inductor_config
import torch.nn.functional as F

import coat_ds
from act_memory import Llama


def _kernels(step) -> dict[str, tuple[int, float]]:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    table = collections.defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            row = table[ev.name]
            row[0] += 1
            row[1] += ev.device_time_total / 1e3
    return {k: (n, ms) for k, (n, ms) in table.items()}


SIDES = {
    "bf16": (None, {}),
    "bf16+recompute": (None, {"ban_recompute_materialized_backward": False}),
    "fp8 (saved)": (coat_ds.ActivationConfig(compiled_recompute=False), {}),
    "fp8": (coat_ds.ActivationConfig(), {}),
}


def _side(model, ids, name: str, steps: int):
    config, functorch = SIDES[name]
    torch._dynamo.reset()  # each side compiles its own graphs
    handle = coat_ds.compress_activations(model, config=config) if config is not None else None
    held = []

    def step():
        model.zero_grad(set_to_none=True)
        before = torch.cuda.memory_allocated()
        logits = model(ids)
        held.append(torch.cuda.memory_allocated() - before - logits.numel() * logits.element_size())
        F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1)).backward()

    with torch._functorch.config.patch(functorch):
        for _ in range(3):
            step()
        times = []
        for _ in range(steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        kernels = _kernels(step)
    if handle is not None:
        handle.remove()
    model.zero_grad(set_to_none=True)
    return statistics.median(times), held[-1], kernels


def _short(name: str, width: int = 90) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--inductor", nargs="*", default=[], metavar="KEY=VALUE",
                    help="torch._inductor.config settings for both sides, e.g. aggressive_fusion=True")
    args = ap.parse_args()
    for item in args.inductor:
        key, value = item.split("=", 1)
        obj = inductor_config
        *path, leaf = key.split(".")
        for part in path:
            obj = getattr(obj, part)
        getattr(obj, leaf)  # an unknown key fails here, not silently
        setattr(obj, leaf, ast.literal_eval(value))
        print(f"inductor config {key} = {getattr(obj, leaf)!r}")
    torch._dynamo.config.automatic_dynamic_shapes = False
    torch._dynamo.config.recompile_limit = 64
    torch.manual_seed(0)
    model = Llama(32000, 2048, args.layers, 32, 4, 5632).to("cuda", torch.bfloat16)
    for layer in model.layers:
        layer.compile()
    ids = torch.randint(0, 32000, (args.bs, 2048), device="cuda")
    res = {name: _side(model, ids, name, args.steps) for name in SIDES}
    for name, (ms, _, kern) in res.items():
        total = sum(t for _, t in kern.values())
        print(f"\n## {name}: step {ms:.1f} ms (median of {args.steps}); kernels {total:.1f} ms in "
              f"{sum(n for n, _ in kern.values())} launches")
        print(f"{'calls':>6}{'ms':>9}  kernel")
        for k, (n, t) in sorted(kern.items(), key=lambda kv: -kv[1][1])[: args.top]:
            print(f"{n:>6}{t:>9.2f}  {_short(k)}")
    (ms0, _, k0), (ms1, _, k1) = res["bf16"], res["fp8"]
    print(f"\n## growth bf16 -> fp8: step {ms0:.1f} -> {ms1:.1f} ms ({(ms1 / ms0 - 1) * 100:+.1f}%), kernels "
          f"{sum(t for _, t in k0.values()):.1f} -> {sum(t for _, t in k1.values()):.1f} ms")
    names = set(k0) | set(k1)
    delta = sorted(((k1.get(k, (0, 0.0))[1] - k0.get(k, (0, 0.0))[1], k) for k in names), reverse=True)
    print(f"{'d ms':>8}{'bf16':>8}{'fp8':>8}{'calls':>7}  kernel")
    for d, k in delta[: args.top]:
        print(f"{d:>8.2f}{k0.get(k, (0, 0.0))[1]:>8.2f}{k1.get(k, (0, 0.0))[1]:>8.2f}{k1.get(k, (0, 0))[0]:>7}  {_short(k)}")
    print("largest decreases:")
    for d, k in delta[-8:]:
        print(f"{d:>8.2f}{k0.get(k, (0, 0.0))[1]:>8.2f}{k1.get(k, (0, 0.0))[1]:>8.2f}{k1.get(k, (0, 0))[0]:>7}  {_short(k)}")
    ms_base, held_base, _ = res["bf16"]
    print(f"\n## Summary: Llama 1.1B, seq 2048, bs {args.bs}, every layer compiled ({torch.cuda.get_device_name()})")
    print(f"{'side':<16}{'step ms':>9}{'vs bf16':>9}{'held MiB':>10}{'x less':>8}{'kernel ms':>11}{'launches':>10}")
    for name, (ms, held, kern) in res.items():
        print(f"{name:<16}{ms:>9.1f}{(ms / ms_base - 1) * 100:>+8.1f}%{held / 2**20:>10.0f}{held_base / held:>8.2f}"
              f"{sum(t for _, t in kern.values()):>11.1f}{sum(n for n, _ in kern.values()):>10}")


if __name__ == "__main__":
    main()
