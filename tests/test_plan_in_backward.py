"""The profiler and the planner with CoatAdamW(step_in_backward=True), on CPU: gradients
gone after backward in the profiler's breakdown; the planner's fixed part without them, so
a budget that gradients limit gets a larger micro-batch; gradient accumulation keeps them."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import coat_ds
from coat_ds.memory import unique_storage_bytes
from coat_ds.models.llama import Llama, model_config
from coat_ds.optim import in_backward
from coat_ds.plan import CostModel, MeasureConfig, Measurements, measure_choices, measure_plan, search_plan
from coat_ds.profile import parse_options, profile
from coat_ds.profile.measure import random_batch
from coat_ds.profile.report import markdown_table
from coat_ds.profile.run import combine, resolve_model
from coat_ds.profile.trainee import build_trainee, load_side

PROFILE_ARGS = ["--model", "tiny", "--seq-len", "16", "--budget-gb", "0.05", "--side", "coat",
                "--max-batch", "64", "--throughput-steps", "0"]
# Small enough that the bucket is stepped several times in one backward of the model below.
BUCKET = 1 << 12


pytestmark = pytest.mark.usefixtures("one_thread")


def _coat_side(tmp_path, *extra: str) -> tuple[dict, dict]:
    result = profile(parse_options([*PROFILE_ARGS, "--out", str(tmp_path), *extra]))
    return result, result["sides"]["coat"]


def test_profiler_breakdown_shows_the_gradients_gone(tmp_path):
    _, off = _coat_side(tmp_path / "off")
    meta, on = _coat_side(tmp_path / "on", "--step-in-backward")
    r_off, r_on = off["ranks"][0], on["ranks"][0]
    assert on["step_in_backward"] and not off["step_in_backward"]
    assert r_off["gradients_bytes"] > 0 and r_on["gradients_bytes"] == 0
    assert r_on["optimizer_state_bytes"] == r_off["optimizer_state_bytes"] > 0
    # The bucket (64M elements) is larger than the model: during backward it may hold every
    # FP32 gradient, which the sum of components counts.
    _, mcfg, _ = resolve_model("tiny", 16)
    assert r_on["in_backward_gradient_bytes"] == 4 * mcfg.num_params() and r_off["in_backward_gradient_bytes"] == 0
    assert r_on["fixed_bytes"] == r_on["weights_bytes"] + r_on["in_backward_gradient_bytes"] + \
        r_on["optimizer_state_bytes"]
    meta = {k: v for k, v in meta.items() if k != "sides"}
    table = markdown_table(combine(meta, {"baseline": off, "coat": on}))
    row = next(line for line in table.splitlines() if line.startswith("| coat, steps in backward | 0 |"))
    assert row.split("|")[4].strip() == "0.000"  # the gradients column
    assert "coat: gradients are stepped in backward" in table

    # What the breakdown reports is the storage really held after a backward of each trainee.
    for step_in_backward, reported in ((False, r_off["gradients_bytes"]), (True, 0)):
        side = load_side("coat", "ds_configs/coat_zero2.json", step_in_backward=step_in_backward)
        trainee = build_trainee("none", side, mcfg, torch.device("cpu"), 0)
        x, y = random_batch(2, 16, 256, trainee.device, 0)
        trainee.backward(trainee.forward(x, y))
        assert unique_storage_bytes(trainee.grad_tensors()) == reported
        assert step_in_backward == all(p.grad is None for p in trainee.model.parameters())
        trainee.step()
        trainee.close()


def test_profiler_option_errors(capsys):
    with pytest.raises(SystemExit):
        parse_options(["--model", "tiny", "--budget-gb", "1", "--engine", "deepspeed", "--step-in-backward"])
    assert "--step-in-backward needs --engine none or fsdp" in capsys.readouterr().err
    from coat_ds.profile.options import child_argv

    opts = parse_options(["--model", "tiny", "--budget-gb", "1", "--step-in-backward"])
    assert parse_options(child_argv(opts, "coat", "out")) == dataclasses.replace(opts, side="coat", out="out")


def _model() -> Llama:
    torch.manual_seed(0)
    return Llama(model_config("tiny", n_layers=4, max_seq_len=8))


def _optimizer(step_in_backward: bool, clip=None):
    return lambda params: coat_ds.CoatAdamW(params, lr=1e-3, step_in_backward=step_in_backward, max_grad_norm=clip)


CONFIG = MeasureConfig(seq_len=4, batches=(1, 2), timed_steps=1, choices=("keep",))


def test_planner_plans_a_larger_micro_batch_where_gradients_were_the_limit(monkeypatch):
    monkeypatch.setattr(in_backward, "BUCKET_NUMEL", BUCKET)
    model = _model()
    params = list(model.parameters())
    m = {sib: measure_choices(model, _optimizer(sib), config=CONFIG) for sib in (False, True)}
    # Gradients are held after backward without the option (every one, measured), none with it.
    assert m[False].grads_bytes == m[False].params_bytes and m[True].grads_bytes == 0
    assert not m[False].step_in_backward and m[True].step_in_backward
    assert m[True].in_backward_grad_bytes == (BUCKET - 1) * 4 + 4 * max(p.numel() for p in params)
    # With clipping the BF16 copies wait for step(): 2 bytes per FP32 parameter more.
    clipped = measure_choices(model, _optimizer(True, clip=1.0), config=CONFIG)
    assert clipped.grads_bytes == 0
    assert clipped.in_backward_grad_bytes == m[True].in_backward_grad_bytes + 2 * sum(p.numel() for p in params)
    assert m[True].optimizer_state_bytes == m[False].optimizer_state_bytes
    assert m[True].fixed_bytes < m[False].fixed_bytes
    # The optimizer's hooks went with it: a plain backward leaves every gradient.
    model(*random_batch(1, 4, 256, torch.device("cpu"), 0)).backward()
    assert all(p.grad is not None for p in params)
    model.zero_grad(set_to_none=True)

    # Memory is what this test is about. The step times measured on a loaded CPU can make a
    # larger micro-batch look slower per token (a negative intercept fitted from two noisy
    # points), so both sides get one step time that grows with the batch, as it does on a GPU.
    costs = {sib: dataclasses.replace(CostModel.from_measurements(m[sib]), base_s=(1.0, 0.01)) for sib in (False, True)}
    budget = costs[False].predict(["keep"] * 4, 2)[0]
    plans = {sib: search_plan(costs[sib], budget, max_batch=64) for sib in (False, True)}
    assert plans[False].micro_batch == 2 and plans[True].micro_batch > plans[False].micro_batch, plans
    # Measured at the larger micro-batch: within the budget with the option, over it without
    # (the gradients were the limit).
    with_opt = measure_plan(model, plans[True], _optimizer(True), config=CONFIG)
    without = measure_plan(model, plans[True], _optimizer(False), config=CONFIG)
    assert with_opt.peak_bytes <= budget < without.peak_bytes


def test_planner_with_gradient_accumulation_keeps_the_gradients(monkeypatch):
    monkeypatch.setattr(in_backward, "BUCKET_NUMEL", BUCKET)
    model = _model()
    acc = dataclasses.replace(CONFIG, grad_accumulation=2)
    held = measure_choices(model, _optimizer(True), config=acc)
    plain = measure_choices(model, _optimizer(False), config=CONFIG)
    assert not held.step_in_backward and held.in_backward_grad_bytes == 0
    assert held.grads_bytes == plain.grads_bytes == held.params_bytes
    assert held.fixed_bytes == plain.fixed_bytes
    budget = CostModel.from_measurements(plain).predict(["keep"] * 4, 2)[0]
    assert search_plan(CostModel.from_measurements(held), budget, max_batch=64).micro_batch == \
        search_plan(CostModel.from_measurements(plain), budget, max_batch=64).micro_batch == 2
    for b in CONFIG.batches:
        assert held.run("keep", b).peak_bytes == pytest.approx(plain.run("keep", b).peak_bytes, rel=0.01)


def test_measurements_from_before_the_option_read_back():
    m = Measurements(("blocks.0",), 4, "cpu", "tracker", 10, 10, 5, (), (10,), True, 7)
    assert Measurements.from_dict(m.to_dict()) == m and m.fixed_bytes == 10 + 10 + 7 + 5
    old = {k: v for k, v in m.to_dict().items() if k not in ("step_in_backward", "in_backward_grad_bytes")}
    back = Measurements.from_dict(old)
    assert not back.step_in_backward and back.fixed_bytes == 25
    with pytest.raises(ValueError, match="grad_accumulation"):
        MeasureConfig(grad_accumulation=0)
