"""The DeepSpeed JSON -> CoatAdamW translation, and the keys of the JSON both engines read:
unknown ones are errors (what we read) or one warning (DeepSpeed's); in-process, no
distributed run."""
from __future__ import annotations

import glob
import json
import os
import re
import warnings

import pytest
import torch

from coat_ds import CoatAdamW
from coat_ds.config.checks import ConfigError
from coat_ds.train.engine_setup import read_ds_settings
from coat_ds.integrations.deepspeed.engine import OPTIMIZER_PARAMS, initialize, prepare_config

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


def test_bf16_master_weights_set_deepspeeds_bf16_partitions_or_are_refused():
    cfg = {**_cfg(master_weights="bf16+16"), "bf16": {"enabled": True}}
    ds, kwargs = prepare_config(cfg)
    assert kwargs["master_weights"] == "bf16+16"
    assert ds["bf16"]["bf16_master_weights_and_grads"] is True and ds["bf16"]["bf16_optimizer_states"] is True
    with pytest.raises(ValueError, match="master_weights='bf16\\+16' needs BF16 parameters and ZeRO stage"):
        prepare_config(_cfg(master_weights="bf16+16"))  # bf16 not enabled
    with pytest.raises(ValueError, match="ZeRO stage 1, 2 or 3"):
        prepare_config({**cfg, "zero_optimization": {"stage": 0}})
    offload = {**cfg, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    with pytest.raises(ValueError, match="DeepSpeedCPUAdam"):
        prepare_config(offload)
    with pytest.raises(ValueError, match="bf16_master_weights_and_grads=true hands CoatAdamW BF16 partitions"):
        prepare_config({**_cfg(), "bf16": {"enabled": True, "bf16_master_weights_and_grads": True}})


def test_deepspeeds_overflow_check_goes_off_only_where_coat_adamw_takes_it_over():
    """ZeRO-1/2 + BF16 + no optimizer offload + a norm computed: DeepSpeed's per-step check
    is off (CoatAdamW skips by the global norm, tests/test_deepspeed_zero.py); a key the
    config sets, and every other case, is left as it is."""
    def check(cfg):
        ds, _ = prepare_config(cfg)
        return ds.get("bf16", ds.get("bfloat16", {})).get("check_grad_overflow")

    for stage in (1, 2):
        cfg = _cfg()
        cfg["zero_optimization"]["stage"] = stage
        cfg["bf16"] = {"enabled": True}
        assert check(cfg) is False
    assert check({**_cfg(), "bfloat16": {"enabled": True}}) is False  # DeepSpeed's older key
    assert check({**_cfg(), "bf16": {"enabled": True, "check_grad_overflow": True}}) is True
    assert check(_cfg()) is None  # FP32: DeepSpeed skips on a non-finite norm itself
    for zero in ({"stage": 3}, {"stage": 0}, {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                 {"stage": 2, "compute_grad_norm": False}):
        assert check({**_cfg(), "bf16": {"enabled": True}, "zero_optimization": zero}) is None, zero
    plain = {**_bf16_cfg()}
    assert prepare_config(plain)[0] == plain  # another optimizer: DeepSpeed's check stays


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


def _bf16_cfg(**params) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, **params}}}


@pytest.mark.parametrize("make", [_cfg, _bf16_cfg], ids=["CoatAdamW", "AdamW"])
def test_misspelled_section_is_warned_with_the_close_match_on_both_engines(make):
    cfg = make()
    cfg["zero_optimisation"] = cfg.pop("zero_optimization")
    cfg["gradient_cliping"] = 1.0
    expected = r"'zero_optimisation' \(did you mean 'zero_optimization'\?\), 'gradient_cliping' \(did you mean " \
               r"'gradient_clipping'\?\)"
    for engine in ("deepspeed", "fsdp"):
        with pytest.warns(UserWarning, match=expected):
            read_ds_settings(cfg, 1, engine=engine)
    with pytest.warns(UserWarning, match=expected):  # what deepspeed_initialize reads
        prepare_config(cfg)


def test_deepspeed_keys_raise_no_warning():
    # The shipped configs and DeepSpeed sections that coat_ds never reads itself.
    cfg = json.load(open(os.path.join(ROOT, "ds_configs", "coat_zero2_offload.json")))
    cfg.update({"scheduler": {"type": "WarmupLR"}, "tensorboard": {"enabled": False}, "wandb": {"enabled": False},
                "csv_monitor": {"enabled": False}, "comms_logger": {"enabled": False},
                "flops_profiler": {"enabled": False}, "activation_checkpointing": {}, "aio": {}, "checkpoint": {},
                "data_types": {}, "compile": {}, "torch_autocast": {}, "communication_data_type": None,
                "prescale_gradients": False, "gradient_predivide_factor": 1.0, "memory_breakdown": False,
                "dump_state": False, "tensor_parallel": {}, "zero_allow_untested_optimizer": True})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for f in sorted(glob.glob(os.path.join(ROOT, "ds_configs", "*.json"))):
            for engine in ("deepspeed", "fsdp"):
                read_ds_settings(f, 2, engine=engine)
            prepare_config(f)
        prepare_config(cfg)


