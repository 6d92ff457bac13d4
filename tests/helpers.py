"""Shared test utilities (no fixtures: plain functions)."""
import json
import math
import socket

import torch


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    ref, approx = ref.double(), approx.double()
    noise = (ref - approx).pow(2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10(ref.pow(2).sum().item() / noise)


def moments_like(shape, seed: int, device="cpu"):
    """Non-zero first and second moments spanning the decades real AdamW moments span, with
    m**2 <= v as AdamW's own moments satisfy (so |m| / sqrt(v) <= 1)."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * 1.5) * 1e-3
    v = m**2 * torch.exp(torch.randn(shape, generator=g).abs() * 2) + 1e-30
    return m.to(device), v.to(device)


def free_port() -> int:
    """A free local TCP port: other suites may launch torchrun at the same time."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def read_metrics(path) -> dict[int, dict]:
    """train.py's --metrics-file (JSON lines) merged per step."""
    out: dict[int, dict] = {}
    for line in open(path):
        m = json.loads(line)
        out.setdefault(m["step"], {}).update(m)
    return out
