"""register_deepspeed() and `coat_ds.deepspeed_initialize`, in-process (the 2-rank runs
through DeepSpeed, Trainer and Accelerate are in test_hf.py)."""
from __future__ import annotations

import pytest
import torch

import coat_ds


@pytest.fixture
def clean_registry(monkeypatch):
    from deepspeed.runtime.zero import utils as zero_utils

    monkeypatch.delattr(torch.optim, "CoatAdamW", raising=False)
    monkeypatch.setattr(zero_utils, "ZERO_SUPPORTED_OPTIMIZERS",
                        [o for o in zero_utils.ZERO_SUPPORTED_OPTIMIZERS if o is not coat_ds.CoatAdamW])
    return zero_utils


def test_register_adds_exactly_the_two_entries_once(clean_registry):
    from coat_ds.integrations.deepspeed.registry import is_registered

    before_optim = set(vars(torch.optim))
    before_zero = list(clean_registry.ZERO_SUPPORTED_OPTIMIZERS)
    assert not is_registered()
    coat_ds.register_deepspeed()
    coat_ds.register_deepspeed()
    assert is_registered()
    assert set(vars(torch.optim)) - before_optim == {"CoatAdamW"}
    assert torch.optim.CoatAdamW is coat_ds.CoatAdamW
    assert clean_registry.ZERO_SUPPORTED_OPTIMIZERS == before_zero + [coat_ds.CoatAdamW]


def test_register_refuses_to_replace_another_torch_optim_name(clean_registry, monkeypatch):
    monkeypatch.setattr(torch.optim, "CoatAdamW", torch.optim.AdamW, raising=False)
    with pytest.raises(RuntimeError, match="torch.optim.CoatAdamW is already set"):
        coat_ds.register_deepspeed()
    assert coat_ds.CoatAdamW not in clean_registry.ZERO_SUPPORTED_OPTIMIZERS


def test_one_name_per_entry_point():
    # `coat_ds.deepspeed_initialize` is the integration's `initialize` itself, reached without an
    # extra import; the old `coat_ds.deepspeed` alias module is gone (one name per thing).
    from coat_ds.integrations.deepspeed import initialize

    assert coat_ds.deepspeed_initialize is initialize
    with pytest.raises(AttributeError, match="no attribute 'deepspeed'"):
        coat_ds.deepspeed
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        coat_ds.nope


def test_mark_zero_tested_adds_only_the_zero_entry(clean_registry):
    # What coat_ds.deepspeed_initialize does on its own: DeepSpeed's ZeRO check then knows
    # CoatAdamW (no "untested optimizer" warning), and torch.optim stays as it was.
    from coat_ds.integrations.deepspeed.registry import is_registered, mark_zero_tested

    before = list(clean_registry.ZERO_SUPPORTED_OPTIMIZERS)
    mark_zero_tested()
    mark_zero_tested()
    assert clean_registry.ZERO_SUPPORTED_OPTIMIZERS == before + [coat_ds.CoatAdamW]
    assert not hasattr(torch.optim, "CoatAdamW") and not is_registered()
