"""GPU benchmark of FP8 activation compression (coat_ds.compress_activations).

Measures, BF16 vs compressed, on one Llama-2-7B-style decoder layer (hidden 4096, seq 2048)
and a ~1.1B Llama model:
  * activation memory = bytes still allocated when forward returns, minus what was
    allocated before it: what autograd holds for backward (plus the output), i.e. what
    the hooks compress. This is the figure the >= 1.65x target is about;
  * forward peak, separately: it adds the transient working set of the last ops (for one
    layer the MLP's gate/up/product tensors, alive together for a moment, in BF16 in both
    runs, plus the BF16 original of a tensor while its FP8 copy is written). Compression
    cannot shrink that part, so on a single layer it dilutes the ratio; over many layers
    the held activations dominate and the two ratios meet;
  * the hooks' exact ledger (saved-for-backward bytes with and without compression);
  * the training-step time (forward + backward), median of several steps taken in turns
    with the BF16 ones, and overhead;
  * kernels: device time per call with the GPU queue kept full (so host launch latency is
    not counted), as GB/s and % of a measured device-to-device copy; and host time per
    call (launch cost: what each saved tensor costs the CPU).
Runs in well under 3 minutes on one H100:

    python bench/act_memory.py              # everything
    python bench/act_memory.py --quick      # fewer timing repetitions
    python bench/act_memory.py --profile    # plus a torch.profiler table of one compressed
                                            # step of the 1.1B model (top CUDA and CPU ops)
    python bench/act_memory.py --compile    # every decoder layer under torch.compile, both
                                            # runs: FP8 quantization inlined into the graphs
"""
from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

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


def _measure(model, make_inputs, loss_fn, steps: int, ops=None):
    """Both sides on one model, through one handle switched on and off: {compress: (bytes
    held after forward, forward peak bytes, step ms, host ms)} and the FP8 step's hook stats.

    Memory comes from one step of each side; times from `steps` rounds of one BF16 and one
    FP8 step, the order swapped every round, so that a drifting clock or a warming GPU
    weighs on both sides alike. Host ms is the time until backward() returns, before the
    final sync: close to the step time, the host (Python, launches) sets the pace. `ops`
    replaces the activation kernels (the --profile breakdown)."""
    handle = coat_ds.compress_activations(model, config=ActivationConfig())
    if ops is not None:
        handle.compressor._ops[torch.cuda.current_device()] = ops
    inputs = make_inputs()

    def step(compress):
        handle.enabled = compress  # compiled layers hold a graph for each (Dynamo guards on the hooks)
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        handle.reset_stats()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = model(*inputs)
        # Memory is read after the step (reading it here would need a sync inside the
        # timed step): the allocator's counters are host-side, exact at forward's end.
        held = torch.cuda.memory_allocated() - before
        peak = torch.cuda.max_memory_allocated() - before
        loss_fn(out).backward()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        return held, peak, (time.perf_counter() - t0) * 1e3, (t1 - t0) * 1e3

    for _ in range(2):  # compile and warm up both sides
        step(False)
        step(True)
    mem = {False: step(False)[:2], True: step(True)[:2]}
    stats = handle.stats()
    times = {False: [], True: []}
    for i in range(steps):
        for compress in ((False, True) if i % 2 == 0 else (True, False)):
            times[compress].append(step(compress)[2:])
    handle.remove()
    model.zero_grad(set_to_none=True)
    return {c: (*mem[c], statistics.median(t for t, _ in times[c]), statistics.median(h for _, h in times[c]))
            for c in (False, True)}, stats


def bench_model(name, model, make_inputs, loss_fn, steps):
    res, st = _measure(model, make_inputs, loss_fn, steps)
    (h0, p0, t0, c0), (h1, p1, t1, c1) = res[False], res[True]
    mib = 2**20
    return [(name, h0 / mib, h1 / mib, h0 / h1, p0 / mib, p1 / mib, p0 / p1, t0, t1, (t1 / t0 - 1) * 100, c0, c1,
             st.uncompressed_bytes / mib, st.compressed_bytes / mib, st.compressed_tensors)]