@pytest.mark.parametrize("engine", ["deepspeed", "fsdp"])
def test_unknown_adamw_keys_are_errors_naming_them(engine):
    with pytest.raises(ValueError) as err:
        read_ds_settings(_bf16_cfg(weight_decy=0.1), 1, engine=engine)
    msg = str(err.value)
    assert "optimizer.params of AdamW has unknown key 'weight_decy'" in msg
    assert "did you mean 'weight_decay'" in msg and "valid keys: lr, betas, eps, weight_decay" in msg
    cfg = _bf16_cfg()
    cfg["optimizer"]["parms"] = cfg["optimizer"].pop("params")  # silently default hyper-parameters before
    with pytest.raises(ValueError, match=r"optimizer has unknown key 'parms' \(did you mean 'params'\?\)"):
        read_ds_settings(cfg, 1, engine=engine)


@pytest.mark.parametrize("kind, bad", [("CoatAdamW", "first_moment_fromat"), ("AdamW", "weight_decy")])
def test_every_reader_of_the_optimizer_section_refuses_alike(tmp_path, kind, bad):
    """One reader (integrations.deepspeed.config.optimizer_section) behind DeepSpeed's initialize, train.py
    under either engine and the profiler: the same misspelled key, the same error, naming the
    file. (The profiler took an AdamW section's keys unchecked before.)"""
    from coat_ds.profile.trainee import load_side

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                                "optimizer": {"type": kind, "params": {"lr": 1e-3, bad: 0.1}}}))
    readers = [lambda: read_ds_settings(str(path), 1, engine="deepspeed"),
               lambda: read_ds_settings(str(path), 1, engine="fsdp"), lambda: load_side("baseline", str(path))]
    if kind == "CoatAdamW":  # DeepSpeed checks its own AdamW section
        readers.append(lambda: prepare_config(str(path)))
    for read in readers:
        with pytest.raises(ValueError) as err:
            read()
        assert str(err.value).startswith(f"{path}: optimizer.params of {kind} has unknown key {bad!r}"), str(err.value)


def test_unknown_zero_key_is_refused_by_the_fsdp_reader_as_by_deepspeed():
    """The FSDP engine reads only `stage` of the ZeRO section, without DeepSpeed: its list of
    the keys DeepSpeed takes is the installed DeepSpeed's, and a misspelled one is refused."""
    import pydantic
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from coat_ds.integrations.deepspeed.config import ZERO_KEYS

    fields = DeepSpeedZeroConfig.model_fields
    assert sorted(ZERO_KEYS) == sorted({*fields, *(f.alias for f in fields.values() if f.alias)})
    for make in (_cfg, _bf16_cfg):
        cfg = make()
        cfg["zero_optimization"]["stagee"] = 2
        with pytest.raises(ValueError, match=r"^DeepSpeed config: zero_optimization has unknown key 'stagee' \(did you "
                                             r"mean 'stage'\?\); valid keys: stage, .*, leaf_module$"):
            read_ds_settings(cfg, 1, engine="fsdp")
        with pytest.raises(pydantic.ValidationError, match="stagee"):  # DeepSpeed's own reader
            DeepSpeedZeroConfig(**cfg["zero_optimization"])
    cfg = _bf16_cfg()
    cfg["zero_optimization"].update(stage3_max_live_parameters=10**9, max_reuse_distance=10**9)  # names and aliases
    assert read_ds_settings(cfg, 1, engine="fsdp").zero_stage == 2


def test_optimizer_section_that_is_no_object_is_an_error_naming_it():
    for read in (prepare_config, lambda cfg: read_ds_settings(cfg, 1)):
        with pytest.raises(ConfigError, match=r"optimizer: got 'CoatAdamW' \(str\)"):
            read({"train_micro_batch_size_per_gpu": 1, "optimizer": "CoatAdamW"})


def test_string_values_are_refused_naming_the_key_before_deepspeed():
    """What the FSDP engine's reader refuses, deepspeed_initialize refuses alike (DeepSpeed
    would fail later with a bare TypeError, or read "false" as False), for either optimizer."""
    import coat_ds

    bad = [(key, "4", "an integer >= 1")
           for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")]
    bad += [("gradient_clipping", "1.0", "a finite number"), ("zero_optimization.stage", "2", "an integer >= 0"),
            ("bf16.enabled", "false", "true or false")]
    for make in (_bf16_cfg, _cfg):
        for key, value, allowed in bad:
            cfg = make()
            *section, name = key.split(".")
            (cfg.setdefault(section[0], {}) if section else cfg)[name] = value
            with pytest.raises(ConfigError, match=re.escape(f"DeepSpeed config: {key}: got {value!r} (str); allowed: "
                                                            f"{allowed}")):
                coat_ds.deepspeed_initialize(model=torch.nn.Linear(2, 2), config=cfg)


def test_step_in_backward_is_refused_by_deepspeed_initialize_naming_the_key_and_fsdp2():
    import coat_ds

    model = torch.nn.Linear(2, 2)
    for kwargs, named in ((dict(config=_cfg(step_in_backward=True)), "optimizer.params.step_in_backward=true"),
                          (dict(config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}},
                                optimizer=CoatAdamW(model.parameters(), step_in_backward=True)),
                           "CoatAdamW(step_in_backward=True)")):
        with pytest.raises(ValueError) as err:
            coat_ds.deepspeed_initialize(model=model, **kwargs)
        msg = str(err.value)
        assert named in msg and "ZeRO" in msg and "FSDP2" in msg and "--fsdp" in msg, msg
    # Off, as by default, the same JSON key is accepted.
    assert prepare_config(_cfg(step_in_backward=False))[1] == {"lr": 1e-3, "step_in_backward": False}
