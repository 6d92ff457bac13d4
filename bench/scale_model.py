"""Tokens/s beyond one host, predicted: FSDP2 (ZeRO-3's pattern: each layer's weights gathered
before its forward and again before its backward, its gradients reduce-scattered after) from
compute and communication measured on one host, for BF16 and coat_ds, at 1-512 GPUs.

    python bench/scale_model.py --fit-gpus 2 --fit bf16=25544 speed=35619 --trace DIR/speed.json.gz \\
        --check 4:bf16=51194,speed=71999 [--hsdp]

(the trace: `train.py --trace`'s of the fitted run, results/2026-11-28d/fsdp2_7b_trace_2gpu.sh;
without one, --host-gbs)

The model, per rank and step, for a model of L decoder layers of P_l parameters each:
- compute C: the measured step (tokens per rank / tokens/s per GPU at --fit-gpus, where a trace
  shows the collectives hidden under compute), a third of it forward. Another preset's C comes
  from the same MFU (its FLOPs per token, train.py's count).
- each collective moves (N-1)/N of a layer's bytes through each rank at the bus bandwidth:
  NVLink's within a host (fitted from the trace's NCCL kernels: bytes over duration), the
  network's across hosts (--net-gbs: one 400 Gb/s NIC per GPU by default), plus a latency per
  ring step (--hop-us).
- a layer's gather hides under the previous layer's forward; its gather and the next layer's
  reduce-scatter hide under its backward; what exceeds that compute shows, and the first
  gather and last reduce-scatter always do.
Sides: bf16 and speed gather BF16 weights and reduce-scatter FP32 gradients (FSDP2's mixed
precision as train.py sets it); speed_fp8_gather is speed gathering 1-byte FP8 weights (the
compute it needs assumed unchanged)."""
from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys

import _common  # noqa: F401  (puts the measured tree's coat_ds on the path)
from coat_ds.models.llama import model_config
from coat_ds.train.mfu import flops_per_token