def _stub_ops():
    """Activation kernels replaced by their output allocations alone: what is left of the
    compressed step's host time is the hooks' Python and the allocator."""
    def empty_like(t, dtype):
        return torch.empty(t.shape, dtype=dtype, device=t.device)

    return SimpleNamespace(
        name="stub",
        quantize_tensor=lambda x, fmt="e4m3": (empty_like(x, torch.uint8), torch.zeros((), dtype=torch.int32,
                                                                                      device=x.device)),
        quantize_rows=lambda x, g=16, fmt="e4m3": (empty_like(x, torch.uint8), torch.empty(
            x.numel() // x.shape[-1], -(-x.shape[-1] // g), dtype=torch.int8, device=x.device)),
        dequantize_tensor=lambda c, e, fmt="e4m3", dtype=torch.float32: empty_like(c, dtype),
        dequantize_rows=lambda c, e, g=16, fmt="e4m3", dtype=torch.float32: empty_like(c, dtype))


def _host_breakdown(model, ids, loss_fn, steps):
    """Step and host ms of the 1.1B model: BF16, compressed, and compressed with the
    kernels stubbed out (hooks + allocations only)."""
    print("\n## Host breakdown, 1.1B model (ms per step: step / host until backward() returns)")
    res, _ = _measure(model, lambda: (ids,), loss_fn, steps)
    stubbed, _ = _measure(model, lambda: (ids,), loss_fn, steps, _stub_ops())
    for name, (_, _, t, c) in (("bf16", res[False]), ("fp8", res[True]), ("fp8, kernels stubbed", stubbed[True])):
        print(f"{name:<24}{t:>9.1f}{c:>9.1f}")


def _device_ms(fn, reps):
    """Device time per call: a sleep kernel holds the GPU while the host enqueues all the
    calls, so the events bracket GPU work only, not launch latency."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(200_000_000)  # ~0.1 s: far longer than enqueueing `reps` calls
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def _host_us(fn, reps=100, batches=7):
    """Host time per call on a tiny tensor (the GPU finishes each call before the next is
    enqueued, so this is launch and Python cost): median over batches, as a shared host's
    timings jump from batch to batch."""
    fn()
    per_batch = []
    for _ in range(batches):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        per_batch.append((time.perf_counter() - t0) / reps * 1e6)
    torch.cuda.synchronize()
    return statistics.median(per_batch)


def _kernel_cases(ops, x):
    n = x.numel()
    codes, exps = ops.quantize_rows(x, 16)
    tcodes, texp = ops.quantize_tensor(x)
    return [
        # (name, fn, bytes moved)
        ("quantize 1x16", lambda: ops.quantize_rows(x, 16), n * 2 + n + n // 16),
        ("dequantize 1x16", lambda: ops.dequantize_rows(codes, exps, 16, "e4m3", torch.bfloat16),
         n + n // 16 + n * 2),
        # per-tensor reads x twice: the max, then the quantizer.
        ("quantize tensor", lambda: ops.quantize_tensor(x), n * 2 * 2 + n),
        ("dequantize tensor", lambda: ops.dequantize_tensor(tcodes, texp, "e4m3", torch.bfloat16), n + n * 2),
    ]


def bench_kernels(reps):
    ops = get_act_ops(torch.device("cuda"), "triton")
    x = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16)  # 64M elements, 128 MiB
    n = x.numel()
    y = torch.empty_like(x)
    copy_ms = _device_ms(lambda: y.copy_(x), reps)
    copy_gbs = 2 * n * 2 / copy_ms / 1e6
    small = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    small_out = torch.empty_like(small)
    rows = [("d2d copy (bf16)", copy_ms, copy_gbs, 100.0, _host_us(lambda: small_out.copy_(small)))]
    for (name, fn, nbytes), (_, small_fn, _) in zip(_kernel_cases(ops, x), _kernel_cases(ops, small)):
        ms = _device_ms(fn, reps)
        gbs = nbytes / ms / 1e6
        rows.append((name, ms, gbs, 100 * gbs / copy_gbs, _host_us(small_fn)))
    return rows


def _profile_step(model, ids, loss_fn):
    """torch.profiler table of one compressed training step, hooks labelled."""
    from torch.profiler import ProfilerActivity, profile, record_function

    handle = coat_ds.compress_activations(model, config=ActivationConfig())
    comp = handle.compressor
    pack, unpack = comp.pack, comp.unpack

    def labelled_pack(t):
        with record_function("coat_ds.pack"):
            return pack(t)

    def labelled_unpack(s):
        with record_function("coat_ds.unpack"):
            return unpack(s)

    comp.pack, comp.unpack = labelled_pack, labelled_unpack

    def step():
        model.zero_grad(set_to_none=True)
        loss_fn(model(ids)).backward()

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    handle.remove()
    model.zero_grad(set_to_none=True)
    avg = prof.key_averages()
    for key in ("self_device_time_total", "self_cuda_time_total"):
        try:
            print("\n## Profile, one compressed step of the 1.1B model: top device time")
            print(avg.table(sort_by=key, row_limit=25, max_name_column_width=60))
            break
        except (AttributeError, KeyError, ValueError):
            continue
    print("\n## Same step: top host (self CPU) time")
    print(avg.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--profile", action="store_true", help="also profile one compressed step of the 1.1B model")
    ap.add_argument("--bs", type=int, nargs="+", default=[2], help="batch sizes of the 1.1B model (larger: less "
                    "host-bound); the profile uses the last")
    ap.add_argument("--steps", type=int, default=None, help="timed rounds of one BF16 and one FP8 step (default 6, 3 with --quick)")
    ap.add_argument("--layer-bs", type=int, nargs="+", default=[1], help="batch sizes of the 7B layer")
    ap.add_argument("--compile", action="store_true",
                    help="compile every decoder layer (torch.compile, in place) in both the BF16 and the FP8 run; "
                         "the quantization is then inlined into the compiled graphs (the ledger sees none of it)")
    args = ap.parse_args()
    compiled = " (compiled)" if args.compile else ""

    if args.compile:
        # One compiled graph per (shape, hooks in force), all layers sharing it; without
        # this, the second shape seen would recompile with symbolic sizes.
        torch._dynamo.config.automatic_dynamic_shapes = False
        torch._dynamo.config.recompile_limit = 64

    def maybe_compile(layers):
        # In place, so the hooks' region (the model or layer) stays the module that runs.
        for m in layers if args.compile else ():
            m.compile()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    steps, reps = (3, 20) if args.quick else (6, 50)
    steps = args.steps or steps
    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    t_start = time.time()

    kern = bench_kernels(reps)

    layer = DecoderLayer(4096, 32, 32, 11008).to(dev, dt)
    maybe_compile([layer])
    cos, sin = rope_tables(2048, 128, dt, dev)
    rows = []
    for bs in args.layer_bs:
        def layer_inputs(bs=bs):
            return (torch.randn(bs, 2048, 4096, device=dev, dtype=dt, requires_grad=True), cos, sin)

        rows += bench_model(f"Llama-2-7B layer, seq 2048, bs {bs}{compiled}", layer, layer_inputs,
                            lambda o: o.float().pow(2).mean(), steps)
    del layer
    torch.cuda.empty_cache()

    # ~1.1B parameters (TinyLlama-1.1B shape): 22 layers, hidden 2048, GQA 32/4, MLP 5632.
    model = Llama(32000, 2048, 22, 32, 4, 5632).to(dev, dt)
    maybe_compile(model.layers)
    n_params = sum(p.numel() for p in model.parameters())
    for bs in args.bs:
        ids = torch.randint(0, 32000, (bs, 2048), device=dev)

        def lm_loss(logits, ids=ids):
            return F.cross_entropy(logits[:, :-1].reshape(-1, 32000).float(), ids[:, 1:].reshape(-1))

        rows += bench_model(f"Llama {n_params / 1e9:.2f}B, seq 2048, bs {bs}{compiled}", model, lambda: (ids,), lm_loss,
                            steps)

    print(f"\n# device: {torch.cuda.get_device_name()}  (bench took {time.time() - t_start:.0f} s)")
    print("\n## Activation kernels, 64M BF16 elements (device time, queue full) and host time per call")
    print(f"{'kernel':<20}{'ms':>9}{'GB/s':>9}{'% copy':>9}{'host us':>10}")
    for name, ms, gbs, pct, host in kern:
        print(f"{name:<20}{ms:>9.3f}{gbs:>9.0f}{pct:>9.1f}{host:>10.1f}")
    print("\n## Activation memory (MiB): held for backward after forward (the target), forward peak; "
          "step time (ms)")
    print(f"{'model':<46}{'act bf16':>9}{'fp8':>7}{'x less':>7}{'peak bf16':>10}{'fp8':>7}{'x less':>7}"
          f"{'step bf16':>10}{'fp8':>7}{'ovh %':>7}{'host bf16':>10}{'fp8':>7}{'ledger bf16':>12}{'fp8':>7}"
          f"{'tensors':>8}")
    for r in rows:
        print(f"{r[0]:<46}{r[1]:>9.0f}{r[2]:>7.0f}{r[3]:>7.2f}{r[4]:>10.0f}{r[5]:>7.0f}{r[6]:>7.2f}"
              f"{r[7]:>10.1f}{r[8]:>7.1f}{r[9]:>7.1f}{r[10]:>10.1f}{r[11]:>7.1f}{r[12]:>12.0f}{r[13]:>7.0f}{r[14]:>8d}")
    if args.profile:
        _host_breakdown(model, ids, lm_loss, steps)
        _profile_step(model, ids, lm_loss)


if __name__ == "__main__":
    main()
