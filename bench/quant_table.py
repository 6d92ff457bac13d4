"""The moment quantization table (the analogue of Table 1 of the COAT paper): how much FP8
storage of real AdamW moments perturbs the update m / sqrt(v).

    python bench/quant_table.py [--preset small --steps 150 --json docs/img/quant_table.json]

Trains a preset with torch AdamW, then the MSE of m / sqrt(v) after a quantize -> dequantize
round trip of its moments for every pair of {E4M3, E5M2} x {DRE or not} (groups of 128), and
groups holding exact zeros: our DRE against OUR MODEL of the published reference kernel's
choice of min (see `reference_kernel_roundtrip`).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys
import time

import _common as C  # noqa: F401  (puts the measured tree's coat_ds on the path)
import torch

from coat_ds.train.data import DataConfig, batch_seed, load_data  # noqa: E402
from coat_ds.kernels import get_format, reference as R  # noqa: E402
from coat_ds.models.llama import Llama, model_config  # noqa: E402

FORMATS = [("e4m3", False), ("e4m3", True), ("e5m2", False), ("e5m2", True)]
EPS = 1e-8  # AdamW's eps, added to sqrt(v) as the update does
GROUP = 128


def label(fmt: str, dre: bool) -> str:
    return fmt.upper() + ("+DRE" if dre else "")


def train_moments(preset: str, steps: int, batch_size: int, seq_len: int, seed: int, lr: float,
                  data=None) -> tuple[list[tuple[str, torch.Tensor, torch.Tensor]], float, float]:
    """Train `preset` with torch AdamW; return [(name, m, v)] of the tensors with >= 4096
    elements, and the first and last train loss (so a reader sees that it trained)."""
    torch.manual_seed(seed)
    data = data or load_data(DataConfig(max_bytes=4_000_000))
    model = Llama(model_config(preset))
    # OLMo's betas (0.9, 0.95), which the paper's runs use: beta2 sets how far v lags g^2.
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    first = last = float("nan")
    for step in range(steps):
        x, y = data.batch("train", batch_size, seq_len, batch_seed(seed, step, 0, 0))
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        first = loss.item() if step == 0 else first
        last = loss.item()
    moments = [(n, opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone())
               for n, p in model.named_parameters() if p.numel() >= 4096]
    return moments, first, last


def roundtrip(x: torch.Tensor, fmt: str, dre: bool) -> torch.Tensor:
    return R.dequantize_groups(R.quantize_groups(x, GROUP, fmt, dre), GROUP, fmt)


def update_sq_err(m, v, mq, vq) -> torch.Tensor:
    """Squared error of m / (sqrt(v) + eps) per element."""
    return (mq / (vq.sqrt() + EPS) - m / (v.sqrt() + EPS)) ** 2


def quant_table(moments) -> dict[tuple[str, str], float]:
    """MSE of m/sqrt(v) over all elements of all tensors, per (first, second) format."""
    out = {}
    for fm, dm in FORMATS:
        mqs = [roundtrip(m, fm, dm) for _, m, _ in moments]
        for fv, dv in FORMATS:
            total, n = 0.0, 0
            for (_, m, v), mq in zip(moments, mqs):
                total += update_sq_err(m, v, mq, roundtrip(v, fv, dv)).sum().item()
                n += m.numel()
            out[(label(fm, dm), label(fv, dv))] = total / n
    return out


# ---- A model of the published reference kernel's DRE, for the zero-group comparison --------
#
# What the COAT reference CUDA kernel (fp8_adamw_expand) does per group of 128, as we read it:
# min and max are taken over |x| of ALL elements, zeros included, and 1e-20 is added to both;
# k = floor(16 * log2(448^2 / 2) / log2(max / min)) / 16; c = sqrt(max * min);
# y = sign(x) * (|x| / c)^k, scale = (max / c)^k / 448, code = fp8(y / scale);
# decode x = sign(q) * (q * scale)^(1/k) * c. E4M3 only there; we let `fmt` vary for symmetry.
# This is OUR code modelling that behaviour to measure its defect, not the reference's code.
REF_EPS = 1e-20
REF_K_STEPS = 16  # k rounded down to a multiple of 1/16, as our K_ONE


def reference_kernel_roundtrip(x: torch.Tensor, fmt: str = "e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize -> dequantize flat `x` (numel a multiple of 128) the reference kernel's way:
    (decoded values, per-group k)."""
    f = get_format(fmt)
    g = x.reshape(-1, GROUP).to(torch.float32)
    a = g.abs()
    amax = a.amax(-1) + REF_EPS
    amin = a.amin(-1) + REF_EPS  # the defect: an exact zero makes this 1e-20
    target = math.log2(f.max * f.max / 2)
    # A constant or all-zero group has log2(max/min) = 0: k = +inf, as in the kernel.
    k = torch.floor(REF_K_STEPS * target / torch.log2(amax / amin)) / REF_K_STEPS
    c = torch.sqrt(amax * amin)
    scale = torch.pow(amax / c, k) / f.max
    y = torch.pow(a / c[:, None], k[:, None]) / scale[:, None]
    q = R.decode_fp8(R.encode_fp8(y, f), f)  # saturating, round-to-nearest-even, as the cast
    q = torch.where(g < 0, -q, q)
    # The decode takes its sign from the sign bit (+0 counts as positive), and with k = inf
    # it computes pow(q * scale, 0) = 1 even for q = 0: an all-zero group decodes to +c = 1e-20.
    dec = torch.pow(q.abs() * scale[:, None], 1.0 / k[:, None]) * c[:, None]
    return torch.where(torch.signbit(q), -dec, dec).reshape(x.shape), k