PEAK = 989e12  # H100 SXM / H200 dense BF16, the MFU basis of the fit
# Bytes per parameter each side's collectives move: (all-gather, reduce-scatter).
SIDES = {"bf16": (2, 4), "speed": (2, 4), "speed_fp8_gather": (1, 4), "max_memory": (2, 4)}
# Training state, bytes per parameter, as train.py counts it: BF16 + torch AdamW (FP32 master,
# moments, gradient); coat with FP32 masters and FP8 moments; max_memory with bf16+8 masters,
# stepping in backward without clipping.
STATE_BYTES = {"bf16": 16.0, "speed": 10.13, "speed_fp8_gather": 10.13, "max_memory": 5.12}
# Sides that recompute every layer's forward in backward: speed's kernels, a third more work.
RECOMPUTED = {"max_memory"}
GPUS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def trace_bus_gbs(path: str) -> dict[str, float]:
    """Bus bandwidth, GB/s, of each collective kind in a chrome trace: (N-1)/N of the larger
    message's bytes over the NCCL kernel's duration, the median of the faster half of the calls
    (the slower half include time waiting for the other rank to arrive)."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    # record_param_comms (the host's record of a collective) and its NCCL kernel share an order.
    comms = {"AllGather": [], "ReduceScatter": []}
    for e in events:
        a = e.get("args", {})
        if e.get("name") == "record_param_comms" and a.get("Collective name") in ("_allgather_base",
                                                                                  "_reduce_scatter_base"):
            kind = "AllGather" if "allgather" in a["Collective name"] else "ReduceScatter"
            size = 2 if a["dtype"] in ("BFloat16", "Half") else 4 if a["dtype"] == "Float" else 1
            comms[kind].append((e["ts"], max(a["In msg nelems"], a["Out msg nelems"]) * size, a["Group size"]))
    kernels = {k: sorted((e["ts"], e["dur"]) for e in events if e.get("cat") == "kernel"
                         and e["name"].startswith(f"ncclDevKernel_{k}")) for k in comms}
    out = {}
    for kind, calls in comms.items():
        calls.sort()
        if not calls or len(calls) != len(kernels[kind]):
            continue
        bw = sorted((n - 1) / n * nbytes / (dur * 1e-6) / 1e9
                    for (_, nbytes, n), (_, dur) in zip(calls, kernels[kind]) if dur > 0 and n > 1)
        if bw:
            out[kind] = statistics.median(bw[len(bw) // 2:])
    return out


def layer_params(preset: str, vocab: int) -> tuple[int, float]:
    cfg = model_config(preset, vocab_size=vocab)
    return cfg.n_layers, (cfg.num_params() - 2 * vocab * cfg.dim) / cfg.n_layers


def activation_bytes(preset: str, micro: int, seq: int, vocab: int, side: str) -> float:
    """Saved activations of a step: 34 bytes per token and hidden unit in each layer
    (Korthikanti et al. 2022, attention's scores left to a fused kernel), BF16's count, taken
    for coat too; a recomputing side keeps each layer's input in FP8 and one layer's whole."""
    cfg = model_config(preset, vocab_size=vocab)
    per_layer = seq * micro * cfg.dim
    return (cfg.n_layers + 34.0) * per_layer if side in RECOMPUTED else 34.0 * per_layer * cfg.n_layers


def shard_ranks(n: int, args) -> int:
    """Ranks each parameter is sharded over at `n` GPUs: all of them, or a host's under HSDP."""
    return min(n, args.gpus_per_host) if args.hsdp else n


def work_flops(side: str, preset: str, micro: int, args) -> float:
    """FLOPs one rank's step runs: the model's (train.py's count), a third more where every
    forward runs again in backward."""
    per_token = flops_per_token(model_config(preset, vocab_size=args.vocab), args.seq)
    return micro * args.seq * per_token * (4 / 3 if side in RECOMPUTED else 1)


def step_s(compute: float, layers: int, p_layer: float, side: str, n: int, args) -> tuple[float, float]:
    """(predicted step seconds, of which communication that shows) at `n` GPUs; `compute` counts
    a recomputing side's second forward, which runs in backward."""
    if n == 1:
        return compute, 0.0
    ag_b, rs_b = SIDES[side]
    hosts = -(-n // args.gpus_per_host)
    # HSDP shards within a host and all-reduces the gradient shards across hosts once a step.
    shard = shard_ranks(n, args)
    gbs, hop = (args.host_gbs, args.host_hop_us) if shard <= args.gpus_per_host else (args.net_gbs, args.hop_us)
    move = (shard - 1) / shard * p_layer / (gbs * 1e9)
    ag, rs = ag_b * move + (shard - 1) * hop * 1e-6, rs_b * move + (shard - 1) * hop * 1e-6
    fwd_share = 1 / 4 if side in RECOMPUTED else 1 / 3
    fwd, bwd = fwd_share * compute / layers, (1 - fwd_share) * compute / layers
    shown = (layers - 1) * (max(0.0, ag - fwd) + max(0.0, ag + rs - bwd)) + 2 * ag + rs
    if args.hsdp and hosts > 1:
        # Each layer's shard is all-reduced across hosts (a ring: twice its bytes) as backward
        # goes on; what outlasts the rest of backward shows, and the last layer's always does.
        per_layer = 2 * (hosts - 1) / hosts * rs_b * p_layer / shard / (args.net_gbs * 1e9) + 2 * (hosts - 1) * args.hop_us * 1e-6
        shown += max(0.0, layers * per_layer - (layers - 1) * bwd) + per_layer
    return compute + shown, shown


def compute_mfu(tps: float, side: str, args) -> float:
    """The FLOP rate of a side's compute alone, over PEAK: its work over the fitted step less
    the communication that shows there (the first gather and last reduce-scatter, little on one
    host), solved by iteration."""
    layers, p_layer = layer_params(args.fit_preset, args.vocab)
    step = args.fit_micro * args.seq * args.fit_gpus / tps
    compute = step
    for _ in range(20):
        compute = step - step_s(compute, layers, p_layer, side, args.fit_gpus, args)[1]
    return work_flops(side, args.fit_preset, args.fit_micro, args) / compute / PEAK


def predict(args) -> list[str]:
    mfu = {s: compute_mfu(tps, s, args) for s, tps in args.fit.items()}
    for side in ("speed_fp8_gather", "max_memory"):  # speed's kernels: fewer bytes gathered, or every forward twice
        if "speed" in mfu:
            mfu.setdefault(side, mfu["speed"])

    def per_gpu(side: str, preset: str, micro: int, n: int) -> tuple[float, float] | None:
        """(tokens/s per GPU, share of the step communication shows), None where the side's
        training state and activations outgrow the GPU."""
        layers, p_layer = layer_params(preset, args.vocab)
        if STATE_BYTES[side] * layers * p_layer / shard_ranks(n, args) + activation_bytes(
                preset, micro, args.seq, args.vocab, side) > args.gpu_gb * 1e9:
            return None
        t, shown = step_s(work_flops(side, preset, micro, args) / (mfu[side] * PEAK), layers, p_layer, side, n, args)
        return micro * args.seq / t, shown / t

    lines = [f"fit: {args.fit_preset}, micro-batch {args.fit_micro} x {args.seq}, {args.fit_gpus} GPUs: "
             + ", ".join(f"{s} compute at {m:.1%} MFU" for s, m in mfu.items() if s in args.fit)
             + f"; bus GB/s within a host {args.host_gbs:.0f}, across hosts {args.net_gbs:.0f}, "
             f"{args.gpus_per_host} GPUs a host, ring step {args.host_hop_us:g} / {args.hop_us:g} us"
             + ("; HSDP: sharded within each host, replicated across hosts" if args.hsdp else "")]
    sides = [s for s in SIDES if mfu.get(s)]
    if args.check:
        lines += ["", "| check: GPUs | preset, micro-batch | side | measured tokens/s | predicted | error |",
                  "|---|---|---|---|---|---|"]
        for n, measured, (preset, micro) in args.check:
            for side, tps in measured.items():
                got = per_gpu(side, preset, micro, n)
                pred = "no fit" if got is None else f"{n * got[0]:,.0f} | {100 * (n * got[0] / tps - 1):+.1f}%"
                lines.append(f"| {n} | {preset}, {micro} | {side} | {tps:,.0f} | {pred} |")
    for preset, micro in args.presets:
        layers, p_layer = layer_params(preset, args.vocab)
        lines += ["", f"{preset}, micro-batch {micro} x {args.seq} per GPU: tokens/s per GPU (communication "
                  "showing, % of the step)" + ("" if not args.hsdp else "; training state per GPU beyond one host: "
                  + ", ".join(f"{s} {STATE_BYTES[s] * layers * p_layer / args.gpus_per_host / 1e9:.0f} GB"
                              for s in sides))
                  + f"; 'no fit': training state and activations over {args.gpu_gb:g} GB",
                  "| GPUs | " + " | ".join(sides) + " | " + " | ".join(f"{s} / bf16" for s in sides if s != "bf16")
                  + " |", "|---" * (2 * len(sides)) + "|"]
        for n in GPUS:
            row = {s: per_gpu(s, preset, micro, n) for s in sides}
            cell = lambda s: "no fit" if row[s] is None else f"{row[s][0]:,.0f} ({100 * row[s][1]:.0f}%)"  # noqa: E731
            ratio = lambda s: f"{row[s][0] / row['bf16'][0]:.2f}x" if row[s] and row.get("bf16") else "-"  # noqa: E731
            lines.append(f"| {n} | " + " | ".join(map(cell, sides)) + " | "
                         + " | ".join(ratio(s) for s in sides if s != "bf16") + " |")
    return lines


def _pairs(text: str) -> dict[str, float]:
    out = {}
    for item in text.split(","):
        side, _, value = item.partition("=")
        if side not in SIDES or not value:
            raise argparse.ArgumentTypeError(f"{item!r}: want SIDE=TOKENS_PER_S, SIDE one of {', '.join(SIDES)}")
        out[side] = float(value)
    return out


def _check(text: str) -> tuple[int, dict[str, float], tuple[str, int] | None]:
    run, _, where = text.partition("@")
    gpus, _, pairs = run.partition(":")
    preset, _, micro = where.partition(":")
    return int(gpus), _pairs(pairs), (preset, int(micro)) if where else None


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", nargs="+", required=True, type=_pairs,
                    help="SIDE=TOKENS_PER_S: each side's tokens/s (all GPUs) in the fitted run")
    ap.add_argument("--fit-gpus", type=int, default=2)
    ap.add_argument("--fit-preset", default="7b")
    ap.add_argument("--fit-micro", type=int, default=6)
    ap.add_argument("--check", nargs="*", default=[], type=_check,
                    help="GPUS:SIDE=TOKENS_PER_S,...[@PRESET:MICRO]: measured elsewhere (default: the fitted "
                    "preset and micro-batch), to set beside the prediction")
    ap.add_argument("--trace", default="", help="a train.py --trace of the fitted run: the host's bus bandwidth")
    ap.add_argument("--host-gbs", type=float, default=0.0, help="bus GB/s within a host (default: the trace's)")
    ap.add_argument("--net-gbs", type=float, default=45.0, help="bus GB/s per GPU across hosts")
    ap.add_argument("--gpus-per-host", type=int, default=8)
    ap.add_argument("--host-hop-us", type=float, default=2.0)
    ap.add_argument("--hop-us", type=float, default=6.0, help="latency of one ring step across hosts")
    ap.add_argument("--presets", nargs="+", default=[("7b", 6), ("70b", 1)], type=lambda s: (s.split(":")[0], int(s.split(":")[1])),
                    help="PRESET:MICRO_BATCH to predict")
    ap.add_argument("--gpu-gb", type=float, default=141.0,
                    help="GPU memory: a side whose training state and activations exceed it is not predicted")
    ap.add_argument("--hsdp", action="store_true", help="shard within a host, replicate across hosts")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    args = ap.parse_args(argv)
    args.fit = {k: v for d in args.fit for k, v in d.items()}
    args.check = [(n, m, where or (args.fit_preset, args.fit_micro)) for n, m, where in args.check]
    if not args.host_gbs:
        if not args.trace:
            ap.error("give --trace (the fitted run's) or --host-gbs")
        bw = trace_bus_gbs(args.trace)
        if not bw:
            ap.error(f"{args.trace}: no NCCL all-gather or reduce-scatter with its record_param_comms")
        args.host_gbs = min(bw.values())
        print("bus bandwidth in the trace, GB/s: " + ", ".join(f"{k} {v:.0f}" for k, v in bw.items()))
    return args


def main(argv=None) -> None:
    print("\n".join(predict(parse(sys.argv[1:] if argv is None else list(argv)))))


if __name__ == "__main__":
    main()
