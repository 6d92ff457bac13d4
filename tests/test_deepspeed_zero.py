"""CoatAdamW under real DeepSpeed ZeRO-1/2/3: 2 CPU ranks over gloo, no mocks.

Run as a script this file is the worker that `torchrun` starts; under pytest it launches
those workers and checks what they report (one JSON file per rank).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from helpers import end_worker, free_port

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STEPS, SAVE_AT = 8, 4  # train STEPS optimizer steps; checkpoint after SAVE_AT


def ds_config(stage: int, grad_accum: int = 1, offload: bool = False, check_grad_overflow: bool | None = None,
              master_weights: str = "fp32") -> dict:
    zero = {"stage": stage}
    if stage == 3:
        # Partition every parameter and cut them into several sub-groups, so step() is
        # called once per sub-group with a different flat tensor each time.
        zero.update({"stage3_param_persistence_threshold": 0, "sub_group_size": 25_000})
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True} if check_grad_overflow is None else {"enabled": True,
                                                                       "check_grad_overflow": check_grad_overflow},
        "optimizer": {"type": "CoatAdamW",
                      "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1, "min_quant_numel": 1024,
                                 "master_weights": master_weights}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }


# -- worker side ------------------------------------------------------------------------------

def _engine(stage: int, grad_accum: int = 1, offload: bool = False, check_grad_overflow: bool | None = None,
            master_weights: str = "fp32", deepspeeds_own: bool = False):
    """coat_ds's initialize, or (`deepspeeds_own`) DeepSpeed's after register_deepspeed(), as
    Hugging Face Trainer and Accelerate call it."""
    import deepspeed

    import coat_ds
    from coat_ds.integrations.deepspeed.engine import initialize
    from coat_ds.models.llama import Llama, model_config

    torch.manual_seed(0)
    model = Llama(model_config("tiny", max_seq_len=32))
    config = ds_config(stage, grad_accum, offload, check_grad_overflow, master_weights)
    if deepspeeds_own:
        coat_ds.register_deepspeed()
        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    else:
        engine, *_ = initialize(model=model, config=config)
    return engine


def _data():
    from coat_ds.train.data import DataConfig, load_data

    return load_data(DataConfig(max_bytes=300_000))


def _train(engine, data, steps: range, ranks: list[int]) -> list[float]:
    """One optimizer step per entry of `steps`; micro-batch i of a step is what rank
    ranks[i] of a 2-rank run would draw, so 1 rank x 2 micro-steps sees a 2-rank batch."""
    from coat_ds.train.data import batch_seed

    losses = []
    for step in steps:
        micro = []
        for r in ranks:
            x, y = data.batch("train", 4, 32, batch_seed(0, step, r, 0))
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            micro.append(loss.detach().float())
        t = torch.stack(micro).mean()
        torch.distributed.all_reduce(t)
        losses.append((t / torch.distributed.get_world_size()).item())
    return losses


def _snapshot(opt) -> dict:
    return {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}


def _same_state(a: dict, b_opt) -> bool:
    b = {id(p): s for p, s in b_opt.state.items()}
    if len(a) != len(b):
        return False
    for sa, sb in zip(a.values(), b.values()):
        if sa.keys() != sb.keys():
            return False
        for k in sa:
            if sa[k].dtype != sb[k].dtype or not torch.equal(sa[k].view(-1), sb[k].view(-1)):
                return False
    return True


def worker_zero(stage: int, out: str) -> None:
    from coat_ds.integrations.deepspeed.engine import coat_optimizer, local_partitions, state_memory_report

    data = _data()
    engine = _engine(stage)
    rank = engine.global_rank
    opt = coat_optimizer(engine)
    report_before = state_memory_report(engine)
    losses = _train(engine, data, range(SAVE_AT), [rank])
    ckpt = os.path.join(out, f"ckpt_zero{stage}")
    engine.save_checkpoint(ckpt, tag="mid", client_state={"step": SAVE_AT})
    saved = _snapshot(opt)
    losses += _train(engine, data, range(SAVE_AT, STEPS), [rank])

    parts = [t for t, _ in local_partitions(engine)]
    states = [opt.state[t] for t in parts]
    result = {
        "rank": rank,
        "world": engine.dp_world_size,
        "model_numel": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in engine.module.parameters()),
        "param_numels": [p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in engine.module.parameters()],
        "part_numels": [t.numel() for t in parts],
        "n_state_entries": len(opt.state),
        "state_keys_are_parts": sorted(map(id, opt.state)) == sorted(map(id, parts)),
        "codes_shapes": [list(s["exp_avg_codes"].shape) if "exp_avg_codes" in s else None for s in states],
        "center_shapes": [list(s["exp_avg_center"].shape) if "exp_avg_center" in s else None for s in states],
        "dtypes": [{k: str(v.dtype) for k, v in s.items()} for s in states],
        "steps": [float(s["step"]) for s in states],
        "state_bytes": opt.state_bytes(),
        "reported_bytes": report_before.state_bytes,
        "reported_numel": report_before.numel,
        "losses": losses,
    }

    # A fresh engine resumed from the checkpoint must hold the same state, bit for bit,
    # and then produce the same losses as the run that never stopped.
    resumed = _engine(stage)
    _, client = resumed.load_checkpoint(ckpt, tag="mid")
    result["resume_client_step"] = client.get("step")
    result["resume_state_equal"] = _same_state(saved, coat_optimizer(resumed))
    result["resumed_losses"] = _train(resumed, data, range(SAVE_AT, STEPS), [rank])

    if stage == 2:  # ZeRO-Offload: CoatAdamW steps on the host copy
        overflow_runs(data, out)
        off = _engine(2, offload=True)
        result["offload_losses"] = _train(off, data, range(3), [rank])
        result["offload_state_devices"] = sorted({str(v.device) for s in coat_optimizer(off).state.values()
                                                  for v in s.values()})
        result["offload_n_state"] = len(coat_optimizer(off).state)
    with open(os.path.join(out, f"zero{stage}_rank{rank}.json"), "w") as f:
        json.dump(result, f)


OVERFLOW_STEP, OVERFLOW_STEPS = 2, 5


def overflow_runs(data, out: str) -> None:
    """ZeRO-2, the same run three ways, rank 1 making one element of the first parameter's gradient
    inf at OVERFLOW_STEP (after averaging it lands in rank 0's partition only): with
    DeepSpeed's overflow check (`check_grad_overflow: true`); as configured by default, with
    CoatAdamW skipping by the global norm instead; the same with that skip turned off (each
    rank steps on what it holds); and through DeepSpeed's own initialize with the check off in
    the JSON, where register_deepspeed's hook sets up the same skip at the first step."""
    from coat_ds.integrations.deepspeed.engine import coat_optimizer

    result = {}
    for name, check, gate, own in (("checked", True, True, False), ("on_device", None, True, False),
                                   ("ungated", None, False, False), ("registered", False, True, True)):
        engine = _engine(2, check_grad_overflow=check, deepspeeds_own=own)
        opt = coat_optimizer(engine)
        result[f"{name}_gated"] = opt._global_norm is not None
        if not gate:
            opt.skip_steps_by_global_norm(None)
        first = next(engine.module.parameters())
        armed = []

        def poison(grad):
            if armed and engine.global_rank == 1:
                grad = grad.clone()
                grad.view(-1)[0] = float("inf")
            return grad

        first.register_hook(poison)
        losses = []
        for step in range(OVERFLOW_STEPS):
            armed[:] = [True] if step == OVERFLOW_STEP else []
            losses += _train(engine, data, range(step, step + 1), [engine.global_rank])
        part = engine.optimizer.single_partition_of_fp32_groups[0]
        result[name] = {"losses": losses, "skipped_steps": engine.skipped_steps, "global_steps": engine.global_steps,
                        "nonfinite_groups": opt.nonfinite_groups(), "groups": -(-part.numel() // 128),
                        "gated_after": opt._global_norm is not None}
        torch.save({"param": part.detach().clone(), "state": {k: v.clone() for k, v in opt.state[part].items()}},
                   os.path.join(out, f"overflow_{name}_rank{engine.global_rank}.pt"))
    with open(os.path.join(out, f"overflow_rank{torch.distributed.get_rank()}.json"), "w") as f:
        json.dump(result, f)


def worker_reshard(stage: int, out: str) -> None:
    """One rank (2 micro-steps per step) resumes the 2-rank checkpoint of worker_zero."""
    from coat_ds.integrations.deepspeed.engine import coat_optimizer
    from coat_ds.integrations.deepspeed.checkpoint import consolidate_checkpoint, load_checkpoint

    data = _data()
    engine = _engine(stage, grad_accum=2)
    path, client = load_checkpoint(engine, os.path.join(out, f"ckpt_zero{stage}"), tag="mid")
    # Save at the new size right away and consolidate both: the re-partitioned state must
    # describe the same parameters and moments as the original.
    one = os.path.join(out, f"ckpt_zero{stage}_1rank")
    engine.save_checkpoint(one, tag="mid")
    a = consolidate_checkpoint(os.path.join(out, f"ckpt_zero{stage}"), "mid")
    b = consolidate_checkpoint(one, "mid")
    err = {}
    for key in ("exp_avg", "exp_avg_sq"):
        num = sum((a[key][n] - b[key][n]).norm() ** 2 for n in a[key]) ** 0.5
        den = sum(a[key][n].norm() ** 2 for n in a[key]) ** 0.5
        err[key] = float(num / den)
    result = {
        "client_step": client.get("step"),
        "global_steps": engine.global_steps,
        "params_equal": all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"]),
        "same_names": sorted(a["params"]) == sorted(b["params"]),
        "moment_rel_err": err,
        "steps": [float(s["step"]) for s in coat_optimizer(engine).state.values()],
        "losses": _train(engine, data, range(SAVE_AT, STEPS), [0, 1]),
    }
    with open(os.path.join(out, f"reshard_zero{stage}.json"), "w") as f:
        json.dump(result, f)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _reference_steps(opt) -> dict:
    """Step, before each of `opt`'s steps, an FP32-master CoatAdamW per partition on the
    gradient DeepSpeed hands `opt` (clipped, BF16), from the partition's master at its first
    step; returns {id(partition): (partition, reference parameter)}."""
    import inspect

    from coat_ds import CoatAdamW

    args = set(inspect.signature(CoatAdamW).parameters) - {"params", "master_weights"}
    refs = {}

    def before(o, *_):
        for group in o.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if id(p) not in refs:
                    r = torch.nn.Parameter(o.fp32_master(p).clone())
                    refs[id(p)] = (p, r, CoatAdamW([r], **{k: v for k, v in group.items() if k in args}))
                _, r, ref_opt = refs[id(p)]
                r.grad = p.grad.float()
                ref_opt.step()

    opt.register_step_pre_hook(before)
    return refs


def worker_master(_: int, out: str) -> None:
    """master_weights="bf16+16" under ZeRO-2 and ZeRO-3 (DeepSpeed's BF16 master partitions):
    masters against FP32-master references on the same gradients, a resume, and the converting
    checkpoint path into an FP32-master and a "bf16+16" engine."""
    from coat_ds.integrations.deepspeed.checkpoint import consolidate_checkpoint, load_fp32_checkpoint
    from coat_ds.integrations.deepspeed.engine import coat_optimizer, local_partitions

    data = _data()
    result = {}
    for stage in (2, 3):
        engine = _engine(stage, master_weights="bf16+16")
        rank, opt = engine.global_rank, coat_optimizer(engine)
        refs = _reference_steps(opt)
        losses = _train(engine, data, range(3), [rank])
        parts = [t for t, _ in local_partitions(engine)]
        ckpt = os.path.join(out, f"ckpt_master{stage}")
        engine.save_checkpoint(ckpt, tag="mid")
        saved, masters = _snapshot(opt), [opt.fp32_master(t).clone() for t in parts]
        rounded = [(((_bits(m).long() & 0xFFFFFFFF) + 0x8000) >> 16).to(torch.int32) for m in masters]
        r = {"dtypes": sorted({str(t.dtype) for t in parts}), "n_refs": len(refs), "n_parts": len(parts),
             "masters_equal": [torch.equal(_bits(opt.fp32_master(p)), _bits(ref.detach()))
                               for p, ref, _ in refs.values()],
             "bf16_is_master_rounded": [torch.equal(t.view(torch.int16).int() & 0xFFFF, h)
                                        for t, h in zip(parts, rounded)],
             "remainders": sorted({str(s["master_remainder"].dtype) for s in opt.state.values()})}
        losses += _train(engine, data, range(3, 5), [rank])
        resumed = _engine(stage, master_weights="bf16+16")
        resumed.load_checkpoint(ckpt, tag="mid")
        r["resume_state_equal"] = _same_state(saved, coat_optimizer(resumed))
        r["resumed_losses_equal"] = _train(resumed, data, range(3, 5), [rank]) == losses[3:]
        consolidated = consolidate_checkpoint(ckpt, "mid")
        for form in ("fp32", "bf16+16"):
            other = _engine(stage, master_weights=form)
            load_fp32_checkpoint(other, consolidated)
            got = [coat_optimizer(other).fp32_master(t) for t, _ in local_partitions(other)]
            r[f"consolidated_into_{form}"] = [torch.equal(_bits(a), _bits(b)) for a, b in zip(got, masters)]
        result[stage] = r
    with open(os.path.join(out, f"master_rank{torch.distributed.get_rank()}.json"), "w") as f:
        json.dump(result, f)


# -- pytest side ------------------------------------------------------------------------------

def _launch(nproc: int, scenario: str, stage: int, out) -> None:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(free_port()), __file__, scenario, str(stage), str(out)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero")
    results = {}

    def get(stage: int) -> list[dict]:
        if stage not in results:
            _launch(2, "zero", stage, out)
            results[stage] = [json.load(open(out / f"zero{stage}_rank{r}.json")) for r in range(2)]
        return results[stage]

    get.out = out
    return get


def _check_training(ranks: list[dict]) -> None:
    for r in ranks:
        assert r["world"] == 2
        losses = r["losses"]
        assert all(map(lambda x: x == x, losses))
        assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.1, losses
        # Every state entry belongs to a tensor this rank's optimizer was handed, stepped
        # once per iteration, FP8 codes in uint8 with int8/uint8/f32 scale metadata.
        assert r["state_keys_are_parts"]
        assert r["steps"] == [float(STEPS)] * len(r["steps"])
        for d in r["dtypes"]:
            assert d["exp_avg_codes"] == "torch.uint8" and d["exp_avg_sq_sexp"] == "torch.int8"
            assert d["exp_avg_kcode"] == "torch.uint8" and d["exp_avg_center"] == "torch.float32"
        for n, codes, center in zip(r["part_numels"], r["codes_shapes"], r["center_shapes"]):
            assert codes == [n] and center == [1, -(-n // 128)]
        # Memory: what the start-up report predicted is what the state took.
        assert r["state_bytes"]["numel"] == sum(r["part_numels"]) == r["reported_numel"]
        assert r["state_bytes"]["state_bytes"] == r["reported_bytes"]
        assert r["state_bytes"]["bytes_per_param"] < 2.2
        # Resume from the checkpoint: bit-identical state, then bit-identical losses.
        assert r["resume_client_step"] == SAVE_AT
        assert r["resume_state_equal"]
        assert r["resumed_losses"] == losses[SAVE_AT:]
    assert ranks[0]["losses"] == ranks[1]["losses"]  # all-reduced, so identical


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_flat_partition(runs, stage):
    ranks = runs(stage)
    _check_training(ranks)
    total = ranks[0]["model_numel"]
    for r in ranks:
        # ONE flat partition per param group, about half the model, never all of it.
        assert len(r["part_numels"]) == 1 and r["n_state_entries"] == 1
        assert total / 2 <= r["part_numels"][0] < total / 2 + 4
    # The partitions tile the model; padding (< 2 x world size) sits on the last rank.
    assert 0 <= sum(r["part_numels"][0] for r in ranks) - total < 4


@pytest.mark.slow
def test_zero3_sub_groups(runs):
    ranks = runs(3)
    _check_training(ranks)
    # Each parameter is split across the 2 ranks, padded to a multiple of 2 on its own.
    padded = sum(-(-n // 2) for n in ranks[0]["param_numels"])
    for r in ranks:
        assert len(r["part_numels"]) > 1  # several sub-groups, each with its own state and step
        assert r["n_state_entries"] == len(r["part_numels"])
        assert sum(r["part_numels"]) == padded


@pytest.mark.slow
def test_zero2_offload_steps_on_host(runs):
    for r in runs(2):
        assert r["offload_n_state"] == 1
        assert r["offload_state_devices"] == ["cpu"]
        assert all(x == x for x in r["offload_losses"])


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_resume_two_ranks_on_one(runs, stage):
    two = runs(stage)
    _launch(1, "reshard", stage, runs.out)
    one = json.load(open(runs.out / f"reshard_zero{stage}.json"))
    assert one["client_step"] == SAVE_AT and one["global_steps"] == SAVE_AT
    assert one["same_names"] and one["params_equal"]
    # Moments were re-quantized with new group boundaries: close, not bit-equal.
    assert one["moment_rel_err"]["exp_avg"] < 0.05 and one["moment_rel_err"]["exp_avg_sq"] < 0.05, one
    assert one["steps"] == [float(SAVE_AT)] * len(one["steps"])
    # Same global batch (2 micro-steps on 1 rank = 2 ranks x 1): the losses follow the
    # uninterrupted 2-rank run up to BF16 summation order.
    expected = two[0]["losses"][SAVE_AT:]
    assert len(one["losses"]) == len(expected)
    for got, want in zip(one["losses"], expected):
        assert abs(got - want) < 0.02 * abs(want), (one["losses"], expected)


@pytest.mark.slow
def test_zero2_without_deepspeeds_overflow_check_coat_skips_the_whole_step(runs):
    """ZeRO-2 by default: DeepSpeed's overflow check off, CoatAdamW skips a step whose global
    gradient norm is not finite on every rank, leaving the same parameters and moments as DeepSpeed's
    own skip (up to the bias corrections' float32 rounding), where without that skip each
    rank would step on the finite part it holds."""
    runs(2)
    for rank in range(2):
        r = json.load(open(runs.out / f"overflow_rank{rank}.json"))
        assert not r["checked_gated"] and r["on_device_gated"]
        # DeepSpeed's own initialize (Trainer's, Accelerate's): no skip until the first step's hook.
        assert not r["registered_gated"] and r["registered"]["gated_after"]
        assert r["registered"]["losses"] == r["on_device"]["losses"]
        assert r["registered"]["nonfinite_groups"] == r["on_device"]["nonfinite_groups"]
        checked, on_device = r["checked"], r["on_device"]
        assert checked["skipped_steps"] == 1 and checked["nonfinite_groups"] == 0
        # DeepSpeed no longer knows of the skip; CoatAdamW counts every group of this rank once.
        assert on_device["skipped_steps"] == 0 and on_device["nonfinite_groups"] == on_device["groups"]
        assert all(map(math.isfinite, on_device["losses"])), on_device["losses"]
        for got, want in zip(on_device["losses"], checked["losses"]):
            assert abs(got - want) <= 1e-3 * abs(want), (on_device["losses"], checked["losses"])
        a, b, c, d = (torch.load(runs.out / f"overflow_{n}_rank{rank}.pt")
                      for n in ("checked", "on_device", "ungated", "registered"))
        assert torch.equal(d["param"], b["param"])
        assert all(torch.equal(d["state"][k], v) for k, v in b["state"].items())
        torch.testing.assert_close(b["param"], a["param"], rtol=1e-5, atol=1e-6)
        # The skipped step is counted in CoatAdamW's step and in each group's skips, which
        # its bias correction subtracts, not in DeepSpeed.
        assert float(b["state"].pop("step")) == float(a["state"].pop("step")) + 1
        assert torch.equal(b["state"].pop("group_skips"), a["state"].pop("group_skips") + 1)
        for key, want in a["state"].items():
            got = b["state"][key]
            if torch.is_floating_point(want):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
            else:  # FP8 codes: a rounding apart at most
                assert (got.int() - want.int()).abs().max() <= 1, key
        # Without the whole-step skip the ranks step on zero (clipped by an infinite norm) or
        # partly non-finite gradients: their parameters leave DeepSpeed's.
        assert (c["param"] - a["param"]).abs().max() > 1e-4


@pytest.mark.slow
def test_zero23_bf16_master_weights_keep_the_fp32_master(tmp_path):
    """DeepSpeed's bf16_master_weights_and_grads hands CoatAdamW BF16 flat partitions (set by
    coat_ds for master_weights "bf16+16"): every partition's FP32 master is, bit for bit, an
    FP32-master CoatAdamW's stepped on the same gradients; DeepSpeed's own checkpoint resumes
    bit-exactly; the converting path (consolidate, load_fp32_checkpoint) carries the exact
    master into an FP32-master engine and back into a "bf16+16" one."""
    _launch(2, "master", 0, tmp_path)
    for rank in range(2):
        result = json.load(open(tmp_path / f"master_rank{rank}.json"))
        for stage, r in result.items():
            assert r["dtypes"] == ["torch.bfloat16"] and r["remainders"] == ["torch.int16"], (stage, r)
            assert r["n_refs"] == r["n_parts"] and all(r["masters_equal"]), (stage, r)
            assert all(r["bf16_is_master_rounded"]), (stage, r)
            assert r["resume_state_equal"] and r["resumed_losses_equal"], (stage, r)
            assert all(r["consolidated_into_fp32"]) and all(r["consolidated_into_bf16+16"]), (stage, r)


@pytest.mark.slow
def test_offline_converter_cli(runs, tmp_path):
    from coat_ds.integrations.deepspeed.checkpoint import FORMAT, main

    ranks = runs(2)
    out = tmp_path / "fp32.pt"
    main([str(runs.out / "ckpt_zero2"), str(out), "--tag", "mid"])
    ckpt = torch.load(out, weights_only=False)
    assert ckpt["format"] == FORMAT and ckpt["world_size"] == 2 and ckpt["step"] == SAVE_AT
    assert sum(t.numel() for t in ckpt["params"].values()) == ranks[0]["model_numel"]
    for name, p in ckpt["params"].items():
        assert ckpt["exp_avg"][name].shape == p.shape == ckpt["exp_avg_sq"][name].shape
        assert ckpt["exp_avg_sq"][name].dtype == torch.float32 and (ckpt["exp_avg_sq"][name] >= 0).all()
    assert ckpt["client_state"]["step"] == SAVE_AT and ckpt["engine"]["global_steps"] == SAVE_AT


if __name__ == "__main__":
    scenario, stage, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    {"zero": worker_zero, "reshard": worker_reshard, "master": worker_master}[scenario](stage, out)
    end_worker()
