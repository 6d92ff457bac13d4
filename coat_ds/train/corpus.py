"""A corpus of files (a directory, or a glob such as `/venv/lib/python3.12/site-packages/**/*.py`),
split into train and validation by file and tokenised once into a cache.

Files are taken in sorted order of their path. A directory means every file under it, hidden
entries and `__pycache__` left out; files holding a NUL byte are skipped as binary when read.
Validation gets about `val_file_fraction` of the files (at least one, never all): those whose
path hashes below that share of the hash range, so the split does not depend on the order of a
walk, and adding files moves none of the others from one split to the other.

The cache folder (one per source and tokenizer, under `cache_dir`) holds `train.bin` and
`val.bin` (raw ids, the narrowest unsigned type that holds the vocabulary: uint8 for bytes,
uint16 up to 65,536 ids), `meta.json` (source, a hash of the file list with sizes and
modification times, tokenizer, counts per split) and, for BPE, `tokenizer.json` with its
`tokenizer_meta.json`. A run reuses it when `meta.json` matches the corpus and settings, and
rebuilds it otherwise (saying why); an exclusive lock makes concurrent ranks wait for the one
building it. The .bin files are memory-mapped, not read: the ranks of a machine share the page
cache, and a batch reads only its windows.
"""
from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import os
import time
import zlib
from typing import Callable, Iterator

import torch

from ..io.atomic import atomic_write
from .tokenizer import BYTE_VOCAB, encode_texts, id_typecode, load_bpe, train_bpe

__all__ = ["is_corpus", "list_corpus", "split_files", "files_fingerprint", "default_cache_dir", "corpus_folder",
           "prepare_corpus", "open_corpus", "corpus_description", "FORMAT"]

FORMAT = "coat_ds.corpus/1"
_MAGIC = "*?["
_BATCH_BYTES = 8 << 20  # text handed to the tokenizer at once (its threads share it out by file)
_TORCH_DTYPE = {"B": torch.uint8, "H": torch.uint16, "I": torch.uint32}


def is_corpus(source: str) -> bool:
    """A directory or a glob pattern (not "stdlib", a text file or a .bin)."""
    return source != "stdlib" and (os.path.isdir(source) or any(c in source for c in _MAGIC))


def list_corpus(source: str) -> tuple[str, list[str]]:
    """(root, sorted paths relative to it) of the corpus `source`."""
    if os.path.isdir(source):
        root, rels = os.path.abspath(source), []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
            rels += [os.path.relpath(os.path.join(dirpath, f), root) for f in filenames if not f.startswith(".")]
    else:
        parts = os.path.abspath(source).split(os.sep)
        fixed = next(i for i, p in enumerate(parts) if any(c in p for c in _MAGIC))
        root = os.sep.join(parts[:fixed]) or os.sep
        rels = [os.path.relpath(p, root) for p in glob.glob(os.path.abspath(source), recursive=True)
                if os.path.isfile(p)]
    if len(rels) < 2:
        raise FileNotFoundError(f"data {source}: {len(rels)} file(s) found; a corpus needs at least 2 (one for "
                                "validation)")
    return root, sorted(rels)


def split_files(rels: list[str], val_fraction: float) -> tuple[list[str], list[str]]:
    """(train, val), each in the order of `rels`: the files whose path hashes below
    `val_fraction` of the hash range (about that share of them), at least one and never all."""
    hashes = {r: zlib.crc32(r.encode()) for r in rels}
    val = {r for r in rels if hashes[r] < val_fraction * 2**32}
    ranked = sorted(rels, key=lambda r: (hashes[r], r))
    if not val:
        val = {ranked[0]}
    val.discard(ranked[-1])  # held out only if all were: train keeps one
    return [r for r in rels if r not in val], [r for r in rels if r in val]


def files_fingerprint(root: str, rels: list[str]) -> str:
    """A hash of the file list with each file's size and modification time: a file added,
    removed or rewritten changes it."""
    h = hashlib.sha256()
    for rel in rels:
        st = os.stat(os.path.join(root, rel))
        h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def default_cache_dir() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "coat_ds", "corpus")


def _tokenizer_name(cfg) -> str:
    return "byte" if cfg.tokenizer == "byte" else f"bpe{cfg.bpe_vocab_size}"


def corpus_folder(cfg) -> str:
    """The cache folder of `cfg`'s source and tokenizer."""
    key = hashlib.sha256(f"{os.path.abspath(cfg.source)}\0{_tokenizer_name(cfg)}".encode()).hexdigest()[:12]
    stem = os.path.basename(os.path.abspath(cfg.source).split("*")[0].rstrip(os.sep)) or "corpus"
    return os.path.join(cfg.cache_dir or default_cache_dir(), f"{stem}-{_tokenizer_name(cfg)}-{key}")


