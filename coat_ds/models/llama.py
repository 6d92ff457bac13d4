"""A Llama-style decoder (RMSNorm, rotary embeddings, SwiGLU, causal SDPA) with size presets.

Small enough to read in one sitting; the presets go from a CPU-sized toy to Llama-2-7B/13B
shapes (70B with grouped-query attention) so the same script serves tests, the ~1B GPU table
and scaling work.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["ModelConfig", "PRESETS", "model_config", "Llama"]


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the decoder."""

    vocab_size: int = 256  # byte-level tokens by default
    dim: int = 256  # hidden size
    n_layers: int = 4  # transformer blocks
    n_heads: int = 4  # attention heads (dim must divide evenly)
    n_kv_heads: int = 0  # key/value heads, grouped-query attention (must divide n_heads); 0 = n_heads
    ffn_dim: int = 0  # SwiGLU hidden size; 0 = Llama's rule: 8/3 * dim rounded up to a multiple of 64
    max_seq_len: int = 256  # longest sequence the rotary table is sized for
    norm_eps: float = 1e-5  # RMSNorm epsilon
    rope_theta: float = 10000.0  # rotary base

    def __post_init__(self):
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(f"dim={self.dim} must split into {self.n_heads} heads of even size")
        if self.n_kv_heads == 0:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if not isinstance(self.n_kv_heads, int) or self.n_kv_heads < 0 or self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads!r} must divide n_heads={self.n_heads}")
        if self.ffn_dim == 0:
            object.__setattr__(self, "ffn_dim", 64 * math.ceil(8 * self.dim / 3 / 64))

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        """Width of the keys (and of the values): n_kv_heads x head_dim."""
        return self.n_kv_heads * self.head_dim

    def num_params(self) -> int:
        attention = 2 * self.dim * self.dim + 2 * self.dim * self.kv_dim
        per_layer = attention + 3 * self.dim * self.ffn_dim + 2 * self.dim
        return self.n_layers * per_layer + 2 * self.vocab_size * self.dim + self.dim


# Parameter counts are for vocab_size=256 (byte tokens); the 7b/13b/70b shapes are Llama-2's, whose
# 32000-token vocabulary train.py takes from data tokenised with it (the largest token id + 1).
PRESETS: dict[str, dict] = {
    "tiny": dict(dim=64, n_layers=2, n_heads=4, max_seq_len=128),  # ~0.14M, CPU tests
    "small": dict(dim=256, n_layers=4, n_heads=4, max_seq_len=256),  # ~3.3M, CPU demo
    "25m": dict(dim=512, n_layers=8, n_heads=8, max_seq_len=512),  # ~25M
    "125m": dict(dim=768, n_layers=12, n_heads=12, max_seq_len=1024),  # ~85M
    "350m": dict(dim=1024, n_layers=24, n_heads=16, max_seq_len=1024),  # ~300M
    "1b": dict(dim=2048, n_layers=20, n_heads=16, ffn_dim=5632, max_seq_len=2048),  # ~1.03B
    "7b": dict(dim=4096, n_layers=32, n_heads=32, ffn_dim=11008, max_seq_len=4096),  # ~6.5B
    "13b": dict(dim=5120, n_layers=40, n_heads=40, ffn_dim=13824, max_seq_len=4096),  # ~12.7B
    "70b": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, max_seq_len=4096),  # ~68.5B
}


def model_config(preset: str, **overrides) -> ModelConfig:
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose from {', '.join(PRESETS)}")
    return ModelConfig(**{**PRESETS[preset], **overrides})


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in FP32 whatever the training dtype: bf16 squares lose too much.
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def _rotary(seq_len: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    # Built per call in FP32 rather than kept as a buffer: engines cast buffers to bf16.
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (batch, heads, seq, head_dim); rotate interleaved-free halves as in GPT-NeoX/Llama HF.
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        # One GEMM for queries, keys and values: [q | k | v] along the output features.
        self.wqkv = nn.Linear(cfg.dim, cfg.dim + 2 * cfg.kv_dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        if self.n_kv_heads == self.n_heads:
            q, k, v = self.wqkv(x).view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        else:
            heads = self.wqkv(x).view(b, t, self.n_heads + 2 * self.n_kv_heads, self.head_dim).transpose(1, 2)
            q, k, v = heads.split((self.n_heads, self.n_kv_heads, self.n_kv_heads), dim=1)
        q, k = _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)
        # Each key/value head serves n_heads / n_kv_heads query heads, without copies of it.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads)
        return self.wo(y.transpose(1, 2).reshape(b, t, d))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w_gate = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w_up = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w_down = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn = SwiGLU(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


class Llama(nn.Module):
    """Decoder-only LM; `forward(idx, targets)` returns the mean cross-entropy (FP32)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # Set by coat_ds.fuse_lm_head_loss: the loss from chunks of the head's logits, never all of them.
        self.fused_head_loss = False
        self.head_loss_chunk_tokens: int | None = None
        self.head_loss_fp8 = None  # an Fp8LinearConfig: the head's GEMMs in FP8
        self.apply(self._init)
        # GPT-2's scaled init of the residual projections keeps early activations bounded.
        for name, p in self.named_parameters():
            if name.endswith(("wo.weight", "w_down.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def init_std(self, name: str) -> float | None:
        """The distribution the constructor draws parameter `name` from: N(0, std^2) with the
        std returned, or None for the norm weights' ones. Names as `named_parameters` gives
        them, which FSDP2, ZeRO-3 and coat_ds.prepare keep; for initialising a model built
        on the meta device shard by shard (coat_ds.models.sharded_init)."""
        if name.endswith("norm.weight"):
            return None
        if name.endswith(("wo.weight", "w_down.weight")):
            return 0.02 / math.sqrt(2 * self.cfg.n_layers)
        if name.endswith(("embed.weight", "head.weight", "wqkv.weight", "w_gate.weight", "w_up.weight")):
            return 0.02
        raise ValueError(f"no initial distribution known for parameter {name!r} of a Llama")

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (batch, seq, vocab), or the loss when `targets` is given."""
        t = idx.shape[1]
        if t > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {t} tokens exceeds max_seq_len={self.cfg.max_seq_len}")
        cos, sin = _rotary(t, self.cfg.head_dim, self.cfg.rope_theta, idx.device)
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        x = self.norm(x)
        if targets is not None and self.fused_head_loss:
            # The head is fuse_lm_head_loss's LossHead: called with targets, it gives the loss.
            return self.head(x, targets, chunk_tokens=self.head_loss_chunk_tokens, fp8=self.head_loss_fp8)
        logits = self.head(x)
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
