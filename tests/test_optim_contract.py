"""CoatAdamW keeps torch.optim's contract: migration from torch AdamW, copies and pickles,
checked and hooked loading, non-finite handling, tensor lr, FP32-only parameters."""
import copy
import io
import json
import os
import pickle
import sys
import warnings

import pytest
import torch

from coat_ds import CoatAdamW
from coat_ds.optim import nonfinite
from helpers import ROOT, read_metrics, run_in_repo


def _model(seed=0, device="cpu"):
    torch.manual_seed(seed)
    return torch.nn.Linear(128, 64).to(device)  # weight (8192) in FP8, bias (64) in FP32


def _grads(model, seed, bad=None):
    """Fresh gradients, written into the existing gradient buffers (as DDP/ZeRO keep them)."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        new = torch.randn(p.shape, generator=g).to(p.device) * 1e-2
        if p.grad is None:
            p.grad = new
        else:
            p.grad.copy_(new)
    if bad is not None:
        model.weight.grad[3, 5] = bad


def _stepped(opt_cls=CoatAdamW, steps=3, seed=0, device="cpu", **kw):
    model = _model(seed, device)
    opt = opt_cls(model.parameters(), lr=1e-2, **kw)
    for s in range(steps):
        _grads(model, s)
        opt.step()
    return model, opt


def _snapshot(model, opt):
    sd = opt.state_dict()
    return ([p.detach().clone() for p in model.parameters()],
            {pid: {k: v.clone() for k, v in st.items()} for pid, st in sd["state"].items()},
            copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]))


def _assert_same(a, b):
    for x, y in zip(a[0], b[0]):
        assert torch.equal(x, y)
    assert a[1].keys() == b[1].keys()
    for pid in a[1]:
        assert a[1][pid].keys() == b[1][pid].keys()
        for k in a[1][pid]:
            assert a[1][pid][k].dtype == b[1][pid][k].dtype and torch.equal(a[1][pid][k], b[1][pid][k]), (pid, k)
    assert a[2] == b[2]


def test_torch_adamw_state_dict_loads_both_ways_and_old_checkpoints_keep_loading():
    model, torch_opt = _stepped(torch.optim.AdamW)
    sd = torch_opt.state_dict()
    for load in ("load_state_dict", "load_fp32_state_dict"):
        coat = CoatAdamW(model.parameters(), group_size=64)
        getattr(coat, load)(copy.deepcopy(sd))
        group = coat.param_groups[0]
        assert group["group_size"] == 64 and group["lr"] == 1e-2  # own option kept, saved lr taken
        state = coat.state[model.weight]
        assert state["exp_avg_codes"].dtype == torch.uint8 and state["step"].item() == 3
        fp32 = coat.fp32_state_dict()["state"][0]
        for key in ("exp_avg", "exp_avg_sq"):
            ref = sd["state"][0][key]
            assert ((fp32[key] - ref).norm() / ref.norm()).item() < 0.05, (load, key)
        _grads(model, 9)
        coat.step()
        assert torch.isfinite(model.weight).all() and coat.state[model.weight]["step"].item() == 4

    # CoatAdamW -> torch.optim.AdamW through the FP32 layout, and through its own state dict.
    back = torch.optim.AdamW(model.parameters())
    back.load_state_dict(coat.fp32_state_dict())
    back.step()
    # A checkpoint of an older CoatAdamW, without options added since, still loads.
    old = coat.state_dict()
    for g in old["param_groups"]:
        for key in ("nonfinite", "backend", "min_quant_numel"):
            del g[key]
    fresh = CoatAdamW(model.parameters(), nonfinite="raise")
    fresh.load_state_dict(old)
    assert fresh.param_groups[0]["nonfinite"] == "raise" and fresh.param_groups[0]["group_size"] == 64
    fresh.step()


def test_torch_adamw_options_it_cannot_honour_are_refused():
    model = _model()
    sd = torch.optim.AdamW(model.parameters(), amsgrad=True).state_dict()
    with pytest.raises(ValueError, match="amsgrad"):
        CoatAdamW(model.parameters()).load_state_dict(sd)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copies_step_like_the_original(how):
    model, opt = _stepped()
    if how == "deepcopy":
        other = copy.deepcopy(opt)
    elif how == "pickle":
        other = pickle.loads(pickle.dumps(opt))
    else:
        buf = io.BytesIO()
        torch.save(opt, buf)
        buf.seek(0)
        other = torch.load(buf, weights_only=False)
    params = other.param_groups[0]["params"]
    for p, q in zip(model.parameters(), params):
        q.grad = p.grad.clone()
    opt.step()
    other.step()
    for p, q in zip(model.parameters(), params):
        assert torch.equal(p, q)


def _corrupt(sd, how):
    w, b = sd["state"][0], sd["state"][1]
    if how == "codes_as_float":
        w["exp_avg_codes"] = w["exp_avg_codes"].float()
    elif how == "relabelled_format":
        sd["param_groups"][0]["first_moment_format"] = "e5m2"
    elif how == "zero_center":
        w["exp_avg_sq_center"][0, 0] = 0.0
    elif how == "nan_center":
        w["exp_avg_center"][1, 0] = float("nan")
    elif how == "kcode_zero":
        w["exp_avg_kcode"][0, 0] = 0
    elif how == "sexp_out_of_range":
        w["exp_avg_sexp"][0, 0] = -128
    elif how == "missing_key":
        del w["exp_avg_sq_sexp"]
    elif how == "wrong_shape":
        w["exp_avg_codes"] = w["exp_avg_codes"][:, :100].contiguous()
    elif how == "nan_step":
        w["step"] = torch.tensor(float("nan"))
    elif how == "negative_fp32_moment":
        b["exp_avg_sq"][0] = -1.0
    return {"relabelled_format": "exp_avg_codes", "codes_as_float": "exp_avg_codes", "zero_center": "exp_avg_sq_center",
            "nan_center": "exp_avg_center", "kcode_zero": "exp_avg_kcode", "sexp_out_of_range": "exp_avg_sexp",
            "missing_key": "exp_avg_sq_sexp", "wrong_shape": "exp_avg_codes", "nan_step": "step",
            "negative_fp32_moment": "exp_avg_sq"}[how], 1 if how == "negative_fp32_moment" else 0


@pytest.mark.parametrize("how", ["codes_as_float", "relabelled_format", "zero_center", "nan_center", "kcode_zero",
                                 "sexp_out_of_range", "missing_key", "wrong_shape", "nan_step",
                                 "negative_fp32_moment"])
def test_bad_state_dict_is_refused_and_the_optimizer_left_as_it_was(how):
    model, opt = _stepped()
    bad = copy.deepcopy(opt.state_dict())
    key, pid = _corrupt(bad, how)
    other_model, other = _stepped(seed=1)
    before = _snapshot(other_model, other)
    with pytest.raises(ValueError, match=rf"parameter {pid}, key '{key}'"):
        other.load_state_dict(bad)
    _assert_same(before, _snapshot(other_model, other))
    _grads(other_model, 5)
    other.step()  # still steps


def test_load_hooks_see_and_edit_the_state():
    model, opt = _stepped()
    sd = opt.state_dict()
    fresh = CoatAdamW(model.parameters())
    seen = []

    def pre(optimizer, state_dict):
        state_dict["state"][0]["step"] = torch.tensor(42.0)

    fresh.register_load_state_dict_pre_hook(pre)
    fresh.register_load_state_dict_post_hook(lambda o: seen.append(o.state[model.weight]["step"].item()))
    fresh.load_state_dict(sd)
    assert seen == [42.0] and fresh.state[model.weight]["step"].item() == 42.0


def test_nonfinite_raise_checks_first_and_recovers():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(128, 64, bias=False), torch.nn.Linear(128, 64, bias=False)
    empty = torch.nn.Parameter(torch.zeros(0, 4))  # an FSDP2 rank's empty shard
    empty.grad = torch.zeros(0, 4)
    opt = CoatAdamW([{"params": [*a.parameters(), empty]}, {"params": b.parameters()}], nonfinite="raise")
    for m in (a, b):
        _grads(m, 0)
    opt.step()
    before = [p.detach().clone() for p in (a.weight, b.weight)]
    state_before = copy.deepcopy(opt.state_dict()["state"])
    b.weight.grad[0, 0] = float("inf")
    with pytest.raises(FloatingPointError, match="parameter 0 of param group 1"):
        opt.step()
    assert torch.equal(a.weight, before[0]) and torch.equal(b.weight, before[1])
    for pid, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            assert torch.equal(v, state_before[pid][k]), (pid, k)
    _grads(b, 1)
    opt.step()  # a clean step after a refused one goes through
    assert not torch.equal(a.weight, before[0]) and not torch.equal(b.weight, before[1])


def test_skipped_groups_warn_rate_limited_with_counts(monkeypatch):
    model, opt = _stepped()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _grads(model, 3, bad=float("nan"))
        opt.step()
        _grads(model, 4, bad=float("nan"))
        opt.step()  # within the interval: counted, not reported
        monkeypatch.setattr(nonfinite, "WARN_INTERVAL_S", 0.0)
        _grads(model, 5)
        opt.step()  # a clean step reports what was skipped since the last warning
        _grads(model, 6)
        opt.step()
    msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 2, msgs
    assert "skipped 1 group(s)" in msgs[0] and "(1 in all)" in msgs[0]
    assert "skipped 1 group(s)" in msgs[1] and "(2 in all)" in msgs[1]
    assert opt.nonfinite_groups() == 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_parameters_are_refused(dtype):
    model = _model().to(dtype)
    opt = CoatAdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    before = model.weight.detach().clone()
    with pytest.raises(ValueError, match=f"float32 parameters.*{dtype}"):
        opt.step()
    assert torch.equal(model.weight, before) and not opt.state


def test_fp32_parameters_take_bf16_gradients():
    model = _model()
    for p in model.parameters():
        p.grad_dtype = torch.bfloat16
    opt = CoatAdamW(model.parameters(), lr=1e-2)
    for s in range(2):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, dtype=torch.bfloat16)
        opt.step()
    assert model.weight.dtype == torch.float32 and torch.isfinite(model.weight).all()


def test_tensor_lr_matches_float_lr_and_follows_a_scheduler():
    a, opt_a = _stepped(steps=2)
    model = _model()
    opt = CoatAdamW(model.parameters(), lr=torch.tensor(1e-2))
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    for s in range(2):
        _grads(model, s)
        opt.step()
        if s == 0:
            assert torch.equal(model.weight, _stepped(steps=1)[0].weight)
        sched.step()
    assert opt.param_groups[0]["lr"].item() == pytest.approx(2.5e-3)
    assert not torch.equal(model.weight, a.weight)  # the second step ran at half the rate
    with pytest.raises(ValueError, match="lr"):
        CoatAdamW(model.parameters(), lr=torch.tensor([1e-3, 1e-3]))


def test_state_storage_swapped_in_place_is_what_the_kernel_writes(device):
    """DeepSpeed's offload_states / reload_adam_states give state tensors new storage with
    `.data =` while tensors, parameters and gradient buffers stay: the Triton step must
    write the new storage (it wrote the old one: a use after free on a GPU)."""
    runs = []
    for swap in (False, True):
        model, opt = _stepped(steps=1, device=device, backend="triton")
        if swap:
            for state in opt.state.values():
                for key, t in state.items():
                    if key != "step":
                        t.data = t.data.clone()
        for s in (1, 2):
            _grads(model, s)
            opt.step()
        runs.append((model, opt))
    (a, opt_a), (b, opt_b) = runs
    assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)
    for p, q in zip(a.parameters(), b.parameters()):
        for key, t in opt_a.state[p].items():
            assert torch.equal(t, opt_b.state[q][key]), key


@pytest.mark.slow
def test_train_py_step_log_reports_skipped_groups(tmp_path):
    """A learning rate of 1e30 makes the second step's gradients non-finite: the step log
    line and the metrics name how many groups CoatAdamW skipped (summed over ranks)."""
    with open(os.path.join(ROOT, "ds_configs", "coat_zero2.json")) as f:
        ds = json.load(f)
    ds["optimizer"]["params"]["lr"] = 1e30
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    out = run_in_repo([sys.executable, "train.py", "--fsdp", "--config", "configs/tiny.yaml", "--deepspeed",
                       str(tmp_path / "ds.json"), "--max-steps", "2", "--log-interval", "1", "--eval-interval", "0",
                       "--eval-batches", "1", "--metrics-file", str(tmp_path / "m.jsonl")], 300).stdout
    metrics = read_metrics(tmp_path / "m.jsonl")
    assert "non-finite groups skipped 0" in out and metrics[1]["nonfinite_groups_skipped"] == 0
    skipped = metrics[2]["nonfinite_groups_skipped"]
    assert skipped > 0 and f"non-finite groups skipped {skipped}" in out
