"""The profiler's three outputs: a Markdown table, a JSON file and a PNG chart."""
from __future__ import annotations

import json

from ..io.atomic import atomic_write
from ..memory.training_state import TrainingStateBytes

__all__ = ["markdown_table", "write_json", "write_markdown", "chart_stacks", "write_chart", "CHART_SIZE_PX",
           "COMPONENTS"]

GB = 1e9  # decimal gigabytes, as --budget-gb
CHART_SIZE_PX = (900, 560)  # width, height of the PNG
_DPI = 100
COMPONENTS = (("weights", "weights_bytes"), ("gradients", "gradients_bytes"),
              ("optimizer states", "optimizer_state_bytes"), ("engine buffers", "engine_buffer_bytes"))


def _gb(x) -> str:
    return "-" if x is None else f"{x / GB:.3f}"


def _ratio(x) -> str:
    return "- (the baseline fits no batch)" if x is None else f"{x:.2f}x"


def markdown_table(result: dict) -> str:
    """One row per side and rank; memory in GB (1e9 bytes)."""
    b1, b2 = result["measure_batches"]
    head = ("| side | rank | weights | gradients | optimizer states | activations / sample (hooks) "
            f"| activations @ b={b2}: hooks / meter after fwd / meter fwd peak | engine buffers "
            f"| sum of components @ b={b2} "
            f"| measured total @ b={b2} | max micro-batch | tokens/s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name in ("baseline", "coat"):
        side = result["sides"][name]
        label = f"{name} + FP8 linears" if side.get("fp8_linear") else name
        label += ", steps in backward" if side.get("step_in_backward") else ""
        for r in side["ranks"]:
            p = r["points"][-1]
            tps = side.get("tokens_per_s")
            # A side whose larger measured batch did not fit reports its smaller one.
            at = "" if p["batch"] == b2 else f" (b={p['batch']})"
            lines.append(
                f"| {label} | {r['rank']} | {_gb(r['weights_bytes'])} | {_gb(r['gradients_bytes'])} "
                f"| {_gb(r['optimizer_state_bytes'])} | {_gb(r['activation_bytes_per_sample'])} "
                f"| {_gb(p['hooks_bytes'])} / {_gb(p['after_forward_bytes'])} / {_gb(p['forward_peak_bytes'])}{at} "
                f"| {_gb(r['engine_buffer_bytes'])} "
                f"| {_gb(r['components_sum_bytes'])}{at} | {_gb(r['measured_total_bytes'])}{at} "
                f"| {side['max_micro_batch']} | {'-' if tps is None else f'{tps:,.0f}'} |")
    ratios = result["ratios"]
    lines.append("")
    lines.append(f"COAT / baseline (rank 0): optimizer states {ratios['optimizer_states']:.3f}x, "
                 f"activations per sample {ratios['activations_per_sample']:.3f}x, "
                 f"max micro-batch {_ratio(ratios['max_micro_batch'])}. Memory in GB (1e9 bytes), per rank; "
                 f"budget {_gb(result['budget_bytes'])} GB ({result['search']}). Meter: {result['meter']}.")
    lines += [_in_backward_note(name, result["sides"][name]) for name in ("baseline", "coat")
              if result["sides"][name].get("step_in_backward")]
    return "\n".join(lines + _training_state_lines(result))


def _training_state_lines(result: dict) -> list[str]:
    """Bytes per parameter of each rank's share (the model's parameters over the ranks), read
    from the live tensors after the last measured step (gradients after its backward)."""
    lines = []
    for name in ("baseline", "coat"):
        ranks = result["sides"][name]["ranks"]
        for r in ranks:
            if r.get("training_state_bytes"):
                state = TrainingStateBytes(**r["training_state_bytes"])
                lines.append(f"{name} rank {r['rank']}, training state in bytes per parameter: "
                             f"{state.describe(r['model_numel'] / len(ranks))}")
    return [""] + lines if lines else []


def _in_backward_note(name: str, side: dict) -> str:
    held = max(r.get("in_backward_gradient_bytes", 0) for r in side["ranks"])
    return (f"{name}: gradients are stepped in backward (CoatAdamW(step_in_backward=True)) and freed there: the "
            f"gradients column is what is held after backward; during it at most {_gb(held)} GB (one bucket plus "
            "the largest parameter's gradient), counted in the sum of components and the budget test.")


def write_json(result: dict, path: str) -> None:
    """Whole or not at all: a crash or a value json cannot encode leaves any earlier file as it was."""
    with atomic_write(path) as f:
        json.dump(result, f, indent=2)


def write_markdown(table: str, path: str) -> None:
    """Whole or not at all, like the JSON beside it."""
    with atomic_write(path) as f:
        f.write(table + "\n")


def chart_stacks(result: dict) -> list[tuple[str, list[float]]]:
    """The chart's stacked segments, (label, [baseline GB, coat GB]), rank 0: each bar is its
    side at its own max micro-batch, the batch its label names."""
    names = ("baseline", "coat")
    stacks = [(label, [result["sides"][n]["ranks"][0][key] / GB for n in names]) for label, key in COMPONENTS]
    stacks.append(("activations @ the side's max micro-batch",
                   [result["sides"][n]["activations_at_max_bytes"] / GB for n in names]))
    return stacks


def write_chart(result: dict, path: str) -> bool:
    """Stacked bars (rank 0): weights, gradients, optimizer states, engine buffers and
    activations of each side at its own max micro-batch, each bar labelled with that batch.
    False, with a line saying so, where matplotlib (the `plot` extra) is not installed."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        print(f"{path} not written: matplotlib is not installed (pip install 'coat_ds[plot]')", flush=True)
        return False

    matplotlib.use("Agg")  # files only: no display on training nodes
    import matplotlib.pyplot as plt

    names = ("baseline", "coat")
    fig, ax = plt.subplots(figsize=(CHART_SIZE_PX[0] / _DPI, CHART_SIZE_PX[1] / _DPI), dpi=_DPI)
    colors = ("#4C72B0", "#55A868", "#C44E52", "#AAAAAA", "#8172B2")
    bottoms = [0.0, 0.0]
    for (label, values), color in zip(chart_stacks(result), colors):
        ax.bar(names, values, bottom=bottoms, label=label, color=color, width=0.55)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    for i, n in enumerate(names):
        ax.text(i, bottoms[i], f"max micro-batch {result['sides'][n]['max_micro_batch']}",
                ha="center", va="bottom", fontsize=10, fontweight="bold")
    if result["budget_bytes"]:
        ax.axhline(result["budget_bytes"] / GB, color="black", linestyle="--", linewidth=1, label="budget")
    ax.set_ylim(0, max(max(bottoms), (result["budget_bytes"] or 0) / GB) * 1.15)
    ax.set_ylabel("GB per rank (rank 0)")
    ax.set_title(f"{result['model']['name']}, seq {result['seq_len']}, engine {result['engine']}, "
                 f"{result['world_size']} rank(s)")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    try:
        with atomic_write(path, "wb") as f:
            fig.savefig(f, format="png", dpi=_DPI)
    finally:
        plt.close(fig)
    return True
