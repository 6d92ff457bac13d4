"""train.py's settings: every bad value from the YAML, the flags or the DeepSpeed JSON is refused
before anything is built, with a message naming the key, the value and what is allowed; both
engines read the JSON the same way. Validation only: nothing here builds a model or engine."""
from __future__ import annotations

import json
import os
import re
import sys

import pytest
import torch

from coat_ds.train.engine_setup import read_ds_settings
from coat_ds.integrations.fsdp import clip_grad_norm_
from coat_ds.train.config import TrainConfig, checkpoint_plan, field_docs
from coat_ds.train.determinism import deterministic_kernels
from helpers import run_in_repo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import train  # noqa: E402

COAT_JSON = os.path.join(ROOT, "ds_configs", "coat_zero2.json")
ADAMW_JSON = os.path.join(ROOT, "ds_configs", "bf16_zero2.json")

# (YAML line, fragments the message must hold: the key, the value as given, what is allowed)
BAD_YAML = [
    ('compress_activations: "no"', ["compress_activations", "'no'", "true or false"]),
    ("compile: 1", ["compile", "1", "true or false"]),
    ("max_steps: -5", ["max_steps", "-5", "integer >= 1"]),
    ('max_steps: "ten"', ["max_steps", "'ten'", "integer >= 1"]),
    ("max_steps: 10.0", ["max_steps", "10.0", "integer >= 1"]),
    ("max_steps: true", ["max_steps", "True", "integer >= 1"]),
    ("log_interval: 0", ["log_interval", "0", "integer >= 1"]),
    ("eval_batches: 0", ["eval_batches", "0", "integer >= 1"]),
    ("eval_interval: -1", ["eval_interval", "-1", "integer >= 0"]),
    ("warmup_steps: -1", ["warmup_steps", "-1", "integer >= 0"]),
    ("seq_len: 0", ["seq_len", "0", "integer >= 1"]),
    ("seed: -3", ["seed", "-3", "integer >= 0"]),
    ("val_fraction: 1.5", ["val_fraction", "1.5", "> 0.0 and < 1.0"]),
    ("min_lr_ratio: 1e-1", ["min_lr_ratio", "'1e-1'", ">= 0.0 and <= 1.0", "1.0e-3"]),
    ("min_lr_ratio: .nan", ["min_lr_ratio", "nan", "finite number"]),
    ("preset: huge", ["preset", "'huge'", "'tiny'"]),
    ("engine: jax", ["engine", "'jax'", "'deepspeed', 'fsdp'"]),
    ("fsdp_mode: fsdp3", ["fsdp_mode", "'fsdp3'", "'fsdp2', 'fsdp1'"]),
    ("bin_dtype: float32", ["bin_dtype", "'float32'", "'uint16'"]),
    ("save_interval: -5", ["save_interval", "-5", "integer >= 0"]),
    ("save_dir: 3", ["save_dir", "3", "a string"]),
    ('deepspeed: ""', ["deepspeed", "''", "non-empty string"]),
]


@pytest.mark.parametrize("line,fragments", BAD_YAML, ids=[b[0] for b in BAD_YAML])
def test_bad_yaml_value_names_file_key_value_and_allowed(tmp_path, line, fragments):
    y = tmp_path / "run.yaml"
    y.write_text(f"preset: tiny\n{line}\n")
    with pytest.raises(SystemExit) as err:
        train.parse_config(["--config", str(y)])
    msg = str(err.value)
    for fragment in [str(y)] + fragments:
        assert fragment in msg, (fragment, msg)


def test_good_yaml_and_flags_still_resolve(tmp_path):
    y = tmp_path / "run.yaml"
    y.write_text("preset: tiny\ncompress_activations: no\nmin_lr_ratio: 1.0e-1\nsave_dir: ck\nsave_interval: 5\n")
    cfg = train.parse_config(["--config", str(y), "--max-steps", "9", "--fsdp", "--max_steps", "8"])
    assert (cfg.preset, cfg.compress_activations, cfg.min_lr_ratio, cfg.max_steps, cfg.engine) == \
        ("tiny", False, 0.1, 8, "fsdp")


@pytest.mark.parametrize("flags,fragments", [
    (["--max-steps", "-5"], ["--max-steps", "max_steps", "-5", "integer >= 1"]),
    (["--log-interval", "0"], ["--log-interval", "log_interval", "0", "integer >= 1"]),
    (["--eval-interval", "-3"], ["--eval-interval", "eval_interval", "-3", "integer >= 0"]),
])
def test_bad_flag_value_names_flag_key_value_and_allowed(flags, fragments):
    with pytest.raises(SystemExit) as err:
        train.parse_config(flags)
    for fragment in fragments:
        assert fragment in str(err.value), (fragment, str(err.value))


