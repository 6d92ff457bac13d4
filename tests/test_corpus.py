"""train.py's corpus of files: the split by file, the tokenised cache (reused, rebuilt on a
change), the BPE tokenizer, and the config's checks. In-process, on a few small files."""
from __future__ import annotations

import json
import os
import random
import sys

import pytest
import torch

from coat_ds.train.corpus import corpus_folder, list_corpus, split_files
from coat_ds.train.data import DataConfig, load_data
from coat_ds.train.tokenizer import END_OF_TEXT, load_bpe, train_bpe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _corpus(folder, n=12, seed=0) -> dict[str, bytes]:
    """`n` Python-like text files in nested folders (and what a corpus must leave out:
    hidden entries, __pycache__, a binary file), returned as {relative path: bytes}."""
    rng = random.Random(seed)
    words = ["def", "return", "self", "import", "class", "value", "for", "in", "if", "else", "None", "ümlaut"]
    files = {}
    for i in range(n):
        rel = os.path.join(f"pkg{i % 3}", f"mod{i:02d}.py")
        lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 9))) for _ in range(rng.randint(20, 60))]
        files[rel] = ("\n".join(lines) + "\n").encode()
    for rel, data in {**files, ".git/HEAD": b"ref", "pkg0/.hidden.py": b"x = 1\n",
                      "pkg1/__pycache__/mod.cpython-311.pyc": b"\x00\x01", "pkg2/lib.so": b"ELF\x00\x00bin"}.items():
        os.makedirs(os.path.dirname(folder / rel), exist_ok=True)
        (folder / rel).write_bytes(data)
    return files


