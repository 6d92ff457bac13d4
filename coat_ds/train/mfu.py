"""Model FLOPs utilisation for train.py's log: the model's FLOPs per second over the GPU's
dense BF16 peak.

Model FLOPs per token, as PaLM counts them (Chowdhery et al. 2022, appendix B):
6 x N for the matrix multiplies of forward and backward, N the parameters but the input
embedding (a lookup, no multiply; the output head's GEMM counts), plus 12 x n_layers x dim x
seq_len for attention's score and value products (the full square, not halved for the
causal mask). Work a run repeats (recomputed layers) is not model FLOPs and is not counted.
"""
from __future__ import annotations

import re

import torch

from ..models.llama import ModelConfig

__all__ = ["PEAK_BF16_FLOPS", "flops_per_token", "peak_of", "peak_flops", "mfu", "mfu_note"]

# Dense BF16 tensor-core peak by device name (torch.cuda.get_device_name), first match: the
# SXM parts; PCIe and NVL parts, of lower peaks, match none.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    (r"H100 (80GB HBM3|SXM)", 989e12),
    (r"H200(?! NVL)", 989e12),
    (r"A100", 312e12),
)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Model FLOPs of one training token (forward and backward) at sequences of `seq_len`."""
    n = cfg.num_params() - cfg.vocab_size * cfg.dim  # the input embedding does no multiply
    return 6 * n + 12 * cfg.n_layers * cfg.dim * seq_len


def peak_of(name: str) -> float | None:
    """The dense BF16 peak FLOP/s of the GPU named `name`, None where not in the table."""
    return next((peak for pattern, peak in PEAK_BF16_FLOPS if re.search(pattern, name)), None)


def peak_flops(device: torch.device) -> tuple[float | None, str]:
    """(dense BF16 peak FLOP/s of `device`, its name), the peak None for a CPU or a GPU not in
    the table."""
    if device.type != "cuda":
        return None, device.type
    name = torch.cuda.get_device_name(device)
    return peak_of(name), name


def mfu(tokens_per_s_per_gpu: float, cfg: ModelConfig, seq_len: int, peak: float) -> float:
    """Share of `peak` (FLOP/s) that `tokens_per_s_per_gpu` of model work is."""
    return tokens_per_s_per_gpu * flops_per_token(cfg, seq_len) / peak


def mfu_note(mcfg: ModelConfig, seq_len: int, device: torch.device) -> tuple[float | None, str]:
    """(the dense BF16 peak MFU is measured against or None, the log line saying how)."""
    peak, name = peak_flops(device)
    per_token = flops_per_token(mcfg, seq_len)
    if peak is None:
        return None, (f"MFU: not reported: no dense BF16 peak known for {name} (the table: coat_ds/train/mfu.py); "
                      f"model FLOPs per token {per_token / 1e9:.4g} G")
    return peak, (f"MFU: model FLOPs per token 6 x params (input embedding left out) + 12 x layers x dim x seq_len = "
                  f"{per_token / 1e9:.4g} G, over {name}'s dense BF16 peak of {peak / 1e12:.0f} TFLOP/s per GPU")
