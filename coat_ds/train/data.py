"""Training text that needs no download, byte-level tokens, and stateless batch sampling.

The default corpus is the running interpreter's own standard library (its .py files), found
through `sysconfig`: real text on every machine with Python. Files go to train or validation
by a hash of their relative path, so the split never depends on walk order. A user's text file
(bytes, last `val_fraction` held out), a pre-tokenised `.bin` (a raw integer array, as
nanoGPT writes it), or a corpus of files (a directory or a glob: split by file, tokenised once
into a cache, see corpus.py) works too. A batch is a pure function of (seed, step, rank,
micro-step), so a resumed run sees exactly the batches an uninterrupted one would.
"""
from __future__ import annotations

import os
import sysconfig
import zlib
from dataclasses import dataclass
from typing import Callable

import torch

from .corpus import corpus_description, default_cache_dir, is_corpus, open_corpus, prepare_corpus

__all__ = ["DataConfig", "TokenData", "load_data", "stdlib_corpus", "batch_seed"]


@dataclass(frozen=True)
class DataConfig:
    """Where tokens come from."""

    source: str = "stdlib"  # "stdlib", a text file path, a pre-tokenised .bin path, or a directory / glob corpus
    bin_dtype: str = "uint16"  # element type of a .bin file
    val_fraction: float = 0.05  # share held out for evaluation (stdlib: share of files)
    max_bytes: int = 32_000_000  # cap on stdlib text read (keeps start-up quick)
    val_file_fraction: float = 0.01  # corpus: share of its files held out (at least one)
    tokenizer: str = "byte"  # corpus: "byte" or "bpe" (trained on its train split)
    bpe_vocab_size: int = 32_000  # corpus with tokenizer "bpe": ids, <|endoftext|> and the 256 bytes included
    bpe_sample_bytes: int = 50_000_000  # corpus with tokenizer "bpe": train-split text the BPE learns from
    cache_dir: str = ""  # corpus: where its tokenised cache goes ("": ~/.cache/coat_ds/corpus)

    def __post_init__(self):
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction!r}")
        if self.max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {self.max_bytes!r}")
        if not 0.0 < self.val_file_fraction < 1.0:
            raise ValueError(f"val_file_fraction must be in (0, 1), got {self.val_file_fraction!r}")
        if self.tokenizer not in ("byte", "bpe"):
            raise ValueError(f"tokenizer must be 'byte' or 'bpe', got {self.tokenizer!r}")
        if self.tokenizer == "bpe" and not is_corpus(self.source):
            raise ValueError(f"tokenizer 'bpe' needs a directory or glob corpus as source, got {self.source!r}")

    def describe(self) -> str:
        """What `load_data` will read, for the line printed before it does."""
        if self.source == "stdlib":
            return (f"Python's standard-library sources under {sysconfig.get_paths()['stdlib']}, up to "
                    f"{self.max_bytes:,} bytes, {self.val_fraction:g} of the files held out")
        if is_corpus(self.source):
            tok = "bytes" if self.tokenizer == "byte" else f"a byte-level BPE of {self.bpe_vocab_size:,} ids"
            return (f"corpus {self.source} (its files in sorted order, {self.val_file_fraction:g} of them held out, "
                    f"at least one; tokens: {tok}; cache under {self.cache_dir or default_cache_dir()})")
        kind = f"pre-tokenised {self.bin_dtype} tokens" if self.source.endswith(".bin") else "text, as bytes"
        return f"{self.source} ({kind}), the last {self.val_fraction:g} held out"


@dataclass(frozen=True)
class TokenData:
    train: torch.Tensor  # 1-D int64-castable token ids
    val: torch.Tensor
    vocab_size: int
    description: str

    def batch(self, split: str, batch_size: int, seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`batch_size` random windows of `seq_len + 1` tokens, chosen by `seed` alone."""
        data = self.train if split == "train" else self.val
        if data.numel() <= seq_len + 1:
            raise ValueError(f"{split} split has {data.numel()} tokens, fewer than seq_len + 1 = {seq_len + 1}")
        gen = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=gen)
        windows = torch.stack([data[s:s + seq_len + 1] for s in starts.tolist()]).long()
        return windows[:, :-1], windows[:, 1:]


def batch_seed(seed: int, step: int, rank: int, micro: int, split: str = "train") -> int:
    """One seed per (run seed, step, rank, micro-step, split); stable across Python versions."""
    return zlib.crc32(f"{seed}/{split}/{step}/{rank}/{micro}".encode())


def stdlib_corpus(max_bytes: int, val_fraction: float) -> tuple[bytes, bytes, int]:
    """(train bytes, val bytes, number of files) from this interpreter's stdlib sources."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        files += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    # Each split takes the files hashed to it until it holds its share of max_bytes.
    budget = {"train": (1 - val_fraction) * max_bytes, "val": val_fraction * max_bytes}
    texts, size, used = {"train": [], "val": []}, {"train": 0, "val": 0}, 0
    for path in files:
        rel = os.path.relpath(path, root)
        split = "val" if zlib.crc32(rel.encode()) % 10_000 < val_fraction * 10_000 else "train"
        if size[split] >= budget[split]:
            if all(size[k] >= budget[k] for k in size):
                break
            continue
        with open(path, "rb") as f:
            texts[split].append(f.read())
        size[split] += len(texts[split][-1])
        used += 1
    train, val = texts["train"], texts["val"]
    if not train or not val:
        raise RuntimeError(f"found too little Python source under {root} for a train/val split")
    return b"".join(train), b"".join(val), used


def _bytes_tensor(b: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.uint8)


def _read_bin(path: str, dtype_name: str) -> torch.Tensor:
    """The tokens of a raw `.bin` array of `dtype_name` (native byte order), as int64; read
    by torch, so that the FSDP path needs no numpy."""
    dtype = getattr(torch, dtype_name)
    size, item = os.path.getsize(path), dtype.itemsize
    if size == 0 or size % item:
        raise ValueError(f"{path}: {size} bytes, not a whole non-zero number of {dtype_name} tokens "
                         f"({item} bytes each); is bin_dtype right?")
    return torch.from_file(path, shared=False, size=size // item, dtype=dtype).to(torch.int64)


def load_data(cfg: DataConfig, log: Callable[[str], None] = print) -> TokenData:
    """The tokens of `cfg.source`; `log` gets the progress of a corpus cache being built."""
    if cfg.source == "stdlib":
        train, val, n = stdlib_corpus(cfg.max_bytes, cfg.val_fraction)
        return TokenData(_bytes_tensor(train), _bytes_tensor(val), 256,
                         f"stdlib sources ({n} files, {len(train):,} train / {len(val):,} val bytes)")
    if is_corpus(cfg.source):
        folder, meta = prepare_corpus(cfg, log)
        train, val = open_corpus(folder, meta)
        return TokenData(train, val, meta["vocab_size"], corpus_description(meta, folder))
    if not os.path.isfile(cfg.source):
        raise FileNotFoundError(f"data source not found: {cfg.source} (use 'stdlib', a text file, a .bin, a directory "
                                "or a glob)")
    if cfg.source.endswith(".bin"):
        tokens = _read_bin(cfg.source, cfg.bin_dtype)
        vocab = int(tokens.max()) + 1
    else:
        with open(cfg.source, "rb") as f:
            tokens = _bytes_tensor(f.read())
        vocab = 256
    cut = int(tokens.numel() * (1 - cfg.val_fraction))
    return TokenData(tokens[:cut], tokens[cut:], vocab,
                     f"{cfg.source} ({cut:,} train / {tokens.numel() - cut:,} val tokens)")
