"""Fused multi-tensor AdamW step over FP8 (or FP32) moments (registry op "adamw"; custom op
`adamw_step`): the Triton kernel and its launchers here; the pure-torch twin and the step on
host tensors built on it, the op's torch kernels, in host.py.

One launch covers every tensor of a bucket (same param dtype, grad dtype and step). Each
program owns BG whole groups of one tensor, so per-group statistics, the DRE exponent and
the scale are computed without leaving the program. Tensors are reached through a table of
raw addresses, rebuilt (pinned host memory, async copy) only when an address changes, and the
program map only when the tensors do: a step neither synchronises with the host nor
recompiles. `adamw_step_triton` reads every address at each call; a `PreparedStep` reads only
the gradients' and leaves the rest to its caller (CoatAdamW checks them with no Python per
tensor).
"""
from __future__ import annotations

from operator import attrgetter
from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

from . import host, master
from .custom_ops import define
from .fp8 import K_ONE, get_format, kernel_isa
from .fp8_triton import dequantize_tile, quantize_tile, rcp, round_to_bf16
from .group_codec import group_offsets, tile_shape
from .jit import jit
from .layout import AdamWHyper, AdamWSlot, QuantizedGroups, group_layout
from .master import load_master, store_master

__all__ = ["adamw_step_triton", "PreparedStep", "flat_slots", "AdamWKernels", "TORCH", "TRITON"]

triton = tl = None  # jit.bind sets them when a Triton backend is chosen

# p, g, m codes/center/kcode/sexp, v the same, cols, n_groups, gpr, group skips, master remainder
_TABLE_COLS = 16
# Launch shape (groups per program, warps), tuned on a GPU with bench/optim_step.py --sweep.
STEP_BLOCK_GROUPS = 16
STEP_WARPS = 4
_DTYPE_IDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_MAX_PLANS = 256


@jit
def _ptr(row, i, DTYPE_ID: tl.constexpr, ALIGNED: tl.constexpr):
    addr = tl.load(row + i)
    if DTYPE_ID == 0:
        ptr = addr.to(tl.pointer_type(tl.float32))
    elif DTYPE_ID == 1:
        ptr = addr.to(tl.pointer_type(tl.bfloat16))
    elif DTYPE_ID == 2:
        ptr = addr.to(tl.pointer_type(tl.float16))
    elif DTYPE_ID == 3:
        ptr = addr.to(tl.pointer_type(tl.uint8))
    elif DTYPE_ID == 5:
        ptr = addr.to(tl.pointer_type(tl.int32))
    elif DTYPE_ID == 6:
        ptr = addr.to(tl.pointer_type(tl.int16))
    else:
        ptr = addr.to(tl.pointer_type(tl.int8))
    if ALIGNED:
        # Addresses read from memory carry no alignment facts; without this hint every
        # access would be one element wide.
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@jit
def _load_moment(row, base: tl.constexpr, offs, valid, gi, gmask, QUANT: tl.constexpr, FMT: tl.constexpr,
                 ALIGNED: tl.constexpr, ISA: tl.constexpr):
    if QUANT:
        codes = tl.load(_ptr(row, base, 3, ALIGNED) + offs, mask=valid, other=0)
        center = tl.load(_ptr(row, base + 1, 0, ALIGNED) + gi, mask=gmask, other=1.0)
        kcode = tl.load(_ptr(row, base + 2, 3, ALIGNED) + gi, mask=gmask, other=16)
        sexp = tl.load(_ptr(row, base + 3, 4, ALIGNED) + gi, mask=gmask, other=0)
        return dequantize_tile(codes, center, kcode, sexp, FMT, ISA)
    else:
        return tl.load(_ptr(row, base, 0, ALIGNED) + offs, mask=valid, other=0.0)


@jit
def _store_moment(row, base: tl.constexpr, new, offs, valid, gi, gmask, quiet, beta,
                  QUANT: tl.constexpr, FMT: tl.constexpr, DRE: tl.constexpr, DRE_KNUM: tl.constexpr,
                  ALIGNED: tl.constexpr, ISA: tl.constexpr):
    if QUANT:
        codes, center, kcode, sexp = quantize_tile(new, FMT, DRE, DRE_KNUM, ISA)
        # A group without gradient keeps its codes and decays its centre (host._moment_out).
        center_ptr = _ptr(row, base + 1, 0, ALIGNED) + gi
        decayed = tl.load(center_ptr, mask=gmask & quiet, other=0.0) * beta
        quiet = quiet & (decayed >= 1.1754943508222875e-38)
        fresh = gmask & ~quiet
        tl.store(_ptr(row, base, 3, ALIGNED) + offs, codes, mask=valid & fresh[:, None])
        tl.store(center_ptr, tl.where(quiet, decayed, center), mask=gmask)
        tl.store(_ptr(row, base + 2, 3, ALIGNED) + gi, kcode, mask=fresh)
        tl.store(_ptr(row, base + 3, 4, ALIGNED) + gi, sexp, mask=fresh)
    else:
        tl.store(_ptr(row, base, 0, ALIGNED) + offs, new, mask=valid)