def _ids(path, dtype) -> list[int]:
    return torch.from_file(str(path), size=os.path.getsize(path) // dtype.itemsize, dtype=dtype).tolist()


def test_split_by_file_is_deterministic_disjoint_and_independent_of_other_files(tmp_path):
    files = _corpus(tmp_path / "src", n=40)
    root, rels = list_corpus(str(tmp_path / "src"))
    assert root == str(tmp_path / "src") and rels == sorted([*files, "pkg2/lib.so"])  # hidden, __pycache__ left out
    assert list_corpus(str(tmp_path / "src" / "**" / "*.py")) == (root, sorted(files))  # a glob, rooted before its *
    train, val = split_files(rels, 0.2)
    assert (train, val) == split_files(list(rels), 0.2) and set(split_files(rels[::-1], 0.2)[1]) == set(val)
    assert 3 <= len(val) <= 15 and not set(train) & set(val) and sorted(train + val) == rels and train == sorted(train)
    # Adding files moves none of the others between splits; a tiny share still holds one out,
    # and a share of nearly all leaves train one.
    train2, val2 = split_files(sorted(rels + [f"new/f{i}.py" for i in range(30)]), 0.2)
    assert set(val) <= set(val2) and set(train) <= set(train2)
    assert len(split_files(rels, 1e-9)[1]) == 1 and len(split_files(rels, 0.999999)[0]) == 1
    with pytest.raises(FileNotFoundError, match="1 file"):
        list_corpus(str(tmp_path / "src" / "pkg0" / "mod00*"))


def test_bin_reproduces_the_files_and_the_cache_is_reused_then_rebuilt_on_a_change(tmp_path):
    files = _corpus(tmp_path / "src")
    cfg = DataConfig(source=str(tmp_path / "src"), val_file_fraction=0.25, cache_dir=str(tmp_path / "cache"))
    log = []
    d = load_data(cfg, log=log.append)
    folder = corpus_folder(cfg)
    meta = json.loads(open(os.path.join(folder, "meta.json")).read())
    train, val = split_files(sorted([*files, "pkg2/lib.so"]), 0.25)
    assert meta["val_files"] == val and meta["splits"]["train"]["binary_skipped"] + \
        meta["splits"]["val"]["binary_skipped"] == 1  # lib.so, read and found binary
    # Bytes: each split is its text files' bytes, in sorted order, memory-mapped as uint8.
    for split, rels, got in (("train", train, d.train), ("val", val, d.val)):
        want = b"".join(files[r] for r in rels if r in files)
        assert got.dtype == torch.uint8 and bytes(got.tolist()) == want
        assert _ids(os.path.join(folder, f"{split}.bin"), torch.uint8) == list(want)
    assert d.vocab_size == 256 and "(built now)" in d.description and any("building" in line for line in log)
    assert f"train {len(train) - ('pkg2/lib.so' in train)} files" in d.description

    stamp = os.stat(os.path.join(folder, "train.bin")).st_mtime_ns
    again = load_data(cfg, log=log.append)
    assert "(reused)" in again.description and torch.equal(again.train, d.train)
    assert os.stat(os.path.join(folder, "train.bin")).st_mtime_ns == stamp

    # A file rewritten (size changes): rebuilt, and the new bytes are in it.
    changed = next(r for r in train if r in files)
    files[changed] = b"# rewritten\n" + files[changed]
    (tmp_path / "src" / changed).write_bytes(files[changed])
    log.clear()
    rebuilt = load_data(cfg, log=log.append)
    assert "(built now)" in rebuilt.description and "the files changed" in log[0]
    assert bytes(rebuilt.train.tolist()) == b"".join(files[r] for r in train if r in files)
    log.clear()
    load_data(DataConfig(**{**cfg.__dict__, "val_file_fraction": 0.5}), log=log.append)
    assert "val_file_fraction was 0.25, now 0.5" in log[0]


def test_bpe_trains_on_the_train_split_round_trips_and_is_reused(tmp_path):
    text = "def f(x):\n    return x + 1  # ümlaut, 字, \t tabs\n\n"
    tok = train_bpe([text * 50, "class A:\n    pass\n" * 30], vocab_size=300)
    assert 257 < tok.get_vocab_size() <= 300 and tok.token_to_id(END_OF_TEXT) is not None
    ids = tok.encode(text).ids
    assert len(ids) < len(text.encode()) and tok.decode(ids) == text  # merges learnt; exact round trip
    unseen = "never seen: λ → ∑\r\n"
    assert tok.decode(tok.encode(unseen).ids) == unseen  # the byte symbols cover any text

    files = _corpus(tmp_path / "src")
    cfg = DataConfig(source=str(tmp_path / "src" / "**" / "*.py"), tokenizer="bpe", bpe_vocab_size=400,
                     val_file_fraction=0.25, cache_dir=str(tmp_path / "cache"))
    log = []
    d = load_data(cfg, log=log.append)
    folder = corpus_folder(cfg)
    bpe = load_bpe(os.path.join(folder, "tokenizer.json"))
    assert d.vocab_size == bpe.get_vocab_size() <= 400 and d.train.dtype == torch.uint16
    train, val = split_files(sorted(files), 0.25)
    assert any(f"training a byte-level BPE of 400 ids on {len(train)} train files" in line for line in log)
    # The .bin decodes back to the files, one <|endoftext|> after each.
    eot = bpe.token_to_id(END_OF_TEXT)
    for split, rels in (("train", train), ("val", val)):
        ids = _ids(os.path.join(folder, f"{split}.bin"), torch.uint16)
        docs, start = [], 0
        for i, t in enumerate(ids):
            if t == eot:
                docs.append(bpe.decode(ids[start:i]))
                start = i + 1
        assert docs == [files[r].decode() for r in rels] and start == len(ids)

    log.clear()
    assert "(reused)" in load_data(cfg, log=log.append).description and not log
    # tokenizer.json edited: the cache no longer matches; a new BPE is trained and the ids rebuilt.
    with open(os.path.join(folder, "tokenizer.json"), "a") as f:
        f.write(" ")
    rebuilt = load_data(cfg, log=log.append)
    assert "tokenizer.json changed" in log[0] and "(built now)" in rebuilt.description
    assert torch.equal(rebuilt.train, d.train)  # the same files, the same BPE


def test_config_checks_the_corpus_and_fault_settings(tmp_path):
    sys.path.insert(0, ROOT)
    import train

    _corpus(tmp_path / "src")
    with pytest.raises(SystemExit, match="--tokenizer: tokenizer: got 'bpe'.*unless data is a directory or a glob"):
        train.parse_config(["--tokenizer", "bpe"])
    with pytest.raises(SystemExit, match="val_file_fraction"):
        train.parse_config(["--data", str(tmp_path / "src"), "--val-file-fraction", "1"])
    cfg = train.parse_config(["--data", str(tmp_path / "src"), "--tokenizer", "bpe", "--bpe-vocab-size", "300",
                              "--data-cache", str(tmp_path / "cache"), "--dist-timeout-s", "30"])
    assert cfg.dist_timeout_s == 30 and cfg.heartbeat_timeout_s == 60
    data_cfg = train.data_config(cfg)
    assert (data_cfg.tokenizer, data_cfg.bpe_vocab_size, data_cfg.cache_dir) == ("bpe", 300, str(tmp_path / "cache"))
    assert "a byte-level BPE of 300 ids" in data_cfg.describe()
    with pytest.raises(SystemExit, match="heartbeat_timeout_s"):
        train.parse_config(["--heartbeat-timeout-s", "-1"])
