"""One FP8 linear layer alone, on a GPU: its quantize(+transpose) kernels against a same-size
copy (--kernels), and one layer's eager forward + backward, nn.Linear under BF16 autocast
against Fp8Linear, by Llama layer shape (--crossover: where FP8 pays). Both when neither is named.

    python bench/fp8_layer.py --kernels
    python bench/fp8_layer.py --crossover
"""
from __future__ import annotations

import argparse

import _common as C
import torch


def bench_kernels() -> list[str]:
    """Quantize(+transpose) against a same-size copy; GB/s counts each byte the kernels must move
    once (read x, write the codes): the max pass reads x a second time, a held guess does not."""
    from coat_ds.kernels import get, reference
    from coat_ds.kernels.fp8_linear import linear_quantize_triton as linear_quantize, new_guess

    get("fp8_linear", torch.device("cuda"), "triton")  # compiles the module's kernels
    rows = ["| tensor | layouts | ours us | GB/s (unique bytes) | copy GB/s | ours / copy | torch twin us |",
            "|---|---|---|---|---|---|---|"]
    for name, shape, dtype in (("x 16384x4096 bf16", (16384, 4096), torch.bfloat16),
                               ("x 16384x11008 bf16", (16384, 11008), torch.bfloat16),
                               ("W 11008x4096 fp32", (11008, 4096), torch.float32),
                               ("g 16384x4096 bf16", (16384, 4096), torch.bfloat16)):
        x = torch.randn(shape, device="cuda", dtype=dtype)
        copy_bw = 2 * x.numel() * x.element_size() / C.device_ms(lambda: x.clone()) / 1e6
        held = new_guess(reference.linear_quantize(x, "e4m3")[2])  # a weight's path: last time's exponent
        for row, col, label, guess in ((True, False, "row", None), (False, True, "transposed", None),
                                       (True, True, "both", None), (True, True, "both, guessed", held)):
            ms = C.device_ms(lambda: linear_quantize(x, "e4m3", row, col, guess=guess))
            twin = C.device_ms(lambda: reference.linear_quantize(x, "e4m3", row, col), 5)
            bw = x.numel() * (x.element_size() + row + col) / ms / 1e6
            rows.append(f"| {name} | {label} | {ms * 1e3:.0f} | {bw:.0f} | {copy_bw:.0f} | {bw / copy_bw:.2f} | {twin * 1e3:.0f} |")
        got, want = linear_quantize(x, "e4m3", True, True), reference.linear_quantize(x, "e4m3", True, True)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and int(got[2]) == int(want[2]), name
    return rows


def crossover(tokens_list=(4096, 8192, 16384)) -> list[str]:
    """Eager forward + backward of one linear layer, nn.Linear under BF16 autocast against
    coat_ds's Fp8Linear, FP32 weights: wall time per call, calls back to back (the host's
    dispatch counts where it is the bottleneck), at Llama layer shapes from ~110M to 7B."""
    import coat_ds

    rows = ["| in x out | tokens | BF16 us | FP8 us | FP8 / BF16 |", "|---|---|---|---|---|"]
    for k, n in ((768, 768), (768, 2048), (2048, 768), (1024, 1024), (2048, 2048), (2048, 5632), (4096, 4096),
                 (4096, 11008)):
        for tokens in tokens_list:
            times = []
            for fp8 in (False, True):
                layer = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False)).cuda()
                if fp8:
                    coat_ds.convert_to_fp8_linear(layer, module_filter_fn=lambda m, fqn: True)
                x = torch.randn(tokens, k, device="cuda", requires_grad=True)
                dy = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)

                def call():
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        y = layer(x)
                    y.backward(dy)
                    layer[0].weight.grad = x.grad = None

                times.append(C.wall_ms(call))
            rows.append(f"| {k} x {n} | {tokens} | {times[0] * 1e3:.0f} | {times[1] * 1e3:.0f} | {times[1] / times[0]:.2f} |")
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", action="store_true", help="microbenchmark the quantize/transpose kernels")
    ap.add_argument("--crossover", action="store_true", help="eager linear layer fwd+bwd, BF16 vs FP8, by shape")
    ap.add_argument("--out", default=None, help="folder for the results JSON")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    both = not (args.kernels or args.crossover)
    print(C.header(), flush=True)
    lines = (bench_kernels() if args.kernels or both else []) + (crossover() if args.crossover or both else [])
    C.finish(args, "fp8_layer", {"rows": lines}, lines)


if __name__ == "__main__":
    main()
