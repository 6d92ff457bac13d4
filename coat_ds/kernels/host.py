"""AdamW in torch ops (the registry's "torch" kernels of op "adamw", adamw.py): the pure-torch
twin of the fused step, and the step on host tensors (ZeRO-Offload, CPU training) built on it.

The twin, `adamw_step`, computes what the Triton kernel computes, per group, in the same
order where it decides a result; it is the CPU path and the tests' oracle.

The host step, `host_step`: the fused C++ kernel (host_adamw.cpp, built on first use by
host_native.py) runs the step group by group: it reads each element's parameter, gradient
and moment codes once, keeps a group's ~6 x G floats of scratch per thread and writes the
results back, computing what the twin computes in the same float32 operations
(tests/test_host_kernel.py holds the two together). Work is cut into jobs of whole groups
(`HOST_CHUNK_ELEMS` elements at most) that `torch.get_num_threads()` threads take in turn;
ctypes releases the GIL.

Where the kernel did not build, or for a slot it does not take (other dtypes, non-
contiguous tensors), the twin runs instead. The twin on a whole tensor materializes about
ten FP32 temporaries of its size (~38 bytes per element, for every parameter a rank
offloads), so a contiguous host tensor is cut into chunks of whole quantization groups and
the twin runs on each chunk's views; groups never straddle chunks and every op of the step
is elementwise or per group, so the result is the whole-tensor step's, bit for bit. A chunk
is one of ATen's 32768-element grains, so each op runs inline in its thread and a chunk's
temporaries stay in the core's caches.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from . import host_native
from . import master
from .fp8 import Fp8Format, get_format
from .fp8_torch import exact_div
from .group_codec import dequantize_grouped, grouped, quantize_grouped, ungrouped
from .layout import AdamWHyper, AdamWSlot, QuantizedGroups, group_layout

# The smallest normal float32: a centre decayed below it is quantized again (GPUs flush
# subnormals).
FLT_MIN = 1.1754943508222875e-38

__all__ = ["adamw_step", "host_step", "chunk_slots", "HOST_CHUNK_ELEMS"]


# ---- The twin -----------------------------------------------------------------------------


def _moment_in(state, group_size: int, fmt: Fp8Format) -> torch.Tensor:
    if isinstance(state, QuantizedGroups):
        return dequantize_grouped(state._replace(codes=grouped(state.codes, group_size)), fmt)
    return grouped(state, group_size).to(torch.float32)


def _moment_out(state, new: torch.Tensor, ok: torch.Tensor, quiet: torch.Tensor, beta: float, group_size: int,
                fmt: Fp8Format, dre: bool):
    if isinstance(state, QuantizedGroups):
        qn = quantize_grouped(new, fmt, dre)
        # A group without gradient only decays: its codes stay and its centre takes the
        # factor, exactly, where quantizing again would round every element once more.
        decayed = state.center * beta
        quiet = quiet & (decayed >= FLT_MIN)
        fresh = ok & ~quiet
        old_codes = grouped(state.codes, group_size)
        state.codes.copy_(ungrouped(torch.where(fresh[..., None], qn.codes, old_codes), state.codes.shape))
        state.center.copy_(torch.where(quiet, decayed, torch.where(ok, qn.center, state.center)))
        for dst, src in zip(state[2:], qn[2:]):
            dst.copy_(torch.where(fresh, src, dst))
    else:
        old = grouped(state, group_size).to(torch.float32)
        state.copy_(ungrouped(torch.where(ok[..., None], new, old), state.shape))


def adamw_step(
    slots: list[AdamWSlot],
    hyper: AdamWHyper,
    *,
    group_size: int = 128,
    fmt_m="e4m3",
    fmt_v="e4m3",
    dre: bool = True,
    skipped: torch.Tensor | None = None,
    plan_cache: dict | None = None,
) -> None:
    """One AdamW step over `slots`, states updated in place.

    A group (G consecutive elements of a row) whose gradient or new moments are not finite
    is left untouched (parameter and both moments); their count is added to `skipped` and
    to the group's entry of `slot.skips`. A group that skipped s steps before is
    bias-corrected at step - s, as if those steps had not happened for it. A quantized m is
    clamped to Adam's bound (layout.adam_bound), and a group whose gradient is all zero keeps
    its codes and decays its centres (docs/optimizer.md, "Many steps"). A slot with a
    `remainder` steps the FP32 master it holds with its BF16 parameter and writes both back.
    `plan_cache` is accepted for signature parity with the Triton launcher and unused."""
    fm, fv = get_format(fmt_m), get_format(fmt_v)
    for slot in slots:
        if slot.param.numel() == 0:
            continue
        rem = slot.remainder
        p = grouped(slot.param if rem is None else master.join(slot.param, rem), group_size).to(torch.float32)
        g = grouped(slot.grad, group_size).to(torch.float32)
        m = _moment_in(slot.exp_avg, group_size, fm)
        v = _moment_in(slot.exp_avg_sq, group_size, fv)
        m = hyper.beta1 * m + (1 - hyper.beta1) * g
        v = hyper.beta2 * v + (1 - hyper.beta2) * (g * g)
        ok = torch.isfinite(g).all(-1) & torch.isfinite(m).all(-1) & torch.isfinite(v).all(-1)
        quiet = (g == 0).all(-1)
        if isinstance(slot.exp_avg, QuantizedGroups) and hyper.m_bound is not None:
            lim = hyper.m_bound * torch.sqrt(v)
            m = torch.maximum(torch.minimum(m, lim), -lim)
        step_size, inv_bc2_sqrt = _group_bias_corrections(hyper, slot.skips, ok.shape, p.device)
        denom = torch.sqrt(v) * inv_bc2_sqrt[..., None] + hyper.eps
        p_new = p * (1 - hyper.lr * hyper.weight_decay) - step_size[..., None] * (m / denom)
        p_new = ungrouped(torch.where(ok[..., None], p_new, p), slot.param.shape)
        if rem is None:
            slot.param.copy_(p_new)
        else:
            for dst, src in zip((slot.param, rem), master.split(p_new, master.remainder_bits(rem))):
                dst.copy_(src)
        _moment_out(slot.exp_avg, m, ok, quiet, hyper.beta1, group_size, fm, dre)
        _moment_out(slot.exp_avg_sq, v, ok, quiet, hyper.beta2, group_size, fv, dre)
        if slot.skips is not None:
            slot.skips.copy_(torch.where(ok, slot.skips, slot.skips + 1))
        if skipped is not None:
            skipped += (~ok).sum().to(skipped.dtype)


def _group_bias_corrections(hyper: AdamWHyper, skips, shape, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group (float32): lr / (1 - beta1**n) and 1 / sqrt(1 - beta2**n), n = step - skips.

    A group that never skipped takes the host's float64 values, as the kernel does; the
    others compute the power in float32, as the kernel does too."""
    step_size = torch.full(shape, hyper.step_size, dtype=torch.float32, device=device)
    inv_bc2_sqrt = torch.full(shape, 1.0 / hyper.bias_correction2_sqrt, dtype=torch.float32, device=device)
    if skips is None:
        return step_size, inv_bc2_sqrt
    lb1, lb2 = (torch.tensor(b, dtype=torch.float32) for b in hyper.log2_betas())
    n = torch.tensor(hyper.step, dtype=torch.float32) - skips.to(torch.float32)
    bc1 = 1.0 - torch.exp2(n * lb1)
    bc2 = 1.0 - torch.exp2(n * lb2)
    skipped_before = skips > 0
    step_size = torch.where(skipped_before, exact_div(hyper.lr, bc1), step_size)
    inv_bc2_sqrt = torch.where(skipped_before, torch.rsqrt(bc2), inv_bc2_sqrt)
    return step_size, inv_bc2_sqrt