def test_unparsable_flag_is_a_usage_error_naming_flag_value_and_type(capsys):
    with pytest.raises(SystemExit) as err:
        train.parse_config(["--max-steps", "ten"])
    assert err.value.code == 2
    stderr = capsys.readouterr().err
    assert "--max-steps" in stderr and "'ten'" in stderr and "an integer" in stderr


def _json(tmp_path, base: str, **changes) -> str:
    ds = json.load(open(base))
    for dotted, value in changes.items():
        *parents, key = dotted.split("__")
        node = ds
        for p in parents:
            node = node.setdefault(p, {})
        node[key] = value
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    return str(path)


# (base JSON, change, fragments the message must hold)
BAD_JSON = [
    (COAT_JSON, {"train_micro_batch_size_per_gpu": "8"}, ["train_micro_batch_size_per_gpu", "'8'", "integer >= 1"]),
    (COAT_JSON, {"train_micro_batch_size_per_gpu": 0}, ["train_micro_batch_size_per_gpu", "0", "integer >= 1"]),
    (COAT_JSON, {"gradient_accumulation_steps": 1.5}, ["gradient_accumulation_steps", "1.5", "integer >= 1"]),
    (COAT_JSON, {"train_batch_size": 7}, ["train_batch_size", "7", "x world size"]),
    (COAT_JSON, {"bf16__enabled": "false"}, ["bf16.enabled", "'false'", "true or false"]),
    (COAT_JSON, {"bf16__enabled": 1}, ["bf16.enabled", "1", "true or false"]),
    (COAT_JSON, {"bf16": True}, ["bf16", "True", '{"enabled": true}']),
    (COAT_JSON, {"fp16__enabled": "true"}, ["fp16.enabled", "'true'", "true or false"]),
    (COAT_JSON, {"fp16__enabled": True}, ["bf16.enabled and fp16.enabled", "at most one"]),
    (COAT_JSON, {"gradient_clipping": "1.0"}, ["gradient_clipping", "'1.0'", "finite number"]),
    (COAT_JSON, {"gradient_clipping": None}, ["gradient_clipping", "None", "finite number"]),
    (COAT_JSON, {"zero_optimization__stage": 4}, ["zero_optimization.stage", "4", "<= 3"]),
    (COAT_JSON, {"optimizer__params__lr": "3e-4"}, ["optimizer.params", "lr", "'3e-4'", ">= 0"]),
    (COAT_JSON, {"optimizer__params__betas": [0.9, 1.5]}, ["optimizer.params", "betas", "1.5", "[0, 1)"]),
    (COAT_JSON, {"optimizer__params__group_size": 100}, ["optimizer.params", "group_size", "100", "power of two"]),
    (ADAMW_JSON, {"optimizer__params__eps": -1.0}, ["optimizer.params", "eps", "-1.0", ">= 0"]),
    (ADAMW_JSON, {"optimizer__params__adam_w_mode": "no"}, ["adam_w_mode", "'no'", "true or false"]),
]


@pytest.mark.parametrize("engine", ["deepspeed", "fsdp"])
@pytest.mark.parametrize("base,change,fragments", BAD_JSON, ids=[str(b[1]) for b in BAD_JSON])
def test_bad_ds_json_value_refused_alike_by_both_engines(tmp_path, engine, base, change, fragments):
    path = _json(tmp_path, base, **change)
    with pytest.raises(SystemExit) as err:
        train.parse_config(["--deepspeed", path, "--engine", engine])
    msg = str(err.value)
    for fragment in [path] + fragments:
        assert fragment in msg, (fragment, msg)


def test_both_engines_read_the_same_settings(tmp_path):
    for path in (COAT_JSON, ADAMW_JSON, _json(tmp_path, COAT_JSON, bfloat16={"enabled": True}, bf16=None)):
        ds, fsdp = (read_ds_settings(path, 2, engine=e) for e in ("deepspeed", "fsdp"))
        assert (ds.micro_batch, ds.grad_accum, ds.clip, ds.bf16, ds.optimizer_type, ds.optimizer_params) == \
            (fsdp.micro_batch, fsdp.grad_accum, fsdp.clip, fsdp.bf16, fsdp.optimizer_type, fsdp.optimizer_params)
        assert fsdp.bf16  # the old `bfloat16` key too, as DeepSpeed reads it
    # FP16 and DeepSpeed's own optimizers: DeepSpeed runs them, the FSDP engine refuses by name.
    for change, key in (({"fp16": {"enabled": True}, "bf16": {"enabled": False}}, "fp16.enabled"),
                        ({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}, "optimizer.type")):
        path = _json(tmp_path, ADAMW_JSON, **change)
        read_ds_settings(path, 2, engine="deepspeed")
        with pytest.raises(ValueError, match=re.escape(key)):
            read_ds_settings(path, 2, engine="fsdp")


@pytest.mark.parametrize("clip,expected", [(-1.0, 0.0), (0, 0.0), (0.0, 0.0), (2.5, 2.5)])
def test_gradient_clipping_at_or_below_zero_is_off_as_in_deepspeed(tmp_path, clip, expected):
    s = read_ds_settings(_json(tmp_path, COAT_JSON, gradient_clipping=clip), 2)
    assert s.clip == expected