def zero_group_study(moments, fmt: str = "e4m3") -> dict:
    """Flat moment buffer (tensors concatenated, groups of 128 consecutive elements: the
    layout of a DeepSpeed ZeRO-1/2 partition and of the reference kernel) split into groups
    that are all nonzero, mixed (some exact zeros) and all zero; MSE of m/sqrt(v) with our
    DRE and with the reference kernel's min, per kind of group."""
    m = torch.cat([t.flatten() for _, t, _ in moments])
    v = torch.cat([t.flatten() for _, _, t in moments])
    n = m.numel() // GROUP * GROUP  # drop a ragged tail: the model handles full groups only
    m, v = m[:n], v[:n]
    ours_m, ours_v = roundtrip(m, fmt, True), roundtrip(v, fmt, True)
    ref_m, k_m = reference_kernel_roundtrip(m, fmt)
    ref_v, k_v = reference_kernel_roundtrip(v, fmt)
    zeros = (m == 0).reshape(-1, GROUP).sum(-1)
    kinds = {"nonzero": zeros == 0, "mixed": (zeros > 0) & (zeros < GROUP), "all_zero": zeros == GROUP}
    err_ours = update_sq_err(m, v, ours_m, ours_v).reshape(-1, GROUP)
    err_ref = update_sq_err(m, v, ref_m, ref_v).reshape(-1, GROUP)
    # Our kcode for the same groups, on the flat layout (one row of n elements).
    ours_k = R.quantize_groups(m, GROUP, fmt, True).kcode.float().flatten() / 16
    out = {"format": fmt, "groups": int(zeros.numel())}
    for name, sel in kinds.items():
        row = {"groups": int(sel.sum())}
        if row["groups"]:
            mse = lambda e: e[sel].mean().item()  # noqa: E731
            row.update(mse_ours=mse(err_ours), mse_reference_model=mse(err_ref),
                       k_m_ours_median=ours_k[sel].median().item(),
                       k_m_reference_median=k_m[sel].median().item(),
                       k_v_reference_median=k_v[sel].median().item())
            nz = (m.reshape(-1, GROUP) != 0) & sel[:, None]
            if nz.any():
                rel = lambda d: ((d.reshape(-1, GROUP) - m.reshape(-1, GROUP)).abs()[nz]  # noqa: E731
                                 / m.reshape(-1, GROUP).abs()[nz]).median().item()
                row.update(m_rel_err_median_ours=rel(ours_m), m_rel_err_median_reference_model=rel(ref_m))
            else:
                row.update(decoded_m_ours_max=ours_m.reshape(-1, GROUP)[sel].abs().max().item(),
                           decoded_m_reference_max=ref_m.reshape(-1, GROUP)[sel].abs().max().item(),
                           decoded_v_reference_max=ref_v.reshape(-1, GROUP)[sel].abs().max().item())
        out[name] = row
    return out


def planted_zero_study(moments, fmt: str = "e4m3") -> dict:
    """Controlled version on real values: in every all-nonzero group of the flat buffer, set
    the first element of m and v to exact zero (as if that coordinate never got a gradient)
    and measure the error on the other 127 elements, ours vs the reference-kernel model."""
    m = torch.cat([t.flatten() for _, t, _ in moments])
    v = torch.cat([t.flatten() for _, _, t in moments])
    n = m.numel() // GROUP * GROUP
    mg, vg = m[:n].reshape(-1, GROUP), v[:n].reshape(-1, GROUP)
    keep = (mg != 0).all(-1) & (vg != 0).all(-1)
    mg, vg = mg[keep].clone(), vg[keep].clone()
    mg[:, 0] = 0.0
    vg[:, 0] = 0.0
    m, v = mg.flatten(), vg.flatten()
    rest = torch.ones_like(mg, dtype=torch.bool)
    rest[:, 0] = False
    rest = rest.flatten()
    out = {"format": fmt, "groups": int(keep.sum())}
    for name, (mq, vq) in {"ours": (roundtrip(m, fmt, True), roundtrip(v, fmt, True)),
                           "reference_model": (reference_kernel_roundtrip(m, fmt)[0],
                                               reference_kernel_roundtrip(v, fmt)[0])}.items():
        out[f"mse_{name}"] = update_sq_err(m, v, mq, vq)[rest].mean().item()
        out[f"m_rel_err_median_{name}"] = ((mq - m).abs()[rest] / m.abs()[rest]).median().item()
        out[f"v_rel_err_median_{name}"] = ((vq - v).abs()[rest] / v.abs()[rest]).median().item()
    return out


