"""train.py's pieces in-process: config precedence, LR schedule, data split and batches, model."""
from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import train  # noqa: E402
from coat_ds.train.data import DataConfig, batch_seed, load_data  # noqa: E402
from coat_ds.models import llama  # noqa: E402
from coat_ds.models.llama import PRESETS, Llama, model_config  # noqa: E402


def test_flags_override_yaml_override_defaults(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("preset: tiny\nmax_steps: 7\nseq_len: 32\n")
    cfg = train.parse_config(["--config", str(y), "--max-steps", "9", "--local_rank=1"])
    assert (cfg.preset, cfg.max_steps, cfg.seq_len) == ("tiny", 9, 32)
    assert cfg.warmup_steps == train.TrainConfig().warmup_steps
    y.write_text("max_stepz: 3\n")
    with pytest.raises(SystemExit, match="max_stepz"):
        train.parse_config(["--config", str(y)])
    with pytest.raises(SystemExit, match="preset"):
        train.parse_config(["--preset", "huge"])


def test_lr_schedule_warms_up_then_decays_to_floor():
    cfg = train.TrainConfig(max_steps=100, warmup_steps=10, min_lr_ratio=0.1)
    f = [train.lr_factor(cfg, s) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[10:], f[11:]))
    assert f[-1] == pytest.approx(0.1, abs=1e-3)


def test_stdlib_data_split_is_deterministic_and_disjoint():
    a = load_data(DataConfig(max_bytes=400_000))
    b = load_data(DataConfig(max_bytes=400_000))
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert a.vocab_size == 256 and a.train.numel() > 10 * 64 and a.val.numel() > 64
    x1, y1 = a.batch("train", 3, 16, batch_seed(0, 5, 1, 0))
    x2, y2 = a.batch("train", 3, 16, batch_seed(0, 5, 1, 0))
    x3, _ = a.batch("train", 3, 16, batch_seed(0, 5, 0, 0))
    assert torch.equal(x1, x2) and not torch.equal(x1, x3)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are the inputs shifted by one


def test_user_text_and_bin_sources(tmp_path):
    import numpy as np

    txt = tmp_path / "t.txt"
    txt.write_bytes(b"hello world " * 200)
    d = load_data(DataConfig(source=str(txt), val_fraction=0.1))
    assert d.train.numel() + d.val.numel() == 2400 and d.val.numel() == 240
    binf = tmp_path / "t.bin"
    np.arange(3000, dtype=np.uint16).tofile(binf)
    d = load_data(DataConfig(source=str(binf)))
    assert d.vocab_size == 3000 and int(d.val[-1]) == 2999
    np.arange(70_000, 73_000, dtype=np.int32).tofile(binf)
    d = load_data(DataConfig(source=str(binf), bin_dtype="int32"))
    assert d.vocab_size == 73_000 and int(d.train[0]) == 70_000 and d.train.dtype == torch.int64
    binf.write_bytes(b"\0" * 7)  # not a whole number of uint16 tokens
    with pytest.raises(ValueError, match=f"{binf}: 7 bytes, .*uint16.*is bin_dtype right"):
        load_data(DataConfig(source=str(binf)))


def test_resume_names_the_settings_unlike_the_checkpoints():
    saved = dataclasses.asdict(train.TrainConfig(fp8_linear=True, compress_activations=True))
    assert train.resume_note(train.TrainConfig(fp8_linear=True, compress_activations=True, max_steps=5), saved) is None
    note = train.resume_note(train.TrainConfig(fused_head_loss=True, compress_activations=True), saved)
    assert note == ("settings unlike the checkpoint's: fp8_linear off (the checkpoint's run: on), fused_head_loss on "
                    "(the checkpoint's run: off); training goes on with this run's")
    del saved["fused_head_loss"]  # a checkpoint from before the setting: only what it holds is compared
    assert "fused_head_loss" not in train.resume_note(train.TrainConfig(fused_head_loss=True), saved)
    assert train.resume_note(train.TrainConfig(fp8_linear=True), None) is None  # saved without settings


def test_model_presets_and_forward():
    for name in PRESETS:
        cfg = model_config(name)
        assert cfg.dim % cfg.n_heads == 0
    assert 0.9e9 < model_config("1b").num_params() < 1.2e9
    assert 6e9 < model_config("7b").num_params() < 7e9
    # Llama-2's published sizes at its 32000-token vocabulary (70B: 8 key/value heads).
    sizes = {"7b": 6_738_415_616, "13b": 13_015_864_320, "70b": 68_976_648_192}
    assert {n: model_config(n, vocab_size=32000).num_params() for n in sizes} == sizes
    torch.manual_seed(0)
    m = Llama(model_config("tiny", max_seq_len=16))
    assert sum(p.numel() for p in m.parameters()) == m.cfg.num_params()
    idx = torch.randint(0, 256, (2, 16))
    logits = m(idx)
    assert logits.shape == (2, 16, 256)
    # Causal: changing the last token leaves every earlier position's logits unchanged.
    idx2 = idx.clone()
    idx2[:, -1] = (idx2[:, -1] + 1) % 256
    assert torch.allclose(m(idx2)[:, :-1], logits[:, :-1])
    loss = m(idx[:, :-1], idx[:, 1:])
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5


def test_grouped_query_attention_matches_repeated_key_value_heads():
    """n_kv_heads < n_heads: each key/value head serves n_heads / n_kv_heads consecutive query
    heads; the same as plain attention over key/value heads repeated that many times."""
    torch.manual_seed(0)
    cfg = model_config("tiny", n_heads=8, n_kv_heads=2, max_seq_len=16)
    m = Llama(cfg)
    assert sum(p.numel() for p in m.parameters()) == cfg.num_params()
    attn = m.blocks[0].attn
    assert attn.wqkv.weight.shape == (cfg.dim + 2 * 2 * cfg.head_dim, cfg.dim)
    x = torch.randn(2, 16, cfg.dim)
    cos, sin = llama._rotary(16, cfg.head_dim, cfg.rope_theta, x.device)
    q, k, v = attn.wqkv(x).split((cfg.dim, cfg.kv_dim, cfg.kv_dim), dim=-1)
    q, k, v = (t.view(2, 16, -1, cfg.head_dim).transpose(1, 2) for t in (q, k, v))
    q, k = llama._apply_rotary(q, cos, sin), llama._apply_rotary(k, cos, sin)
    k, v = k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1)
    scores = (q @ k.transpose(-1, -2)) / cfg.head_dim ** 0.5
    scores = scores.masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf"))
    want = attn.wo((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 16, cfg.dim))
    torch.testing.assert_close(attn(x, cos, sin), want, rtol=1e-5, atol=1e-6)
    loss = m(torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16)))
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())
    with pytest.raises(ValueError, match="n_kv_heads=3 must divide n_heads=8"):
        model_config("tiny", n_heads=8, n_kv_heads=3)


def test_gpu_memory_gb_is_checked():
    assert train.parse_config(["--gpu-memory-gb", "80"]).gpu_memory_gb == 80.0
    with pytest.raises(SystemExit, match="gpu_memory_gb: got -1.0"):
        train.parse_config(["--gpu-memory-gb", "-1"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_memory_cap_fails_allocations_past_it():
    """--gpu-memory-gb: what fits a smaller GPU, checked on this one."""
    try:
        train.cap_gpu_memory(2.0)
        kept = torch.empty(int(1e9), dtype=torch.uint8, device="cuda")
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(int(1.5e9), dtype=torch.uint8, device="cuda")
        del kept
        with pytest.raises(SystemExit, match="at most this GPU's"):
            train.cap_gpu_memory(1e6)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