def _read_text(path: str) -> bytes | None:
    """The file's bytes, or None for a binary file (one holding a NUL byte)."""
    with open(path, "rb") as f:
        data = f.read()
    return None if b"\0" in data else data


def _sha256_file(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def _locked(folder: str, log: Callable[[str], None]) -> Iterator[None]:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "lock"), "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"corpus: waiting for another process preparing {folder}")
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _tokenizer(cfg, folder: str, root: str, train: list[str], train_hash: str, log: Callable[[str], None]):
    """None for bytes; for BPE the tokenizer of `folder` when it was trained on this train
    split with these settings, else one trained now on a sample of the train split."""
    if cfg.tokenizer == "byte":
        return None
    path, meta_path = os.path.join(folder, "tokenizer.json"), os.path.join(folder, "tokenizer_meta.json")
    want = {"train_files": train_hash, "vocab_size": cfg.bpe_vocab_size, "sample_bytes": cfg.bpe_sample_bytes}
    meta = _read_json(meta_path)
    if meta and os.path.isfile(path) and meta.get("sha256") == _sha256_file(path) and \
            all(meta.get(k) == v for k, v in want.items()):
        return load_bpe(path)
    # The sample: train files in an order of their own (a salted hash), until it holds enough.
    order = sorted(train, key=lambda r: (zlib.crc32(b"bpe-sample\0" + r.encode()), r))
    texts, size = [], 0
    for rel in order:
        if size >= cfg.bpe_sample_bytes:
            break
        data = _read_text(os.path.join(root, rel))
        if data is not None:
            texts.append(data[:cfg.bpe_sample_bytes - size].decode("utf-8", errors="replace"))
            size += len(texts[-1])
    log(f"corpus: training a byte-level BPE of {cfg.bpe_vocab_size:,} ids on {len(texts):,} train files "
        f"({size / 1e6:.1f} MB of the train split)")
    t0 = time.perf_counter()
    tok = train_bpe(texts, cfg.bpe_vocab_size)
    with atomic_write(path) as f:
        f.write(tok.to_str())
    with atomic_write(meta_path) as f:
        json.dump({**want, "sha256": _sha256_file(path), "vocab": tok.get_vocab_size()}, f, indent=1)
    log(f"corpus: BPE trained in {time.perf_counter() - t0:.0f} s: {tok.get_vocab_size():,} ids, saved as {path}")
    return tok


def _tokenize_split(root: str, rels: list[str], tok, typecode: str, out: str, progress) -> dict:
    """Write the ids of `rels` to `out`; returns the split's counts."""
    counts = {"files": 0, "binary_skipped": 0, "bytes": 0, "tokens": 0}
    batch, batch_bytes = [], 0
    with atomic_write(out, "wb") as f:
        def flush():
            ids = encode_texts(tok, batch, typecode)
            ids.tofile(f)
            counts["tokens"] += len(ids)
            progress(len(batch), sum(map(len, batch)), len(ids))
            batch.clear()

        for rel in rels:
            data = _read_text(os.path.join(root, rel))
            if data is None:
                counts["binary_skipped"] += 1
                progress(1, 0, 0)
                continue
            counts["files"] += 1
            counts["bytes"] += len(data)
            batch.append(data)
            batch_bytes += len(data)
            if batch_bytes >= _BATCH_BYTES:
                flush()
                batch_bytes = 0
        if batch:
            flush()
    return counts


class _Progress:
    """A log line at most every `every_s` seconds while a corpus is tokenised."""

    def __init__(self, n_files: int, total_bytes: int, log: Callable[[str], None], every_s: float = 10.0):
        self.n_files, self.total, self.log, self.every_s = n_files, total_bytes, log, every_s
        self.files = self.bytes = self.tokens = 0
        self.t0 = self.last = time.perf_counter()

    def __call__(self, files: int, nbytes: int, tokens: int) -> None:
        self.files, self.bytes, self.tokens = self.files + files, self.bytes + nbytes, self.tokens + tokens
        now = time.perf_counter()
        if now - self.last >= self.every_s:
            self.last = now
            self.log(f"corpus: tokenised {self.files:,}/{self.n_files:,} files, {self.bytes / 1e6:,.0f}/"
                     f"{self.total / 1e6:,.0f} MB, {self.tokens:,} tokens ({self.bytes / 1e6 / (now - self.t0):.1f} "
                     "MB/s)")