def markdown(table: dict, zero: dict, planted: dict) -> str:
    cols = [label(*f) for f in FORMATS]
    best = min(table.values())
    lines = [f"| first \\ second | {' | '.join(cols)} |", "|---" * (len(cols) + 1) + "|"]
    for r in cols:
        cells = []
        for c in cols:
            s = f"{table[(r, c)]:.4g}"
            cells.append(f"**{s}**" if table[(r, c)] == best else s)
        lines.append(f"| {r} | {' | '.join(cells)} |")
    lines.append("")
    lines.append(f"DRE gain, E4M3/E4M3 -> E4M3+DRE/E4M3+DRE: "
                 f"{table[('E4M3', 'E4M3')] / table[('E4M3+DRE', 'E4M3+DRE')]:.2f}x")
    lines.append("")
    lines.append(f"Zero-containing groups (flat buffer, {zero['format'].upper()}, groups of {GROUP}):")
    lines.append("")
    lines.append("| groups | count | MSE ours | MSE reference-kernel model | median k(m) ours | "
                 "median k(m) ref. model | median rel. err of nonzero m, ours | same, ref. model |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for name in ("nonzero", "mixed", "all_zero"):
        z = zero[name]
        if not z["groups"]:
            lines.append(f"| {name} | 0 | | | | | | |")
            continue
        lines.append(f"| {name} | {z['groups']} | {z['mse_ours']:.4g} | {z['mse_reference_model']:.4g} | "
                     f"{z['k_m_ours_median']:.4g} | {z['k_m_reference_median']:.4g} | "
                     + (f"{z['m_rel_err_median_ours']:.3g} | {z['m_rel_err_median_reference_model']:.3g} |"
                        if "m_rel_err_median_ours" in z else
                        f"decodes to max {z['decoded_m_ours_max']:.3g} | decodes to max "
                        f"{z['decoded_m_reference_max']:.3g} (v: {z['decoded_v_reference_max']:.3g}) |"))
    lines.append("")
    lines.append(f"One exact zero planted into each of {planted['groups']} real all-nonzero groups "
                 f"(error on the other 127 elements):")
    lines.append("")
    lines.append("| quantizer | MSE of m/sqrt(v) | median rel. err of m | median rel. err of v |")
    lines.append("|---|---|---|---|")
    for name, title in (("ours", "ours (min over nonzeros)"), ("reference_model", "reference-kernel model")):
        lines.append(f"| {title} | {planted['mse_' + name]:.4g} | {planted['m_rel_err_median_' + name]:.3g} | "
                     f"{planted['v_rel_err_median_' + name]:.3g} |")
    return "\n".join(lines)



def run_quant_table(args, argv) -> int:
    t0 = time.time()
    data = load_data(DataConfig(max_bytes=4_000_000))
    moments, l0, l1 = train_moments(args.preset, args.steps, args.batch_size, args.seq_len, args.seed, args.lr, data)
    table = quant_table(moments)
    zmoments, zl0, zl1 = train_moments(args.zero_preset, args.zero_steps, args.batch_size, args.seq_len,
                                       args.seed, args.lr, data)
    zero, planted = zero_group_study(zmoments), planted_zero_study(moments)
    meta = dict(command="python bench/quant_table.py " + " ".join(argv),
                device=f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                torch=torch.__version__, preset=args.preset, steps=args.steps,
                tokens_per_step=args.batch_size * args.seq_len, loss_first=l0, loss_last=l1,
                zero_preset=args.zero_preset, zero_loss_first=zl0, zero_loss_last=zl1,
                elements=sum(m.numel() for _, m, _ in moments), seconds=round(time.time() - t0, 1))
    print(json.dumps(meta, indent=1))
    print(markdown(table, zero, planted))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, table={f"{a} / {b}": e for (a, b), e in table.items()}, zero_groups=zero,
                           planted_zero=planted), f, indent=1)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    q = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    q.add_argument("--preset", default="small", help="model preset for the table (default: small, ~3.3M)")
    q.add_argument("--steps", type=int, default=150)
    q.add_argument("--batch-size", type=int, default=16)
    q.add_argument("--seq-len", type=int, default=128)
    q.add_argument("--lr", type=float, default=1e-3)
    q.add_argument("--zero-preset", default="tiny", help="preset for the zero-group study: tiny's 64-wide embedding "
                   "rows put two rows (one used byte, one unused) into some 128-groups of the flat buffer")
    q.add_argument("--zero-steps", type=int, default=150)
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--json", default="", help="also write the numbers here")
    return run_quant_table(q.parse_args(argv), argv)


if __name__ == "__main__":
    sys.exit(main())
