"""A/B of the compiled activation path's pack/unpack bodies on the ~1.1B Llama of
act_memory.py: which part of the traced codec costs step time.

Each variant swaps the functions traced.py calls (graph_codec.graph_quantize and
graph_dequantize) and recompiles (Dynamo reset, compile caches off, so that no variant
reuses another's graphs); the BF16 step is re-measured beside each, and variants run in
turns, ROUNDS times, so drift shows as spread. One H100, 10-30 s per variant and round:

    python bench/act_traced_ab.py --rounds 2 --variants graph_codec eager_codec finite_only
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from coat_ds.kernels import graph_codec, reference as ref
from coat_ds.kernels.fp8 import get_format

import act_memory  # bench/ is the script's directory, on sys.path when run as a script


def _quant_finite_only(x, group_size=16, fmt="e4m3"):
    """cad9c1a's body: no non-finite handling (an inf input saturates, a NaN spreads)."""
    fmt = get_format(fmt)
    xg = ref._grouped(x, group_size).to(torch.float32)
    e = ref.act_scale_exponent(xg.abs().amax(-1), fmt)
    codes = ref.encode_fp8(xg * ref.pow2(-e)[..., None], fmt)
    return ref._ungrouped(codes, x.shape).contiguous(), e.to(torch.int8)


def _dequant_finite_only(codes, exps, group_size=16, fmt="e4m3", dtype=torch.float32):
    f = get_format(fmt)
    out_max = torch.finfo(dtype).max
    x = (ref.decode_fp8(ref._grouped(codes, group_size), f) * ref.pow2(exps.to(torch.int32)[..., None]))
    return ref._ungrouped(x.clamp_(-out_max, out_max), codes.shape).to(dtype).contiguous()


def _graph_saturating(x, group_size, fmt):
    """graph_codec without its select for +-inf: leans on Triton's saturating FP8 cast
    (what the select costs; not correct on CPU, where the cast gives NaN)."""
    xg = graph_codec._flat_groups(x, group_size).to(torch.float32)
    mag = xg.view(torch.int32) & 0x7FFFFFFF
    e = graph_codec.graph_scale_exponent(torch.where(mag < 0x7F800000, mag, 0).amax(-1), fmt)
    codes = (xg * ref.pow2(-e)[..., None]).to(fmt.dtype).view(torch.uint8)
    return codes.reshape(-1)[: x.numel()].reshape(x.shape), e.to(torch.int8)


CURRENT = (graph_codec.graph_quantize, graph_codec.graph_dequantize)
VARIANTS = {
    "graph_codec": CURRENT,
    "eager_codec": (ref.act_quantize_rows, ref.act_dequantize_rows),
    "finite_only": (_quant_finite_only, _dequant_finite_only),
    "graph_saturating": (_graph_saturating, CURRENT[1]),
}


def _profile(model, ids, lm_loss, top=8):
    import coat_ds
    from torch.profiler import ProfilerActivity, profile

    handle = coat_ds.compress_activations(model)
    for _ in range(2):
        lm_loss(model(ids)).backward()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        lm_loss(model(ids)).backward()
        torch.cuda.synchronize()
    handle.remove()
    model.zero_grad(set_to_none=True)
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in events) / 1e3
    print(f"    {sum(e.count for e in events)} kernel launches, {total:.1f} ms device time; costliest:")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:top]:
        print(f"      {e.self_device_time_total / 1e3:7.2f} ms {e.count:5d}x  {e.key[:90]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--profile", action="store_true", help="also: kernels launched and device time of one "
                    "compressed step per variant, and its costliest kernels")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = ap.parse_args()
    torch._dynamo.config.automatic_dynamic_shapes = False
    torch._dynamo.config.recompile_limit = 64
    torch._inductor.config.fx_graph_cache = False
    if hasattr(torch._functorch.config, "enable_autograd_cache"):
        torch._functorch.config.enable_autograd_cache = False
    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = act_memory.Llama(32000, 2048, 22, 32, 4, 5632).to(dev, torch.bfloat16)
    for m in model.layers:
        m.compile()
    ids = torch.randint(0, 32000, (args.bs, 2048), device=dev)

    def lm_loss(logits):
        return F.cross_entropy(logits[:, :-1].reshape(-1, 32000).float(), ids[:, 1:].reshape(-1))

    res = {v: [] for v in args.variants}
    for r in range(args.rounds):
        for v in args.variants:
            graph_codec.graph_quantize, graph_codec.graph_dequantize = VARIANTS[v]
            torch._dynamo.reset()
            t0 = time.time()
            out, _ = act_memory._measure(model, lambda: (ids,), lm_loss, args.steps)
            (h0, _, s0, _), (h1, _, s1, _) = out[False], out[True]
            res[v].append((s0, s1, h1 / 2**20))
            print(f"round {r} {v:<15} bf16 {s0:7.1f} ms  fp8 {s1:7.1f} ms  ovh {(s1 / s0 - 1) * 100:5.1f}%  "
                  f"held {h1 / 2**20:7.0f} MiB  ({time.time() - t0:.0f} s)", flush=True)
            if args.profile and r == 0:
                _profile(model, ids, lm_loss)
    graph_codec.graph_quantize, graph_codec.graph_dequantize = CURRENT
    print(f"\n# {torch.cuda.get_device_name()}, Llama 1.1B bs {args.bs} seq 2048, compiled layers")
    print(f"| variant | ovh % per round | median | fp8 held MiB |")
    print("|---|---|---|---|")
    for v, rows in res.items():
        ovh = [(s1 / s0 - 1) * 100 for s0, s1, _ in rows]
        print(f"| {v} | {' / '.join(f'{o:.1f}' for o in ovh)} | {statistics.median(ovh):.1f} | {rows[-1][2]:.0f} |")


if __name__ == "__main__":
    main()
