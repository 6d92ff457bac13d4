"""GPU kernels against the pure-torch reference, one table: where do they differ and by how much.

    python bench/kernel_check.py

Complements tests/test_kernels.py (which asserts bounds) with the raw agreement figures."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from coat_ds.kernels import AdamWHyper, AdamWSlot, E4M3, E5M2, get_ops, reference as R  # noqa: E402
from helpers import moments_like  # noqa: E402


def main() -> None:
    dev = torch.device("cuda")
    tri = get_ops(dev, "triton")
    rows = []
    for fmt in (E4M3, E5M2):
        vals = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float()
        x = torch.cat([vals[torch.isfinite(vals)], torch.randn(100000) * fmt.max / 16])
        c, o = tri.cast_fp8(x.to(dev), fmt)
        rc, ro = R.cast_fp8(x, fmt)
        bad = (c.cpu() != rc).nonzero().flatten()
        rows.append((f"cast {fmt.name}", f"{len(bad)} code mismatches",
                     f"first: x={x[bad[:3]].tolist()} gpu={c.cpu()[bad[:3]].tolist()} ref={rc[bad[:3]].tolist()}"))
    m, v = moments_like((256, 1024), seed=3)
    for name, x in (("m", m), ("v", v)):
        for fmt in ("e4m3", "e5m2"):
            qt = tri.quantize_groups(x.to(dev), 128, fmt, True)
            qr = R.quantize_groups(x, 128, fmt, True)
            dt = tri.dequantize_groups(qt, 128, fmt).cpu()
            dr = R.dequantize_groups(qr, 128, fmt)
            rel = ((dt - dr).abs() / dr.abs().clamp_min(1e-30))[dr != 0]
            err_t = ((dt - x).abs() / x.abs())[x != 0].mean().item()
            err_r = ((dr - x).abs() / x.abs())[x != 0].mean().item()
            rows.append((f"quantize {name} {fmt}",
                         f"codes {(qt.codes.cpu() == qr.codes).float().mean():.4f} kcode "
                         f"{(qt.kcode.cpu() == qr.kcode).float().mean():.4f} sexp {(qt.sexp.cpu() == qr.sexp).float().mean():.4f}",
                         f"dequant rel diff mean {rel.mean():.2e} max {rel.max():.2e}; err vs x gpu {err_t:.4f} ref {err_r:.4f}"))
    shapes = [(3, 130), (5, 256), (1000,)]
    slots = []
    for i, sh in enumerate(shapes):
        mm, vv = moments_like(sh, 10 + i)
        slots.append(AdamWSlot(torch.randn(sh), torch.randn(sh) * 1e-2, R.quantize_groups(mm), R.quantize_groups(vv)))
    ref = copy.deepcopy(slots)
    gpu = [AdamWSlot(s.param.to(dev), s.grad.to(dev), s.exp_avg.to(dev), s.exp_avg_sq.to(dev)) for s in slots]
    h = AdamWHyper.at_step(1, 1e-3, 0.9, 0.999, 1e-8, 0.1)
    tri.adamw_step(gpu, h)
    R.adamw_step(ref, h)
    for s, r in zip(gpu, ref):
        d = (s.param.cpu() - r.param).abs()
        upd = (r.param - torch.as_tensor(0)).abs()
        rows.append((f"adamw step {tuple(r.param.shape)}", f"param diff max {d.max():.2e} p99 {d.quantile(0.99):.2e}",
                     f"m codes eq {(s.exp_avg.codes.cpu() == r.exp_avg.codes).float().mean():.4f} "
                     f"v codes eq {(s.exp_avg_sq.codes.cpu() == r.exp_avg_sq.codes).float().mean():.4f} "
                     f"v sexp eq {(s.exp_avg_sq.sexp.cpu() == r.exp_avg_sq.sexp).float().mean():.3f} "
                     f"v kcode eq {(s.exp_avg_sq.kcode.cpu() == r.exp_avg_sq.kcode).float().mean():.3f}"))
        del upd
    for r in rows:
        print(" | ".join(r))


if __name__ == "__main__":
    main()
