"""What the scripts that train a model share (parity.py, grad_error.py; optim_step.py --loop
takes the LR schedule): byte-pair tokens for a realistic LM head, the LR schedule and
--act-config's ActivationConfig fields."""
from __future__ import annotations

import dataclasses
import math

import _common as C  # noqa: F401  (puts the measured tree's coat_ds on the path)
import torch

from coat_ds import ActivationConfig  # noqa: E402
from coat_ds.train.data import TokenData  # noqa: E402


def pair_tokens(data: TokenData, vocab: int) -> TokenData:
    """`data` (bytes) in a vocabulary of `vocab` tokens, for a realistically sized LM head
    without a downloaded tokenizer: each byte pair at an even offset is one token (256 + its
    rank) if it is among the vocab - 256 pairs most frequent at even offsets of the train
    split, else its two bytes. Deterministic, a pure function of the data."""
    if not 256 < vocab <= 256 + 65536:
        raise SystemExit(f"--pair-vocab must be in (256, {256 + 65536}], got {vocab}")
    train = data.train.long()
    pairs = train[:train.numel() // 2 * 2].view(-1, 2)
    freq = torch.bincount(pairs[:, 0] * 256 + pairs[:, 1], minlength=65536)
    rank = torch.full((65536,), -1, dtype=torch.long)
    rank[torch.sort(freq, descending=True, stable=True).indices[:vocab - 256]] = torch.arange(vocab - 256)

    def encode(t: torch.Tensor) -> torch.Tensor:
        t = t.long()
        p = t[:t.numel() // 2 * 2].view(-1, 2)
        r = rank[p[:, 0] * 256 + p[:, 1]]
        one = r >= 0
        width = torch.where(one, 1, 2)
        at = torch.cumsum(width, 0) - width
        out = torch.empty(int(width.sum()), dtype=torch.long)
        out[at[one]] = 256 + r[one]
        out[at[~one]], out[at[~one] + 1] = p[~one, 0], p[~one, 1]
        return out

    tr, va = encode(data.train), encode(data.val)
    return TokenData(tr, va, vocab, f"{data.description}, as {vocab} byte-pair tokens ({tr.numel():,} train / "
                     f"{va.numel():,} val)")


def lr_at(step: int, steps: int, warmup: int, peak: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def act_overrides(pairs: list[str]) -> dict:
    """--act-config KEY=VALUE pairs as ActivationConfig keywords ("true"/"false" as bools,
    digits as ints), checked by building the config once."""
    fields = {f.name for f in dataclasses.fields(ActivationConfig)}
    out = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or key not in fields:
            raise SystemExit(f"--act-config {pair!r}: expected KEY=VALUE with KEY one of {', '.join(sorted(fields))}")
        low = value.lower()
        out[key] = low == "true" if low in ("true", "false") else int(value) if value.lstrip("-").isdigit() else value
    try:
        ActivationConfig(**out)
    except (TypeError, ValueError) as e:
        raise SystemExit(f"--act-config: {e}") from None
    return out
