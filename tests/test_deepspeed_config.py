"""The DeepSpeed JSON -> CoatAdamW translation (in-process, no distributed run)."""
from __future__ import annotations

import glob
import json
import os

import pytest
import torch

from coat_ds import CoatAdamW
from coat_ds.integrations.deepspeed import OPTIMIZER_PARAMS, initialize, prepare_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfg(**params) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
            "optimizer": {"type": "CoatAdamW", "params": {"lr": 1e-3, **params}}}


def test_coat_section_becomes_kwargs_and_leaves_deepspeed_config():
    ds, kwargs = prepare_config(_cfg(betas=[0.8, 0.9], second_moment_format="e5m2"))
    assert "optimizer" not in ds
    assert ds["zero_allow_untested_optimizer"] is True
    assert kwargs == {"lr": 1e-3, "betas": (0.8, 0.9), "second_moment_format": "e5m2"}
    CoatAdamW([torch.nn.Parameter(torch.zeros(3))], **kwargs)


def test_input_dict_not_mutated_and_type_case_insensitive():
    cfg = _cfg()
    cfg["optimizer"]["type"] = "coatadamw"
    before = json.dumps(cfg, sort_keys=True)
    _, kwargs = prepare_config(cfg)
    assert kwargs == {"lr": 1e-3}
    assert json.dumps(cfg, sort_keys=True) == before


def test_other_optimizers_pass_through_untouched():
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1}}
    ds, kwargs = prepare_config(cfg)
    assert kwargs is None and ds == cfg


def test_misspelled_param_names_the_key_and_the_valid_ones(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_cfg(first_moment_fromat="e4m3")))
    with pytest.raises(ValueError) as err:
        prepare_config(str(path))
    msg = str(err.value)
    assert "'first_moment_fromat'" in msg and "did you mean 'first_moment_format'" in msg
    for key in OPTIMIZER_PARAMS:
        assert key in msg


def test_initialize_fails_before_touching_deepspeed():
    with pytest.raises(ValueError, match="'weight_decy'"):
        initialize(model=torch.nn.Linear(2, 2), config=_cfg(weight_decy=0.1))


def test_unknown_section_key_and_duplicate_optimizer_rejected():
    cfg = _cfg()
    cfg["optimizer"]["parmas"] = {}
    with pytest.raises(ValueError, match="parmas"):
        prepare_config(cfg)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="keep one"):
        initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=_cfg())


def test_checkpoint_modes_that_would_corrupt_scales_are_refused():
    cfg = _cfg()
    cfg["zero_optimization"]["elastic_checkpoint"] = True
    with pytest.raises(ValueError, match="elastic_checkpoint"):
        prepare_config(cfg)
    cfg = _cfg()
    cfg["checkpoint"] = {"load_universal": True}
    with pytest.raises(ValueError, match="load_universal"):
        prepare_config(cfg)


def test_offload_settings():
    cfg = _cfg()
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    ds, _ = prepare_config(cfg)
    assert ds["zero_force_ds_cpu_optimizer"] is False
    with pytest.raises(ValueError, match="triton"):
        prepare_config({**cfg, "optimizer": {"type": "CoatAdamW", "params": {"backend": "triton"}}})
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme"}
    with pytest.raises(ValueError, match="nvme"):
        prepare_config(cfg)


def test_shipped_ds_configs():
    files = sorted(glob.glob(os.path.join(ROOT, "ds_configs", "*.json")))
    names = {os.path.basename(f) for f in files}
    assert {f"coat_zero{s}.json" for s in (1, 2, 3)} | {f"bf16_zero{s}.json" for s in (1, 2, 3)} | \
        {"coat_zero2_offload.json"} <= names
    for s in (1, 2, 3):
        coat = json.load(open(os.path.join(ROOT, "ds_configs", f"coat_zero{s}.json")))
        base = json.load(open(os.path.join(ROOT, "ds_configs", f"bf16_zero{s}.json")))
        ds, kwargs = prepare_config(coat)
        assert kwargs is not None and ds["zero_optimization"]["stage"] == s
        # The baseline is torch AdamW with the same hyper-parameters and engine settings.
        assert base["optimizer"]["type"] == "AdamW" and base["optimizer"]["params"]["torch_adam"] is True
        for key in ("lr", "betas", "eps", "weight_decay"):
            assert base["optimizer"]["params"][key] == coat["optimizer"]["params"][key]
        strip = ("optimizer", "zero_force_ds_cpu_optimizer")
        assert {k: v for k, v in base.items() if k not in strip} == {k: v for k, v in coat.items() if k not in strip}
    ds, _ = prepare_config(os.path.join(ROOT, "ds_configs", "coat_zero2_offload.json"))
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