# ---- The host step ------------------------------------------------------------------------

HOST_CHUNK_ELEMS = 1 << 15

_pool: list = [None, 0]
_pool_lock = threading.Lock()
# A forked child inherits the pool object but none of its threads.
os.register_at_fork(after_in_child=lambda: _pool.__setitem__(slice(None), [None, 0]))


def _executor(workers: int) -> ThreadPoolExecutor:
    with _pool_lock:
        if _pool[1] != workers:
            if _pool[0] is not None:
                _pool[0].shutdown(wait=True)
            _pool[0], _pool[1] = ThreadPoolExecutor(workers, thread_name_prefix="coat_ds_host"), workers
        return _pool[0]


def _moment_part(mom, rows: int, cols: int, r: slice, c: slice, gs: slice):
    """The part of a moment (FP32 tensor or QuantizedGroups) covering rows `r`, columns `c`
    (groups `gs`) of its (rows, cols) view."""
    if isinstance(mom, QuantizedGroups):
        return QuantizedGroups(mom.codes.view(rows, cols)[r, c], mom.center[r, gs], mom.kcode[r, gs],
                               mom.sexp[r, gs])
    return mom.view(rows, cols)[r, c]


def chunk_slots(slot: AdamWSlot, group_size: int, chunk_elems: int) -> list[AdamWSlot]:
    """`slot` cut into contiguous views of whole groups (a row's short last group included),
    about `chunk_elems` elements each: runs of whole rows, or pieces of one row when a row is
    longer than a chunk. Every group lies in exactly one chunk."""
    lay = group_layout(slot.param.shape, group_size)
    if lay.num_groups == 0:
        return []
    rows, cols = lay.rows, lay.cols
    p, g = slot.param.view(rows, cols), slot.grad.view(rows, cols)
    rem = None if slot.remainder is None else slot.remainder.view(rows, cols)
    out = []

    def add(r: slice, c: slice, gs: slice):
        out.append(AdamWSlot(p[r, c], g[r, c], _moment_part(slot.exp_avg, rows, cols, r, c, gs),
                             _moment_part(slot.exp_avg_sq, rows, cols, r, c, gs),
                             None if slot.skips is None else slot.skips[r, gs], None if rem is None else rem[r, c]))

    if cols >= chunk_elems:
        groups = max(1, chunk_elems // group_size)
        for i in range(rows):
            for g0 in range(0, lay.groups_per_row, groups):
                g1 = min(lay.groups_per_row, g0 + groups)
                add(slice(i, i + 1), slice(g0 * group_size, min(cols, g1 * group_size)), slice(g0, g1))
    else:
        step = max(1, chunk_elems // cols)
        for r0 in range(0, rows, step):
            add(slice(r0, min(rows, r0 + step)), slice(None), slice(None))
    return out


def _native_jobs(slots, fm, fv, group_size: int, chunk_elems: int) -> tuple[list, list]:
    """(jobs for the fused kernel: (slot arguments, first group, end group), slots it does
    not take). A job is at most a chunk's whole groups, so threads share out the work."""
    jobs, rest = [], []
    per = max(1, chunk_elems // group_size)
    for s in slots:
        lay = group_layout(s.param.shape, group_size)
        if lay.num_groups == 0:
            continue
        head = host_native.slot_args(s, fm, fv, lay.cols)
        if head is None:
            rest.append(s)
            continue
        jobs.extend((head, g0, min(lay.num_groups, g0 + per)) for g0 in range(0, lay.num_groups, per))
    return jobs, rest


def _run_native(lib, jobs: list, hyper: AdamWHyper, fm, fv, group_size: int, dre: bool) -> int:
    consts = host_native.step_consts(hyper, fm, fv)

    def drain(it) -> int:
        return sum(host_native.step_range(lib, head, group_size, consts, dre, g0, g1) for head, g0, g1 in it)

    workers = min(torch.get_num_threads(), len(jobs))
    if workers <= 1:
        return drain(jobs)
    it = iter(jobs)  # shared: each worker takes the next job when done (next() holds the GIL)
    return sum(_executor(torch.get_num_threads()).map(lambda _: drain(it), range(workers)))


def host_step(slots: list[AdamWSlot], hyper: AdamWHyper, *, group_size: int = 128, fmt_m="e4m3",
              fmt_v="e4m3", dre: bool = True, skipped: torch.Tensor | None = None,
              plan_cache: dict | None = None, chunk_elems: int | None = None, fused: bool = True) -> None:
    """`adamw_step` on host tensors (same signature): the fused kernel where it
    built and takes the slot, else the twin chunk by chunk for contiguous tensors and
    whole for the others. `chunk_elems` defaults to `HOST_CHUNK_ELEMS`; `fused=False` runs
    the fallback (benchmarks)."""
    chunk_elems = chunk_elems or HOST_CHUNK_ELEMS
    lib = host_native.library() if fused else None
    if lib is not None:
        fm, fv = get_format(fmt_m), get_format(fmt_v)
        jobs, slots = _native_jobs(slots, fm, fv, group_size, chunk_elems)
        if jobs:
            n = _run_native(lib, jobs, hyper, fm, fv, group_size, dre)
            if skipped is not None and n:
                skipped += n
    whole, parts = [], []
    for s in slots:
        host = all(t.device.type == "cpu" and t.is_contiguous() for t in (s.param, s.grad)) and (
            s.remainder is None or s.remainder.is_contiguous())
        if host and s.param.numel() > chunk_elems:
            parts.extend(chunk_slots(s, group_size, chunk_elems))
        else:
            whole.append(s)
    kw = dict(group_size=group_size, fmt_m=fmt_m, fmt_v=fmt_v, dre=dre)
    if whole:
        adamw_step(whole, hyper, **kw, skipped=skipped)
    workers = torch.get_num_threads()
    if workers <= 1 or len(parts) <= 1:
        for part in parts:
            adamw_step([part], hyper, **kw, skipped=skipped)
        return
    # One counter per chunk: threads adding into one tensor would race.
    counts = torch.zeros(len(parts), dtype=torch.int64)
    grad_mode = torch.is_grad_enabled()  # thread-local: the workers take the caller's (no_grad in step())

    def run(i: int) -> None:
        with torch.set_grad_enabled(grad_mode):
            adamw_step([parts[i]], hyper, **kw, skipped=counts[i])

    list(_executor(workers).map(run, range(len(parts))))
    if skipped is not None:
        skipped += counts.sum().to(skipped.dtype)
