"""Pure-torch twins of every Triton kernel: the CPU path and the test oracle.

Each function computes what its kernel computes, in the same order where it decides a
result (exponent choice, centre, power-of-two scale), so the two agree to within one
rounding of the last FP8 bit.
"""
from __future__ import annotations

import torch

from .fp8 import K_MAX_CODE, K_MIN_CODE, K_ONE, Fp8Format, get_format
from .layout import AdamWHyper, AdamWSlot, QuantizedGroups, group_layout

__all__ = [
    "encode_fp8",
    "decode_fp8",
    "cast_fp8",
    "scale_exponent",
    "exponent_from_bits",
    "pow2",
    "quantize_groups",
    "dequantize_groups",
    "adamw_step",
    "linear_scale_exponent",
    "linear_finite_absmax",
    "linear_quantize",
    "linear_dequantize",
    "rms_norm_forward",
    "rms_norm_backward",
    "swiglu_forward",
    "swiglu_backward",
]


def encode_fp8(x: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """Round-to-nearest-even, saturating FP8 encode of float32 `x`, as uint8 codes (the
    sign bit copied from x, -0.0 included, as the hardware conversion does)."""
    mag = x.abs().clamp_(max=fmt.max).to(fmt.dtype).view(torch.uint8)
    return mag | (torch.signbit(x).to(torch.uint8) << 7)


def decode_fp8(codes: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    return codes.view(fmt.dtype).to(torch.float32)


def cast_fp8(x: torch.Tensor, fmt="e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """Saturating RNE cast to FP8: (uint8 codes, their float32 values)."""
    f = get_format(fmt)
    codes = encode_fp8(x.to(torch.float32), f)
    return codes, decode_fp8(codes, f)


def exponent_from_bits(bits: torch.Tensor, fmt: Fp8Format, mantissa_cut: int) -> torch.Tensor:
    """(int32) The exponent of the float32 whose bits are `bits`, less the format's E (both
    formats' max is 1.75 * 2**E), plus one where its mantissa field is >= `mantissa_cut`:
    the smallest power-of-two scale putting the value below 1 + mantissa_cut / 2**23 times
    2**E. The scales of every codec here are this with their own cut."""
    return ((bits >> 23) & 0xFF) - (127 + int(fmt.log2_max)) + ((bits & 0x7FFFFF) >= mantissa_cut).to(torch.int32)


def scale_exponent(ymax: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """Exact ceil(log2(ymax / fmt.max)) (int32) for positive normal float32 `ymax`: ymax's
    exponent - E, plus one when its mantissa exceeds 1.75."""
    return exponent_from_bits(ymax.view(torch.int32), fmt, 0x600001)


def pow2(e: torch.Tensor) -> torch.Tensor:
    """Exact 2**e as float32 for integer e in [-126, 127]."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def _div(num: float, den: torch.Tensor) -> torch.Tensor:
    # `float / tensor` in torch multiplies by a reciprocal; the kernels divide exactly.
    return torch.div(torch.full_like(den, num), den)


def _grouped(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """(rows, groups_per_row, G) view of `x` in its own dtype, zero-padded at row tails."""
    lay = group_layout(x.shape, group_size)
    x2 = x.reshape(lay.rows, lay.cols)
    pad = lay.groups_per_row * group_size - lay.cols
    if pad:
        x2 = torch.cat([x2, x2.new_zeros(lay.rows, pad)], dim=1)
    return x2.reshape(lay.rows, lay.groups_per_row, group_size)


def _ungrouped(xg: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    cols = shape[-1] if len(shape) else 1
    return xg.flatten(1)[:, :cols].reshape(shape)


def _quantize_grouped(xg: torch.Tensor, fmt: Fp8Format, dre: bool) -> QuantizedGroups:
    a = xg.abs()
    amax = a.amax(-1)
    amin = torch.where(a > 0, a, float("inf")).amin(-1)
    nonzero = amax > 0
    lmax = torch.log2(amax)
    if dre:
        # k stretches (or, below 1, compresses) the group's range onto the format's.
        log2r = lmax - torch.log2(amin)
        kf = torch.floor(_div(K_ONE * fmt.dre_log2_range, log2r))
        kf = torch.where(log2r > 0, kf, float(K_MAX_CODE)).clamp_(K_MIN_CODE, K_MAX_CODE)
        center = torch.where(amax == amin, amax, torch.sqrt(amax) * torch.sqrt(amin))
    else:
        kf = torch.full_like(amax, K_ONE)
        center = amax
    kf = torch.where(nonzero, kf, float(K_ONE))
    center = torch.where(nonzero, center, 1.0)
    lc = torch.log2(center)
    k = kf / K_ONE
    y = torch.where(a > 0, torch.exp2(k[..., None] * (torch.log2(a) - lc[..., None])), 0.0)
    ymax = torch.where(nonzero, torch.exp2(k * (lmax - lc)), 1.0)  # the image of amax
    sexp = torch.where(nonzero, scale_exponent(ymax, fmt), 0)
    q = torch.clamp(y * pow2(-sexp)[..., None], max=fmt.max)
    if dre:
        # Below the format's range (a group wider than range / k): the smallest code, not 0.
        q = torch.where((a > 0) & nonzero[..., None], q.clamp(min=fmt.min_subnormal), q)
    q = torch.where(xg < 0, -q, q)
    return QuantizedGroups(encode_fp8(q, fmt), center, kf.to(torch.uint8), sexp.to(torch.int8))


def _dequantize_grouped(qg: QuantizedGroups, fmt: Fp8Format) -> torch.Tensor:
    q = decode_fp8(qg.codes, fmt)
    y = q.abs() * pow2(qg.sexp)[..., None]
    t = torch.log2(y) * _div(float(K_ONE), qg.kcode.to(torch.float32))[..., None]
    center = qg.center[..., None].expand_as(t)
    # Sum logs rather than multiply (no overflow); y == 1 returns the centre exactly.
    a = torch.where(t == 0, center, torch.exp2(t + torch.log2(center)))
    a = a.clamp_(max=torch.finfo(torch.float32).max)
    return torch.where(q < 0, -a, a)


def quantize_groups(x: torch.Tensor, group_size: int = 128, fmt="e4m3", dre: bool = True) -> QuantizedGroups:
    """Per-group FP8 quantization along the last dim, with or without DRE.

    A group stores codes q, a centre c, an exponent k and a power-of-two scale 2**e with
    x = sign(q) * (|q| * 2**e) ** (1/k) * c. Zeros stay exact zeros and a group of equal
    magnitudes decodes exactly (c is that magnitude). Without DRE, k = 1 and c = absmax."""
    fmt = get_format(fmt)
    qg = _quantize_grouped(_grouped(x, group_size).to(torch.float32), fmt, dre)
    return qg._replace(codes=_ungrouped(qg.codes, x.shape).contiguous())


def dequantize_groups(qg: QuantizedGroups, group_size: int = 128, fmt="e4m3",
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    fmt = get_format(fmt)
    x = _dequantize_grouped(qg._replace(codes=_grouped(qg.codes, group_size)), fmt)
    return _ungrouped(x, qg.codes.shape).to(dtype).contiguous()


def _moment_in(state, group_size: int, fmt: Fp8Format) -> torch.Tensor:
    if isinstance(state, QuantizedGroups):
        return _dequantize_grouped(state._replace(codes=_grouped(state.codes, group_size)), fmt)
    return _grouped(state, group_size).to(torch.float32)


def _moment_out(state, new: torch.Tensor, ok: torch.Tensor, group_size: int, fmt: Fp8Format, dre: bool):
    if isinstance(state, QuantizedGroups):
        qn = _quantize_grouped(new, fmt, dre)
        old_codes = _grouped(state.codes, group_size)
        state.codes.copy_(_ungrouped(torch.where(ok[..., None], qn.codes, old_codes), state.codes.shape))
        for dst, src in zip(state[1:], qn[1:]):
            dst.copy_(torch.where(ok, src, dst))
    else:
        old = _grouped(state, group_size).to(torch.float32)
        state.copy_(_ungrouped(torch.where(ok[..., None], new, old), state.shape))


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
    bias-corrected at step - s, as if those steps had not happened for it.
    `plan_cache` is accepted for signature parity with the Triton launcher and unused."""
    fm, fv = get_format(fmt_m), get_format(fmt_v)
    for slot in slots:
        if slot.param.numel() == 0:
            continue
        p = _grouped(slot.param, group_size).to(torch.float32)
        g = _grouped(slot.grad, group_size).to(torch.float32)
        m = _moment_in(slot.exp_avg, group_size, fm)
        v = _moment_in(slot.exp_avg_sq, group_size, fv)
        m = hyper.beta1 * m + (1 - hyper.beta1) * g
        v = hyper.beta2 * v + (1 - hyper.beta2) * (g * g)
        ok = torch.isfinite(g).all(-1) & torch.isfinite(m).all(-1) & torch.isfinite(v).all(-1)
        step_size, inv_bc2_sqrt = _group_bias_corrections(hyper, slot.skips, ok.shape, p.device)
        denom = torch.sqrt(v) * inv_bc2_sqrt[..., None] + hyper.eps
        p_new = p * (1 - hyper.lr * hyper.weight_decay) - step_size[..., None] * (m / denom)
        p_new = torch.where(ok[..., None], p_new, p)
        slot.param.copy_(_ungrouped(p_new, slot.param.shape))
        _moment_out(slot.exp_avg, m, ok, group_size, fm, dre)
        _moment_out(slot.exp_avg_sq, v, ok, group_size, fv, dre)
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
    step_size = torch.where(skipped_before, _div(hyper.lr, bc1), step_size)
    inv_bc2_sqrt = torch.where(skipped_before, torch.rsqrt(bc2), inv_bc2_sqrt)
    return step_size, inv_bc2_sqrt


# ---- FP8 linear layers: twins of kernels/fp8_linear.py (owned by the FP8-linear code) ------
#
# A GEMM's FP8 input uses the whole format: its max takes the top code, and the codes have
# no inf (saved activations do: kernels/act_codec.py).


def linear_scale_exponent(amax: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """Smallest e with amax * 2**-e <= fmt.max, clamped to [-126, 126] (int32), read from
    amax's bits: both formats' maxima are 1.75 * 2**E."""
    return scale_exponent(amax.to(torch.float32).contiguous(), fmt).clamp_(-126, 126)


def linear_finite_absmax(x: torch.Tensor, split: int = 0) -> torch.Tensor:
    """max |x| over the finite elements of `x` (float32, shape ()); 0 when none is finite.

    A -inf in a masked input must not make the scale infinite: every finite value would
    then encode to 0. With `split` (dividing x.numel()), the max is taken over runs of
    `split` consecutive elements first: the same value, but compiled, Inductor can compute
    the runs' maxima in one kernel with other reductions of that shape over the same inputs."""
    if not x.numel():
        return x.new_zeros((), dtype=torch.float32)
    a = _exact_scaling_dtype(x).abs()
    a = torch.where(a < float("inf"), a, 0.0)
    if split and x.numel() % split == 0:
        a = a.reshape(-1, split).amax(-1)
    return a.amax().to(torch.float32)


def _exact_scaling_dtype(x: torch.Tensor) -> torch.Tensor:
    """`x` itself where scaling it by a power of two is exact (BF16 has FP32's exponent
    range), else as FP32. Not upcasting a BF16 tensor matters under torch.compile: Inductor
    folds `to(bf16).to(fp32)` chains, and the FP32 tensor it then materializes for two
    consumers (max, cast) doubles the bytes moved."""
    return x if x.dtype in (torch.bfloat16, torch.float32) else x.to(torch.float32)


def linear_quantize(x: torch.Tensor, fmt="e4m3", rowwise: bool = True, transposed: bool = False,
                    pad: int = 16, exp: torch.Tensor | None = None, split: int = 0,
                    amax: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Per-tensor FP8 of a 2-D (M, K) `x` with a power-of-two scale 2**e from its finite max,
    or with the given int32 exponent `exp` (the max is then not read: a weight quantized
    again in backward keeps its forward scale).

    Returns (codes (M, K) or None, transposed codes (K, M padded with zero columns to a
    multiple of `pad`) or None, int32 exponent e of shape ()); codes are uint8, x ~ q * 2**e.
    The transposed copy is what a GEMM that contracts over M (the weight gradient) reads.
    `split`: how the max is reduced (linear_finite_absmax); it does not change the result.
    `amax`: that max already found, as int32 float bits of one element (rms_norm_forward's or
    swiglu_forward's),
    so it is not read again."""
    fmt = get_format(fmt)
    if exp is not None:
        e = exp.to(torch.int32).reshape(())
    else:
        top = linear_finite_absmax(x, split) if amax is None else amax.reshape(()).view(torch.float32)
        e = linear_scale_exponent(top, fmt)
    # A saturating cast (clamp, then torch's RNE cast) equals encode_fp8 on every non-NaN
    # value, and compiles to one Inductor kernel without encode_fp8's integer sign fix-up.
    codes = (_exact_scaling_dtype(x) * pow2(-e)).clamp(-fmt.max, fmt.max).to(fmt.dtype).view(torch.uint8)
    codes_t = None
    if transposed:
        m = x.shape[0]
        codes_t = codes.t()
        if m % pad:
            codes_t = torch.nn.functional.pad(codes_t, (0, pad - m % pad))
        codes_t = codes_t.contiguous()
    return (codes if rowwise else None), codes_t, e


def linear_dequantize(codes: torch.Tensor, exp: torch.Tensor, fmt="e4m3",
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of `linear_quantize`'s codes at exponent `exp`, in `dtype` (clamped to its
    finite range: the max rounds up at the top of the fp16 range, 65504 -> 65536)."""
    out_max = torch.finfo(dtype).max
    return (decode_fp8(codes, get_format(fmt)) * pow2(exp)).clamp_(-out_max, out_max).to(dtype)


# ---- The fused RMSNorm: twins of kernels/rms_norm.py (owned by linear/norm.py) -----------


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float, cast_first: bool
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RMSNorm of `x` over its last dim: (y of x's shape, float32 rstd per row, int32 (1,)
    float bits of max finite |y|, the linear layers' linear_finite_absmax).

    Computed as Hugging Face's LlamaRMSNorm computes it, bit for bit: FP32 statistics,
    rstd = rsqrt(mean(x^2) + eps); with `cast_first` (LlamaRMSNorm's order) n = x * rstd is
    rounded to x's dtype and then multiplied by the weight in their promoted dtype (a
    product of two 16-bit floats is exact in FP32, so one rounding of the FP32 product);
    otherwise (torch.nn.RMSNorm's order) x * rstd * weight is rounded once to x's dtype."""
    x32 = x.to(torch.float32)
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    n = x32 * rstd
    if cast_first:
        y_dtype = torch.promote_types(weight.dtype, x.dtype)
        y = (n.to(x.dtype).to(torch.float32) * weight.to(torch.float32)).to(y_dtype)
    else:
        y = (n * weight.to(torch.float32)).to(x.dtype)
    amax = linear_finite_absmax(y).reshape(1).view(torch.int32)
    return y, rstd.reshape(-1), amax


def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                      cast_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx in x's dtype, dweight in weight's dtype) of rms_norm_forward's y, in FP32 from
    the saved rstd: dx = rstd * (dy*w - n * mean(dy*w * n)), n = x * rstd (the roundings
    of forward pass the gradient through), dweight = sum over rows of dy * n, n rounded to
    x's dtype where forward multiplied the weight by the rounded value."""
    n_feat = x.shape[-1]
    x32 = x.reshape(-1, n_feat).to(torch.float32)
    dy32 = dy.reshape(-1, n_feat).to(torch.float32)
    r = rstd.reshape(-1, 1)
    n = x32 * r
    dn = dy32 * weight.to(torch.float32)
    dx = r * (dn - n * ((dn * n).sum(-1, keepdim=True) / n_feat))
    if cast_first:
        n = n.to(x.dtype).to(torch.float32)
    dw = (dy32 * n).sum(0)
    return dx.to(x.dtype).reshape(x.shape), dw.to(weight.dtype)


# ---- The fused SwiGLU: twins of kernels/swiglu.py (owned by linear/swiglu.py) --------------
#
# Hugging Face's eager ops themselves (F.silu, then a multiply; silu's backward op), which
# round where the kernels do: bit-equal to Hugging Face's eager MLP on the same device.


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor, with_max: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(h = silu(gate) * up, silu rounded to gate's dtype first; with `with_max`, the int32
    bits of linear_finite_absmax(h) as a (1,) tensor, else None)."""
    h = (torch.nn.functional.silu(gate) * up).contiguous()
    amax = linear_finite_absmax(h).reshape(1).view(torch.int32) if with_max else None
    return h, amax


def swiglu_backward(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup): dup = dh * silu(gate) (silu rounded to gate's dtype), dgate = silu's
    derivative at gate times dh * up (rounded to gate's dtype)."""
    dup = dh * torch.nn.functional.silu(gate)
    dgate = torch.ops.aten.silu_backward(dh * up, gate)
    return dgate, dup


def cross_entropy_rows(logits: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor | None,
                       ignore_index: int) -> torch.Tensor:
    """Per-row FP32 cross-entropy of `logits` (rows x vocab) against `labels` (`ignore_index`:
    0), on the logits upcast to FP32 as Hugging Face's loss upcasts them. With `scale` (1 /
    the loss's denominator) the logits are overwritten with the gradient of sum(loss) * scale
    (softmax - one_hot, times scale; 0 in unlabelled rows), rounded to their dtype. FP32
    logits are the scratch space, with or without `scale`."""
    x = logits.float()  # a new FP32 tensor, or `logits` itself when they already are FP32
    valid = labels != ignore_index
    target = torch.where(valid, labels, 0).unsqueeze(1)
    picked = x.gather(1, target).squeeze(1)
    # max, exp and sum in place: no second rows x vocab temporary, as logsumexp would make.
    top = x.amax(1, keepdim=True)
    x.sub_(top).exp_()
    total = x.sum(1, keepdim=True)
    loss = torch.where(valid, (top + total.log()).squeeze(1) - picked, 0.0)
    if scale is not None:
        x.mul_(scale / total)  # softmax over the denominator, in one pass
        x.scatter_add_(1, target, (valid * -scale).unsqueeze(1))
        # Zeroed last: unlabelled rows get exactly 0, whatever their logits or a zero denominator made.
        x.masked_fill_(~valid.unsqueeze(1), 0.0)
        if x is not logits:
            logits.copy_(x)
    return loss