def prepare_corpus(cfg, log: Callable[[str], None] = print) -> tuple[str, dict]:
    """The cache folder of `cfg` (a DataConfig whose source is a corpus) and its meta,
    built unless a matching one exists. `log` gets the progress of a build."""
    root, rels = list_corpus(cfg.source)
    train, val = split_files(rels, cfg.val_file_fraction)
    fingerprint = files_fingerprint(root, rels)
    folder = corpus_folder(cfg)
    want = {"format": FORMAT, "source": cfg.source, "root": root, "files_hash": fingerprint,
            "val_file_fraction": cfg.val_file_fraction, "tokenizer": _tokenizer_name(cfg)}
    if cfg.tokenizer == "bpe":
        want["bpe_sample_bytes"] = cfg.bpe_sample_bytes
    with _locked(folder, log):
        meta_path = os.path.join(folder, "meta.json")
        meta = _read_json(meta_path)
        why = _stale(meta, want, folder)
        if why is None:
            return folder, {**meta, "reused": True}
        log(f"corpus: building {folder} ({why}): {len(rels):,} files under {root}")
        with contextlib.suppress(FileNotFoundError):
            os.remove(meta_path)  # the .bin files are about to change: no meta may vouch for them meanwhile
        t0 = time.perf_counter()
        tok = _tokenizer(cfg, folder, root, train, files_fingerprint(root, train), log)
        vocab = BYTE_VOCAB if tok is None else tok.get_vocab_size()
        typecode = id_typecode(vocab)
        total = sum(os.path.getsize(os.path.join(root, r)) for r in rels)
        progress = _Progress(len(rels), total, log)
        splits = {name: _tokenize_split(root, files, tok, typecode, os.path.join(folder, f"{name}.bin"), progress)
                  for name, files in (("train", train), ("val", val))}
        if tok is not None:
            # Tokenizers warns in every process forked after it ran threads (compile workers,
            # op builds); the build is over, so no later encode needs them.
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        empty = [name for name, c in splits.items() if not c["tokens"]]
        if empty:
            raise ValueError(f"data {cfg.source}: the {' and '.join(empty)} split holds no text file "
                             f"(binary files are skipped)")
        meta = {**want, "vocab_size": vocab, "dtype": str(_TORCH_DTYPE[typecode]).removeprefix("torch."),
                "splits": splits, "val_files": val, "built_s": round(time.perf_counter() - t0, 1)}
        if tok is not None:
            meta["tokenizer_sha256"] = _sha256_file(os.path.join(folder, "tokenizer.json"))
        with atomic_write(meta_path) as f:
            json.dump(meta, f, indent=1)
        log(f"corpus: built {folder} in {meta['built_s']:.0f} s")
        return folder, {**meta, "reused": False}


def _stale(meta: dict | None, want: dict, folder: str) -> str | None:
    """Why the cache with `meta` does not serve `want`, or None."""
    if meta is None:
        return "no complete cache there"
    for key, value in want.items():
        if meta.get(key) != value:
            return "the files changed" if key == "files_hash" else f"{key} was {meta.get(key)!r}, now {value!r}"
    if "tokenizer_sha256" in meta:
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path) or _sha256_file(path) != meta["tokenizer_sha256"]:
            return "tokenizer.json changed"
    item = torch.empty((), dtype=getattr(torch, meta["dtype"])).element_size()
    for name, counts in meta["splits"].items():
        path = os.path.join(folder, f"{name}.bin")
        if not os.path.isfile(path) or os.path.getsize(path) != counts["tokens"] * item:
            return f"{name}.bin is missing or not {counts['tokens']:,} tokens long"
    return None


def open_corpus(folder: str, meta: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val) ids of a prepared corpus, memory-mapped in their stored dtype."""
    dtype = getattr(torch, meta["dtype"])
    return tuple(torch.from_file(os.path.join(folder, f"{name}.bin"), shared=False,
                                 size=meta["splits"][name]["tokens"], dtype=dtype) for name in ("train", "val"))


def corpus_description(meta: dict, folder: str) -> str:
    """The corpus's size and split, for train.py's log."""
    s = meta["splits"]
    files = sum(c["files"] for c in s.values())
    skipped = sum(c["binary_skipped"] for c in s.values())
    nbytes = sum(c["bytes"] for c in s.values())
    tokens = sum(c["tokens"] for c in s.values())
    return (f"corpus {meta['source']}: {files:,} files{f' ({skipped:,} binary skipped)' if skipped else ''}, "
            f"{nbytes:,} bytes, {tokens:,} tokens ({meta['tokenizer']}, vocabulary {meta['vocab_size']:,}, "
            f"{meta['dtype']}); train {s['train']['files']:,} files / {s['train']['tokens']:,} tokens, val "
            f"{s['val']['files']:,} files / {s['val']['tokens']:,} tokens (val_file_fraction "
            f"{meta['val_file_fraction']:g}); cache {folder} ({'reused' if meta['reused'] else 'built now'})")
