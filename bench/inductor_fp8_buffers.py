"""How many FP8 buffers Inductor writes for one FP8 copy read by three `_scaled_mm` (q/k/v).

The post-grad graph has one cast node feeding the three GEMMs, yet Inductor's `_scaled_mm`
lowering materializes the cast once per GEMM (a plain `mm` shares one buffer). Forcing the
cast's layout (`prims.inductor_force_stride_order`) makes it one buffer. Runs on CPU
(the lowering is the same); this counts buffers, it does not time anything.

    python bench/inductor_fp8_buffers.py
"""
from __future__ import annotations

import torch
from torch._inductor.utils import run_and_get_code


def qkv(x, w1, w2, w3, force: bool):
    amax = x.abs().amax().float().clamp(min=1e-12)
    xq = (x.float() * (448.0 / amax)).clamp(-448, 448).to(torch.float8_e4m3fn)
    if force:
        xq = torch.ops.prims.inductor_force_stride_order.default(xq, xq.stride())
    inv = amax / 448.0
    one = torch.ones((), dtype=torch.float32, device=x.device)
    return [torch._scaled_mm(xq, w.t(), inv, one, out_dtype=torch.bfloat16) for w in (w1, w2, w3)]


def main():
    x = torch.randn(64, 128, dtype=torch.bfloat16)
    ws = [torch.randn(128, 128).to(torch.float8_e4m3fn) for _ in range(3)]
    print(f"torch {torch.__version__}")
    for force in (False, True):
        torch._dynamo.reset()
        _, code = run_and_get_code(torch.compile(lambda *a: qkv(*a, force=force)), x, *ws)
        n = sum("empty_strided" in ln and "float8_e4m3fn" in ln for ln in code[0].splitlines())
        print(f"force_stride_order={force}: {n} FP8 buffer(s) written for 3 GEMMs")


if __name__ == "__main__":
    main()
