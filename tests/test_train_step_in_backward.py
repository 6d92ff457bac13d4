"""train.py with CoatAdamW stepping in backward (`--step-in-backward`, or
`"step_in_backward": true` in the JSON's optimizer.params): FSDP2 on one process and on 2 gloo
ranks, gradient accumulation, resume bit for bit, and the engines that refuse it."""
from __future__ import annotations

import json
import math
import os
import sys

import pytest

from helpers import ROOT, read_metrics, run_in_repo, run_ranks

sys.path.insert(0, ROOT)
import train  # noqa: E402

COMMON = ("train.py", "--fsdp", "--config", "configs/tiny.yaml", "--log-interval", "2", "--eval-interval", "0",
          "--eval-batches", "2")


def _json(tmp_path, name: str, **changes) -> str:
    with open(os.path.join(ROOT, "ds_configs", "coat_zero2.json")) as f:
        ds = json.load(f)
    params = changes.pop("params", {})
    ds.update(changes)
    ds["optimizer"]["params"].update(params)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(ds))
    return str(path)


def test_flag_or_json_key_turns_it_on_and_unsupported_runs_are_refused_by_name(tmp_path):
    cfg = train.parse_config(["--fsdp", "--step-in-backward"])
    assert cfg.step_in_backward
    lines = "\n".join(train.settings_lines(cfg))
    assert "step_in_backward: true" in lines  # the resolved config
    assert "step in backward: ON with gradient_clipping 1" in lines and "exact global norm" in lines
    # Either one turns it on: the JSON's key alone shows in the resolved config too.
    in_json = _json(tmp_path, "on", params={"step_in_backward": True})
    assert train.parse_config(["--fsdp", "--deepspeed", in_json]).step_in_backward
    assert not train.parse_config(["--fsdp"]).step_in_backward
    no_clip = train.parse_config(["--fsdp", "--step-in-backward", "--deepspeed", _json(tmp_path, "nc",
                                                                                      gradient_clipping=0)])
    assert "no clipping" in train.step_in_backward_note(no_clip)

    refused = {
        ("--step-in-backward",): ["--step-in-backward", "DeepSpeed engine", "ZeRO", "--fsdp (FSDP2)"],
        ("--deepspeed", in_json): ["optimizer.params.step_in_backward", "DeepSpeed engine", "--fsdp (FSDP2)"],
        ("--fsdp", "--fsdp-mode", "fsdp1", "--step-in-backward"): ["fsdp1", "FSDP1 reduces gradients after"],
        ("--fsdp", "--step-in-backward", "--deepspeed", "ds_configs/bf16_zero2.json"): ["needs CoatAdamW", "'AdamW'"],
        ("--fsdp", "--deepspeed", _json(tmp_path, "mgn", params={"step_in_backward": True, "max_grad_norm": 1.0})):
            ["optimizer.params.max_grad_norm", "gradient_clipping"],
        ("--fsdp", "--master-weights", "bf16+8", "--deepspeed", "ds_configs/bf16_zero2.json"):
            ["--master-weights", "master_weights needs CoatAdamW", "'AdamW'"],
        ("--fsdp", "--fsdp-mode", "fsdp1", "--master-weights", "bf16+16"): ["'bf16+16'", "FSDP1", "fsdp2"],
    }
    for argv, words in refused.items():
        with pytest.raises(SystemExit) as err:
            train.parse_config(list(argv))
        assert all(w in str(err.value.code) for w in words), (argv, err.value.code)


@pytest.mark.slow
def test_one_process_with_accumulation_equals_the_normal_step(tmp_path):
    """No clipping, 2 micro-batches per step: stepping in the last backward applies the same
    accumulated gradient as step() would, so the runs agree bit for bit, step for step; with
    --master-weights bf16+8 too, the log counts 3 bytes of master per parameter."""
    runs, out = {}, {}
    for name, params, flags in (("step", {}, ()), ("in_backward", {"step_in_backward": True}, ()),
                                ("bf16+8", {"step_in_backward": True}, ("--master-weights", "bf16+8"))):
        ds = _json(tmp_path, name, gradient_accumulation_steps=2, gradient_clipping=0, params=params)
        proc = run_in_repo([sys.executable, *COMMON, "--max-steps", "4", "--deepspeed", ds, *flags,
                            "--metrics-file", str(tmp_path / f"{name}.jsonl")], 300)
        assert "micro-batch 8 x grad-accum 2" in proc.stdout and "step 4/4 (100%)" in proc.stdout
        runs[name], out[name] = read_metrics(tmp_path / f"{name}.jsonl"), proc.stdout
    assert "step in backward: ON" in out["in_backward"] and "no clipping" in out["in_backward"]
    # --master-weights: BF16 weights with an 8-bit remainder (3 bytes of master), no gradient
    # outliving its bucket; a lossy master and BF16 gradients, so close to the FP32 run, not equal.
    assert "master_weights: bf16+8" in out["bf16+8"] and "all ranks: master 3.00 |" in out["bf16+8"]
    assert "gradients 0.00" in out["bf16+8"]
    got, ref = runs["bf16+8"][4]["loss"], runs["step"][4]["loss"]
    assert math.isfinite(got) and abs(got - ref) < 0.02 * ref, (got, ref)
    for step in (2, 4):
        got, ref = runs["in_backward"][step], runs["step"][step]
        assert math.isfinite(got["loss"])
        assert (got["loss"], got["lr"], got["eval_loss"] if step == 4 else 0) == \
            (ref["loss"], ref["lr"], ref["eval_loss"] if step == 4 else 0)


@pytest.mark.slow
def test_two_ranks_train_and_resume_bitwise(tmp_path):
    save = tmp_path / "ckpt"
    full = run_ranks(*COMMON, "--step-in-backward", "--max-steps", "6", "--save-dir", str(save), "--save-interval",
                     "4", "--metrics-file", str(tmp_path / "full.jsonl"), timeout=300)
    assert "2 rank(s)" in full.stdout and "step in backward: ON" in full.stdout
    assert "step in backward: ON with gradient_clipping 1" in full.stdout
    assert "; stepping in backward: the BF16 copies held for the clipped step" in full.stdout
    ref = read_metrics(tmp_path / "full.jsonl")
    # Read from the live tensors: FP32 master shards, no FP32 gradient, a BF16 copy of each.
    per_param = ref[1]["training_state_bytes_per_param"]
    assert (per_param["master"], per_param["gradients"], per_param["compute"]) == (4.0, 2.0, 0.0)
    assert 2.0 < per_param["optimizer"] < 2.5
    losses = [ref[s]["loss"] for s in (2, 4, 6)]
    assert all(math.isfinite(v) for v in losses) and losses[2] < losses[0]
    # Resumed from step 4, steps 5..6 repeat exactly.
    run_ranks(*COMMON, "--step-in-backward", "--max-steps", "6", "--resume", str(save / "step4"),
              "--metrics-file", str(tmp_path / "resumed.jsonl"), timeout=300)
    got = read_metrics(tmp_path / "resumed.jsonl")
    assert (got[6]["loss"], got[6]["eval_loss"]) == (ref[6]["loss"], ref[6]["eval_loss"])
