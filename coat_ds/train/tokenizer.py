"""train.py's tokenizers: raw bytes (the default, 256 ids), or a byte-level BPE trained here
with Hugging Face `tokenizers` (shipped with transformers), saved as its `tokenizer.json`.

The BPE is GPT-2's kind: text is split by GPT-2's pattern over its bytes (mapped to printable
characters), so every string round-trips exactly and no id means "unknown". Files are read as
UTF-8, undecodable bytes replaced by U+FFFD; each file's tokens end with `<|endoftext|>`, so a
window that spans two files sees where one ends.
"""
from __future__ import annotations

import os
from array import array
from typing import Iterable

__all__ = ["BYTE_VOCAB", "END_OF_TEXT", "train_bpe", "load_bpe", "encode_texts", "id_typecode"]

BYTE_VOCAB = 256
END_OF_TEXT = "<|endoftext|>"


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise RuntimeError("tokenizer 'bpe' needs Hugging Face `tokenizers` (pip install tokenizers; transformers "
                           "installs it); tokenizer 'byte' needs nothing") from None
    return tokenizers


def train_bpe(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE of at most `vocab_size` ids (`<|endoftext|>` and the 256 byte symbols
    included) learnt from `texts`; a small sample may stop short of `vocab_size`."""
    tk = _tokenizers()
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT], show_progress=False,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load_bpe(path: str | os.PathLike):
    return _tokenizers().Tokenizer.from_file(os.fspath(path))


def id_typecode(vocab_size: int) -> str:
    """The `array` type code of the narrowest unsigned integer holding every id (native byte
    order, as torch.from_file reads it back)."""
    for code in ("B", "H", "I"):
        if vocab_size <= 1 << (8 * array(code).itemsize):
            return code
    raise ValueError(f"vocabulary of {vocab_size} ids does not fit 32 bits")


def encode_texts(tok, texts: list[bytes], typecode: str) -> array:
    """The ids of `texts` (file contents), one after another: with `tok` None their bytes (of
    typecode "B"), else `tok`'s ids, each file closed by `<|endoftext|>`."""
    out = array(typecode)
    if tok is None:  # bytes: typecode "B"
        for t in texts:
            out.frombytes(t)
        return out
    eot = tok.token_to_id(END_OF_TEXT)
    # encode_batch_fast spreads the files over the cores (no offsets computed).
    for enc in tok.encode_batch_fast([t.decode("utf-8", errors="replace") for t in texts], add_special_tokens=False):
        out.extend(enc.ids)
        out.append(eot)
    return out