def test_clip_grad_norm_refuses_a_factor_that_would_flip_gradients():
    lin = torch.nn.Linear(4, 4)
    lin(torch.randn(2, 4)).sum().backward()
    grads = [p.grad.clone() for p in lin.parameters()]
    for bad in (-1.0, 0.0, float("nan"), float("inf"), "1.0"):
        with pytest.raises(ValueError, match="max_norm"):
            clip_grad_norm_(lin, bad)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, lin.parameters()))
    norm = clip_grad_norm_(lin, 1e-3)
    clipped = torch.cat([p.grad.flatten() for p in lin.parameters()]).norm()
    assert norm > 1e-3 and clipped == pytest.approx(1e-3, rel=1e-3)


def test_clip_grad_norm_without_sync_returns_the_norm_as_a_tensor():
    """sync=False (train.py's, every step): the same clipping, the norm as a 0-dim tensor on the
    gradients' device instead of a float read back from it."""
    grads = {}
    for sync in (True, False):
        torch.manual_seed(0)
        lin = torch.nn.Linear(4, 4)
        lin(torch.randn(2, 4)).sum().backward()
        grads[sync] = (clip_grad_norm_(lin, 1e-3, sync=sync), [p.grad.clone() for p in lin.parameters()])
    (n_float, g_float), (n_tensor, g_tensor) = grads[True], grads[False]
    assert isinstance(n_float, float) and isinstance(n_tensor, torch.Tensor) and n_tensor.dim() == 0
    assert n_tensor.item() == n_float > 1e-3
    assert all(torch.equal(a, b) for a, b in zip(g_float, g_tensor))


def test_help_lists_each_flag_once_with_what_it_does_and_its_default(capsys):
    with pytest.raises(SystemExit) as err:
        train.parse_config(["--help"])
    assert err.value.code == 0
    out = capsys.readouterr().out
    section = out.split("options:", 1)[1]
    # "  --seq-len INT   tokens per ..." starts an entry, its help wrapped onto indented lines:
    # the option strings of each entry (metavars dropped) and its help text.
    entries = []
    for line in section.splitlines():
        if line.startswith("  -"):
            head, *help_start = re.split(r"\s{2,}", line.strip(), maxsplit=1)
            entries.append(([part.split()[0] for part in head.split(", ")], help_start))
        elif line.strip():
            entries[-1][1].append(line.strip())
    listed = [flag for flags, _ in entries for flag in flags]
    helps = {flags[0]: "".join("".join(lines).split()) for flags, lines in entries}  # wrapped anywhere
    for name, doc in field_docs(TrainConfig).items():
        flag = "--" + name.replace("_", "-")
        assert listed.count(flag) == 1, (flag, listed)
        assert f"--{name}" not in listed or "_" not in name, f"--{name} listed beside {flag}"
        # The entry is the field's comment and its default, nothing else (a % in a comment once
        # made argparse print the action's dict there).
        assert doc and helps[flag].startswith("".join(f"{doc} (default:".split())), (name, helps[flag])
        assert helps[flag].endswith(")") and "option_strings" not in helps[flag], (name, helps[flag])


def test_deterministic_switch_turns_on_deterministic_kernels(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before, fill = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    try:
        assert train.parse_config(["--deterministic"]).deterministic and not train.parse_config([]).deterministic
        deterministic_kernels()
        assert torch.are_deterministic_algorithms_enabled() and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert torch.utils.deterministic.fill_uninitialized_memory is False
    finally:
        torch.use_deterministic_algorithms(before)
        torch.utils.deterministic.fill_uninitialized_memory = fill


@pytest.mark.slow
def test_run_says_when_no_checkpoint_will_be_saved(tmp_path):
    """Also the library-only install (torch and pyyaml): the FSDP run with CoatAdamW, where
    `import numpy` and `import deepspeed` fail as where neither is installed."""
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n"
        "sys.modules.update(numpy=None, deepspeed=None)  # import fails, find_spec finds none\n"
        "print('numpy and deepspeed hidden', file=sys.stderr)\n")
    common = ["train.py", "--fsdp", "--preset", "tiny", "--seq-len", "16", "--max-steps", "1", "--eval-batches", "1",
              "--max-data-bytes", "100000", "--deterministic"]
    proc = run_in_repo([sys.executable, *common], timeout=300,
                       PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT, os.environ.get("PYTHONPATH", "")]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "numpy and deepspeed hidden" in proc.stderr and "step 1/1" in proc.stdout
    assert "checkpoints: NONE will be saved" in proc.stdout
    assert "deterministic kernels: on" in proc.stdout
    assert "unused" in checkpoint_plan(TrainConfig(save_interval=5))
    assert "NONE" not in checkpoint_plan(TrainConfig(save_dir="ck", save_interval=5))