@jit
def _adamw_kernel(table_ptr, blocks_ptr, skipped_ptr, gscale_ptr,
                  beta1, beta2, eps, decay, step_size, inv_bc2_sqrt, lr, step, log2_beta1, log2_beta2, m_bound,
                  CLAMP: tl.constexpr, P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, QUANT: tl.constexpr,
                  FMT_M: tl.constexpr, FMT_V: tl.constexpr, DRE: tl.constexpr, KNUM_M: tl.constexpr, KNUM_V: tl.constexpr,
                  G: tl.constexpr, BG: tl.constexpr, TABLE_COLS: tl.constexpr, ALIGNED: tl.constexpr,
                  GSCALE: tl.constexpr, ISA: tl.constexpr, MASTER: tl.constexpr, REM_DTYPE: tl.constexpr):
    pid = tl.program_id(0)
    t, g0 = tl.load(blocks_ptr + 2 * pid).to(tl.int64), tl.load(blocks_ptr + 2 * pid + 1)
    row = table_ptr + t * TABLE_COLS
    cols, n_groups, gpr = tl.load(row + 10), tl.load(row + 11).to(tl.int32), tl.load(row + 12).to(tl.int32)
    gi = g0 + tl.arange(0, BG)
    gmask = gi < n_groups
    offs, valid = group_offsets(gi, n_groups, cols, gpr, G, ALIGNED)

    p_ptr = _ptr(row, 0, P_DTYPE, ALIGNED)
    if MASTER == 0:
        p = tl.load(p_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    else:  # a BF16 parameter (read as its bits) and the remainder of its FP32 master
        p = load_master(_ptr(row, 0, 6, ALIGNED), _ptr(row, 14, REM_DTYPE, ALIGNED), offs, valid, MASTER)
    g = tl.load(_ptr(row, 1, G_DTYPE, ALIGNED) + offs, mask=valid, other=0.0).to(tl.float32)
    if GSCALE:
        # A clipping coefficient on the device: the gradient as `g.mul_(coef)` would leave it.
        g = g * tl.load(gscale_ptr)
    m = _load_moment(row, 2, offs, valid, gi, gmask, QUANT, FMT_M, ALIGNED, ISA)
    v = _load_moment(row, 6, offs, valid, gi, gmask, QUANT, FMT_V, ALIGNED, ISA)

    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * (g * g)
    # A group whose gradient or new moments are not finite keeps its old state. A NaN or
    # inf gradient makes v NaN or inf, and so does a finite one whose square overflows.
    ok = tl.min(((v < float("inf")) & (tl.abs(m) < float("inf"))).to(tl.int32), axis=1) > 0
    quiet = tl.max((g != 0.0).to(tl.int32), axis=1) == 0
    if CLAMP:  # a quantized m within Adam's bound (layout.adam_bound)
        lim = m_bound * tl.sqrt(v)
        m = tl.minimum(tl.maximum(m, -lim), lim)
    # A group that skipped s steps is bias-corrected at step - s; one that never skipped
    # takes the host's float64 corrections, as before skips were counted.
    skips_ptr = _ptr(row, 13, 5, ALIGNED)
    skips = tl.load(skips_ptr + gi, mask=gmask, other=0)
    n = step - skips.to(tl.float32)
    bc1, bc2 = 1.0 - tl.exp2(n * log2_beta1), 1.0 - tl.exp2(n * log2_beta2)
    g_step_size = tl.where(skips > 0, lr * rcp(bc1, ISA), step_size)
    g_inv_bc2_sqrt = tl.where(skips > 0, rcp(tl.sqrt(bc2), ISA), inv_bc2_sqrt)
    denom = tl.sqrt(v) * g_inv_bc2_sqrt[:, None] + eps
    p_new = p * decay - g_step_size[:, None] * (m * rcp(denom, ISA))

    keep, gkeep = valid & ok[:, None], gmask & ok
    if MASTER == 0:
        if P_DTYPE == 1:
            p_new = round_to_bf16(p_new)
        tl.store(p_ptr + offs, p_new.to(p_ptr.dtype.element_ty), mask=keep)
    else:
        store_master(_ptr(row, 0, 6, ALIGNED), _ptr(row, 14, REM_DTYPE, ALIGNED), p_new, offs, keep, MASTER)
    _store_moment(row, 2, m, offs, keep, gi, gkeep, quiet, beta1, QUANT, FMT_M, DRE, KNUM_M, ALIGNED, ISA)
    _store_moment(row, 6, v, offs, keep, gi, gkeep, quiet, beta2, QUANT, FMT_V, DRE, KNUM_V, ALIGNED, ISA)
    bad = gmask & ~ok
    tl.store(skips_ptr + gi, skips + 1, mask=bad)
    n_bad = tl.sum(bad.to(tl.int32), axis=0)
    if n_bad > 0:
        tl.atomic_add(skipped_ptr, n_bad.to(tl.int64))


class _Plan:
    """One bucket's program -> (tensor, first group) map, fixed by its tensors' shapes, and
    its device-side address table, rebound whenever an address changes.

    The map has a row per program (~150k for 300M parameters): building it costs far more
    Python than a step's launch, so it is built once. Gradients move between steps whenever the
    allocator hands them other blocks (new batches, set_to_none), and rebinding costs a row
    per tensor."""

    def __init__(self, slots: list[AdamWSlot], group_size: int, device: torch.device):
        self.bg = max(1, STEP_BLOCK_GROUPS * 128 // group_size) if device.type == "cuda" else tile_shape(group_size)
        self.device = device
        self.layouts = [group_layout(s.param.shape, group_size) for s in slots]
        blocks = [(t, b) for t, lay in enumerate(self.layouts) for b in range(0, lay.num_groups, self.bg)]
        self.grid = len(blocks)
        self.blocks = _to_device(blocks or [(0, 0)], device, torch.int32)
        self.key = self.table = self.aligned = None

    def bind(self, key: list[tuple[int, ...]]) -> None:
        if key == self.key:
            self.key = key  # the caller's own list: a PreparedStep checks it by identity
            return
        rows = [[*addresses[:10], lay.cols, lay.num_groups, lay.groups_per_row, *addresses[10:12], 0]
                for addresses, lay in zip(key, self.layouts)]
        # 16-byte vector access needs every row start and every base address aligned.
        self.aligned = all(r[10] % 16 == 0 and all(a % 16 == 0 for a in (*r[:10], r[13], r[14])) for r in rows)
        self.table = _to_device(rows, self.device)
        self.key = key


_data_ptr = torch.Tensor.data_ptr


def _addresses(s: AdamWSlot) -> tuple[int, ...]:
    rem = 0 if s.remainder is None else _data_ptr(s.remainder)
    if isinstance(s.exp_avg, QuantizedGroups):
        return (_data_ptr(s.param), _data_ptr(s.grad), *map(_data_ptr, s.exp_avg), *map(_data_ptr, s.exp_avg_sq),
                _data_ptr(s.skips), rem)
    return (_data_ptr(s.param), _data_ptr(s.grad), _data_ptr(s.exp_avg), 0, 0, 0, _data_ptr(s.exp_avg_sq), 0, 0, 0,
            _data_ptr(s.skips), rem)


def _key(slots: list[AdamWSlot]) -> list[tuple[int, ...]]:
    # Every address the kernel reads or writes, state tensors included: DeepSpeed's
    # offload_states / reload_adam_states swap a state tensor's storage (`.data =`) while the
    # tensor object, the parameter and the gradient stay where they were.
    return [_addresses(s) for s in slots]


def _to_device(rows, device, dtype=torch.int64) -> torch.Tensor:
    if device.type == "cuda":
        return torch.tensor(rows, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(rows, dtype=dtype, device=device)


def _checked(slots: list[AdamWSlot], group_size: int) -> list[AdamWSlot]:
    slots = [s for s in slots if s.param.numel()]
    if not slots:
        return slots
    device = slots[0].param.device
    # Without a counter per group (tests, benchmarks) no group has skipped before, and a
    # skip is only counted in `skipped`.
    slots = [s if s.skips is not None else s._replace(skips=torch.zeros(
        group_layout(s.param.shape, group_size).meta_shape, dtype=torch.int32, device=device)) for s in slots]
    for s in slots:
        if not (s.param.is_contiguous() and s.grad.is_contiguous()):
            raise ValueError("CoatAdamW's Triton step needs contiguous parameters and gradients")
    return slots


def _bound_plan(slots: list[AdamWSlot], key: list[tuple[int, ...]], group_size: int, plan_cache: dict | None) -> _Plan:
    quant = isinstance(slots[0].exp_avg, QuantizedGroups)
    # Keyed by the parameters themselves: ZeRO-3 steps one sub-group's tensors per call,
    # each with its own plan, and every one is reused on the next iteration.
    cache_key = (quant, slots[0].param.dtype, slots[0].grad.dtype, group_size,
                 tuple((k[0], s.param.shape) for k, s in zip(key, slots)))
    plan = None if plan_cache is None else plan_cache.get(cache_key)
    if plan is None:
        plan = _Plan(slots, group_size, slots[0].param.device)
        if plan_cache is not None:
            if len(plan_cache) >= _MAX_PLANS:
                plan_cache.pop(next(iter(plan_cache)))
            plan_cache[cache_key] = plan
    plan.bind(key)
    return plan


class _Launch:
    """The constant part of one bucket's launch: dtypes, formats, plan."""

    def __init__(self, slots: list[AdamWSlot], plan: _Plan, fmt_m: str, fmt_v: str, dre: bool, group_size: int):
        fm, fv = get_format(fmt_m), get_format(fmt_v)
        bits = master.slots_kind(slots)  # raises for a remainder that does not fit its parameter
        self.plan = plan
        self.device = slots[0].param.device
        self.grad_dtype = slots[0].grad.dtype
        self.consts = dict(
            P_DTYPE=_DTYPE_IDS[slots[0].param.dtype], G_DTYPE=_DTYPE_IDS[self.grad_dtype],
            QUANT=isinstance(slots[0].exp_avg, QuantizedGroups), FMT_M=fm.id, FMT_V=fv.id, DRE=dre,
            KNUM_M=K_ONE * fm.dre_log2_range, KNUM_V=K_ONE * fv.dre_log2_range, G=group_size,
            BG=plan.bg, TABLE_COLS=_TABLE_COLS, MASTER=bits, REM_DTYPE=6 if bits == 16 else 4, num_warps=STEP_WARPS)

    def __call__(self, hyper: AdamWHyper, skipped: torch.Tensor | None, grad_scale: torch.Tensor | None) -> None:
        if skipped is None:
            skipped = torch.zeros((), dtype=torch.int64, device=self.device)
        plan = self.plan
        _adamw_kernel[(plan.grid,)](
            plan.table, plan.blocks, skipped, skipped if grad_scale is None else grad_scale,
            hyper.beta1, hyper.beta2, hyper.eps, 1.0 - hyper.lr * hyper.weight_decay, hyper.step_size,
            1.0 / hyper.bias_correction2_sqrt, hyper.lr, hyper.step, *hyper.log2_betas(), hyper.m_bound or 0.0,
            CLAMP=self.consts["QUANT"] and hyper.m_bound is not None, ALIGNED=plan.aligned,
            GSCALE=grad_scale is not None, ISA=kernel_isa(self.device), **self.consts)  # ISA may change


def adamw_step_triton(slots: list[AdamWSlot], hyper: AdamWHyper, *, group_size: int = 128, fmt_m="e4m3",
                      fmt_v="e4m3", dre: bool = True, skipped: torch.Tensor | None = None,
                      plan_cache: dict | None = None, grad_scale: torch.Tensor | None = None) -> None:
    """host.adamw_step (the twin) by the Triton kernel: one launch for all `slots`.

    All slots share param dtype, grad dtype and moment kind (FP8 or FP32). `plan_cache`, a
    dict owned by the caller, keeps the address table between steps; it is re-sent whenever
    any tensor the kernel touches has moved. `grad_scale` (float32, shape (), on the
    device): every gradient is read multiplied by it, as after `g.mul_(grad_scale)`."""
    slots = _checked(slots, group_size)
    if not slots:
        return
    plan = _bound_plan(slots, _key(slots), group_size, plan_cache)
    _Launch(slots, plan, fmt_m, fmt_v, dre, group_size)(hyper, skipped, grad_scale)


_dtype_of = attrgetter("dtype")
_is_contiguous = torch.Tensor.is_contiguous


class PreparedStep:
    """`adamw_step_triton` prepared for slots whose parameters and state tensors stay where they
    are: each step passes only the gradients. The caller re-checks the parameters' and
    state tensors' addresses before every step (a moved one needs a new PreparedStep);
    gradients may move, and the table's gradient column is rebound when one did. Holds
    no gradient: old gradients are freed as the caller replaces them."""

    def __init__(self, slots: list[AdamWSlot], *, group_size: int = 128, fmt_m="e4m3", fmt_v="e4m3",
                 dre: bool = True, plan_cache: dict | None = None):
        self.live = [i for i, s in enumerate(slots) if s.param.numel()]  # FSDP2 shards may be empty
        self.all_live = len(self.live) == len(slots)
        slots = _checked([slots[i] for i in self.live], group_size)
        self.key = _key(slots)
        # What the table points at, gradients aside, lives as long as the table.
        self.held = [(s.param, s.exp_avg, s.exp_avg_sq, s.skips, s.remainder) for s in slots]
        self.launch = _Launch(slots, _bound_plan(slots, self.key, group_size, plan_cache), fmt_m, fmt_v, dre,
                              group_size) if slots else None
        self.grad_ptrs = [k[1] for k in self.key]

    def accept(self, grads: list[torch.Tensor]) -> list[int] | None:
        """What the call takes for `grads` (one per slot, in order): their addresses, or None
        where they cannot be stepped as prepared (not dense, not contiguous or not of the
        prepared dtype)."""
        if self.launch is None:
            return []
        if not self.all_live:
            grads = [grads[i] for i in self.live]
        try:
            ptrs = list(map(_data_ptr, grads))  # raises for a sparse gradient
        except RuntimeError:
            return None
        if all(map(_is_contiguous, grads)) and set(map(_dtype_of, grads)) == {self.launch.grad_dtype}:
            return ptrs
        return None

    def __call__(self, grad_ptrs: list[int], hyper: AdamWHyper, skipped: torch.Tensor | None = None,
                 grad_scale: torch.Tensor | None = None) -> None:
        if self.launch is None:
            return
        if grad_ptrs != self.grad_ptrs:
            self.key = [(k[0], g, *k[2:]) for k, g in zip(self.key, grad_ptrs)]
            self.grad_ptrs = grad_ptrs
        if self.launch.plan.key is not self.key:  # gradients moved, or another caller bound the cached plan
            self.launch.plan.bind(self.key)
        self.launch(hyper, skipped, grad_scale)


# ---- The custom op and the registry's kernels ---------------------------------------------


def flat_slots(slots: list[AdamWSlot]) -> tuple[list, list, list, list, list]:
    """`slots` as `coat_ds::adamw_step` takes them: parameters, gradients, first and second
    moments (an FP8 moment as its four tensors, in QuantizedGroups order), skip counters (an
    empty tensor where a slot has none: torch's functionalization of a written list takes no
    None in it)."""
    def moment(m):
        return list(m) if isinstance(m, QuantizedGroups) else [m]

    if any(s.remainder is not None for s in slots):
        raise ValueError("coat_ds::adamw_step takes FP32 or BF16 parameters without a master remainder")
    return ([s.param for s in slots], [s.grad for s in slots], [t for s in slots for t in moment(s.exp_avg)],
            [t for s in slots for t in moment(s.exp_avg_sq)],
            [s.param.new_empty((0,), dtype=torch.int32) if s.skips is None else s.skips for s in slots])


def _moments(flat: list[Tensor], n: int) -> list:
    if len(flat) == n:
        return flat
    return [QuantizedGroups(*flat[4 * i:4 * i + 4]) for i in range(n)]


# Plans of the op's Triton steps, per device (see _bound_plan): the op keeps no state of its
# caller, whose prepared step (PreparedStep) holds its own.
_PLANS: dict = {}


def _step_op(k, params: list[Tensor], grads: list[Tensor], exp_avg: list[Tensor], exp_avg_sq: list[Tensor],
             skips: list[Tensor], hyper: list[float], group_size: int, fmt_m: str, fmt_v: str, dre: bool,
             skipped: Optional[Tensor]) -> None:
    n = len(params)
    if n == 0:
        return
    skips = [s if s.numel() else None for s in skips]  # a slot without groups is skipped either way
    slots = [AdamWSlot(*parts) for parts in zip(params, grads, _moments(exp_avg, n), _moments(exp_avg_sq, n), skips)]
    plans = _PLANS.setdefault((params[0].device.type, params[0].device.index), {})
    k.step(slots, AdamWHyper(*hyper), group_size=group_size, fmt_m=fmt_m, fmt_v=fmt_v, dre=dre,
           skipped=skipped, plan_cache=plans)


define("adamw_step", __name__, _step_op, lambda *args: None,
       mutates=("params", "exp_avg", "exp_avg_sq", "skips", "skipped"))


class AdamWKernels(NamedTuple):
    """`step(slots, hyper, *, group_size, fmt_m, fmt_v, dre, skipped, plan_cache)`, and
    `prepare(slots, ...)`: a step prepared once for fixed tensors (PreparedStep), or None
    where the per-tensor work dwarfs the Python around it."""

    step: Callable
    prepare: Optional[Callable]


TORCH = AdamWKernels(host.host_step, None)
TRITON = AdamWKernels(adamw_step_triton, PreparedStep)
