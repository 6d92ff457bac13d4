"""Deterministic kernels for runs that must repeat bit for bit on a GPU (train.py
`deterministic`, the accuracy benches' `--deterministic`)."""
from __future__ import annotations

import os

import torch

__all__ = ["deterministic_kernels"]


def deterministic_kernels() -> None:
    """Kernels whose sums do not depend on timing (no atomic float adds: SDPA's and the
    embedding's backward), cuBLAS with a fixed workspace, Inductor without autotuning: two
    runs of one seed then end bit for bit alike. Call it before the first CUDA call: cuBLAS
    reads its setting when it starts."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    # NaN-filling every torch.empty costs time and checks nothing a training run needs.
    torch.utils.deterministic.fill_uninitialized_memory = False
