"""Accuracy evidence, CPU-sized: loss parity with torch AdamW and the Table 1 ranking.

The full-size runs and their numbers live in docs/accuracy.md; these are the versions that
fit in CI (about a minute on 2 CPU cores)."""
import importlib.util
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from coat_ds.train.data import DataConfig, load_data

_BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench")


def _bench(name: str):
    if _BENCH not in sys.path:  # the bench scripts import their shared module, bench/_common.py
        sys.path.insert(0, _BENCH)
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(_BENCH, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def data():
    return load_data(DataConfig(max_bytes=2_000_000))


@pytest.mark.slow
def test_coat_adamw_loss_matches_torch_adamw(data):
    """Tiny preset, 200 steps, same seed and batches: CoatAdamW's validation loss and mean
    train loss over the second half within 1% of torch AdamW's.

    Why 1% is a fair bound here: it is the project's goal (the paper's gap is 0.4%); at this
    setting (peak LR 1e-3) we measured paired gaps of at most 0.1% over seeds 1337, 1 and 2,
    while AdamW's own seed-to-seed spread was ~5% (docs/accuracy.md). At LR 3e-3 the tiny
    model's runs are chaotic (paired gaps of -1% to +3% between any two perturbed runs), so a
    1% bound there would test luck, not the optimizer."""
    lp = _bench("parity")
    args = SimpleNamespace(preset="tiny", steps=200, batch_size=8, seq_len=64, lr=1e-3, warmup=20,
                           weight_decay=0.1, seed=1337, eval_batches=16, fp32=True, log_interval=0, compile=False)
    dev = torch.device("cpu")
    base = lp.run_variant("adamw", args, data, dev)
    coat = lp.run_variant("coat", args, data, dev)
    assert base["curve"][-1] < base["curve"][0] - 2.0, "the baseline must actually train"
    assert abs(coat["val_loss"] / base["val_loss"] - 1) <= 0.01, (coat["val_loss"], base["val_loss"])
    half = lambda r: sum(r["curve"][100:]) / len(r["curve"][100:])  # noqa: E731
    assert abs(half(coat) / half(base) - 1) <= 0.01, (half(coat), half(base))


@pytest.mark.slow
def test_quant_table_ranking_on_real_moments(data):
    """On moments of a briefly trained tiny model: E4M3+DRE for both moments beats every
    combination without DRE, is within 10% of the best cell, and DRE cuts the E4M3/E4M3
    error by at least the paper's ~1.6x."""
    qt = _bench("quant_table")
    moments, first, last = qt.train_moments("tiny", 40, 8, 64, 0, 1e-3, data)
    assert last < first
    table = qt.quant_table(moments)
    both = table[("E4M3+DRE", "E4M3+DRE")]
    plain = {k: e for k, e in table.items() if "DRE" not in k[0] and "DRE" not in k[1]}
    assert all(both < e for e in plain.values()), table
    assert both <= 1.1 * min(table.values()), table
    assert table[("E4M3", "E4M3")] / both >= 1.6, table


def test_reference_kernel_model_collapses_k_on_zero_groups():
    """The model of the reference kernel's min (zeros included) picks a much smaller k for a
    group with one exact zero, and its error on the nonzeros grows; ours is unaffected."""
    qt = _bench("quant_table")
    torch.manual_seed(0)
    x = torch.exp(torch.empty(2, 128).uniform_(-7, -4)) * torch.randn(2, 128).sign()
    x[1, 5] = 0.0
    ref, k = qt.reference_kernel_roundtrip(x.flatten())
    ours = qt.roundtrip(x.flatten(), "e4m3", True)
    assert k[1] < 0.5 * k[0]
    flat = x.flatten()
    sel = (flat != 0) & (torch.arange(256) >= 128)  # the nonzeros of the group with the zero
    err = lambda d: ((d - flat).abs()[sel] / flat.abs()[sel]).median()  # noqa: E731
    assert err(ref) > 3 * err(ours)
    assert ours[128 + 5] == 0 and ref[128 + 5] == 0
