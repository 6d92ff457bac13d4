"""GPU benchmark of FP8 activation compression (coat_ds.compress_activations).

Measures, BF16 vs compressed:
  * one Llama-2-7B-style decoder layer (hidden 4096, seq 2048) and a ~1.1B Llama model:
    activation memory = peak allocated during forward minus what was allocated before it
    (weights, input), memory still held after forward, and the exact saved-for-backward
    bytes from the hooks' ledger;
  * the full training-step time (forward + backward), median of several steps;
  * quantize / dequantize kernel bandwidth against a measured device-to-device copy.
Prints a short table last. Runs in well under 3 minutes on one H100:

    python bench/act_memory.py            # everything
    python bench/act_memory.py --quick    # fewer timing repetitions
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import coat_ds
from coat_ds import ActivationConfig
from coat_ds.kernels.act_ops import get_act_ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def _rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class DecoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.input_layernorm = RMSNorm(dim)
        self.q_proj = nn.Linear(dim, heads * self.hd, bias=False)
        self.k_proj = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.v_proj = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.o_proj = nn.Linear(heads * self.hd, dim, bias=False)
        self.post_attention_layernorm = RMSNorm(dim)
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(b, s, self.heads, self.hd).transpose(1, 2)
        k = self.k_proj(h).view(b, s, self.kv_heads, self.hd).transpose(1, 2)
        v = self.v_proj(h).view(b, s, self.kv_heads, self.hd).transpose(1, 2)
        k, v = _rope(k, cos, sin), v
        if self.kv_heads != self.heads:
            # Expanded as Hugging Face's Llama does, so that every SDPA backend takes it.
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        o = F.scaled_dot_product_attention(_rope(q, cos, sin), k, v, is_causal=True)
        x = x + self.o_proj(o.transpose(1, 2).reshape(b, s, -1))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


def rope_tables(seq: int, head_dim: int, dtype, device):
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    ang = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


class Llama(nn.Module):
    def __init__(self, vocab, dim, layers, heads, kv_heads, hidden):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(DecoderLayer(dim, heads, kv_heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.hd = dim // heads

    def forward(self, ids):
        x = self.embed_tokens(ids)
        cos, sin = rope_tables(ids.shape[1], self.hd, x.dtype, ids.device)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def _measure(model, make_inputs, loss_fn, compress: bool, steps: int):
    """(forward activation peak bytes, bytes held after forward, step ms, hook stats)."""
    handle = coat_ds.compress_activations(model, config=ActivationConfig()) if compress else None
    inputs = make_inputs()
    times = []
    for i in range(steps + 2):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if handle is not None:
            handle.reset_stats()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = model(*inputs)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        held = torch.cuda.memory_allocated() - before
        stats = handle.stats() if handle is not None else None
        loss_fn(out).backward()
        torch.cuda.synchronize()
        if i >= 2:
            times.append((time.perf_counter() - t0) * 1e3)
        del out
    if handle is not None:
        handle.remove()
    model.zero_grad(set_to_none=True)
    return peak, held, statistics.median(times), stats


def bench_model(name, model, make_inputs, loss_fn, steps):
    rows = []
    res = {c: _measure(model, make_inputs, loss_fn, c, steps) for c in (False, True)}
    (p0, h0, t0, _), (p1, h1, t1, st) = res[False], res[True]
    rows.append((name, p0 / 2**20, p1 / 2**20, p0 / p1, h0 / 2**20, h1 / 2**20, t0, t1, (t1 / t0 - 1) * 100,
                 st.uncompressed_bytes / 2**20, st.compressed_bytes / 2**20))
    return rows


def _time_ms(fn, reps):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        ts.append(start.elapsed_time(end))
    return statistics.median(ts)


def bench_kernels(reps):
    ops = get_act_ops(torch.device("cuda"), "triton")
    n_rows, cols = 16384, 4096  # 64M elements, 128 MiB in BF16
    x = torch.randn(n_rows, cols, device="cuda", dtype=torch.bfloat16)
    n = x.numel()
    y = torch.empty_like(x)
    copy_ms = _time_ms(lambda: y.copy_(x), reps)
    copy_gbs = 2 * n * 2 / copy_ms / 1e6
    codes, exps = ops.quantize_rows(x, 16)
    tcodes, texp = ops.quantize_tensor(x)
    cases = [
        # (name, fn, bytes moved)
        ("quantize 1x16", lambda: ops.quantize_rows(x, 16), n * 2 + n + n // 16),
        ("dequantize 1x16", lambda: ops.dequantize_rows(codes, exps, 16, "e4m3", torch.bfloat16), n + n // 16 + n * 2),
        # per-tensor reads x twice: the two-stage max, then the quantizer.
        ("quantize tensor", lambda: ops.quantize_tensor(x), n * 2 * 2 + n),
        ("dequantize tensor", lambda: ops.dequantize_tensor(tcodes, texp, "e4m3", torch.bfloat16), n + n * 2),
    ]
    rows = [("d2d copy (bf16)", copy_ms, copy_gbs, 100.0)]
    for name, fn, nbytes in cases:
        ms = _time_ms(fn, reps)
        gbs = nbytes / ms / 1e6
        rows.append((name, ms, gbs, 100 * gbs / copy_gbs))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    steps, reps = (3, 10) if args.quick else (6, 30)
    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    t_start = time.time()

    kern = bench_kernels(reps)

    layer = DecoderLayer(4096, 32, 32, 11008).to(dev, dt)
    cos, sin = rope_tables(2048, 128, dt, dev)

    def layer_inputs():
        return (torch.randn(1, 2048, 4096, device=dev, dtype=dt, requires_grad=True), cos, sin)

    rows = bench_model("Llama-2-7B layer, seq 2048, bs 1", layer, layer_inputs, lambda o: o.float().pow(2).mean(),
                       steps)
    del layer
    torch.cuda.empty_cache()

    # ~1.1B parameters (TinyLlama-1.1B shape): 22 layers, hidden 2048, GQA 32/4, MLP 5632.
    model = Llama(32000, 2048, 22, 32, 4, 5632).to(dev, dt)
    n_params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, 32000, (2, 2048), device=dev)

    def lm_loss(logits):
        return F.cross_entropy(logits[:, :-1].reshape(-1, 32000).float(), ids[:, 1:].reshape(-1))

    rows += bench_model(f"Llama {n_params / 1e9:.2f}B, seq 2048, bs 2", model, lambda: (ids,), lm_loss, steps)

    print(f"\n# device: {torch.cuda.get_device_name()}  (bench took {time.time() - t_start:.0f} s)")
    print("\n## Activation kernels, 64M BF16 elements")
    print(f"{'kernel':<20}{'ms':>9}{'GB/s':>9}{'% copy':>9}")
    for name, ms, gbs, pct in kern:
        print(f"{name:<20}{ms:>9.3f}{gbs:>9.0f}{pct:>9.1f}")
    print("\n## Activation memory (MiB) and step time (ms): BF16 vs FP8-compressed")
    print(f"{'model':<36}{'fwd peak bf16':>14}{'fp8':>8}{'x less':>8}{'held bf16':>11}{'fp8':>8}"
          f"{'step bf16':>11}{'fp8':>8}{'ovh %':>7}{'hooks bf16':>12}{'fp8':>8}")
    for r in rows:
        print(f"{r[0]:<36}{r[1]:>14.0f}{r[2]:>8.0f}{r[3]:>8.2f}{r[4]:>11.0f}{r[5]:>8.0f}"
              f"{r[6]:>11.1f}{r[7]:>8.1f}{r[8]:>7.1f}{r[9]:>12.0f}{r[10]:>8.0f}")


if __name__ == "__main__":
    main()
