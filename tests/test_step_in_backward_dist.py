"""CoatAdamW(step_in_backward=True) on 2 gloo ranks: FSDP2 (the hook fires on the sharded
DTensor after reduce-scatter) equals the normal step bit for bit, clips with the global norm,
resumes from a DCP checkpoint bit for bit; DDP steps each reduced bucket through a comm hook
(register_ddp), and without it DDP's plain tensors are refused."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import coat_ds
from coat_ds.integrations.fsdp import clip_grad_norm_, load_checkpoint, save_checkpoint, setup_fsdp
from helpers import end_worker
from test_fsdp import LR, MIN_QUANT, Net, _assert_bitwise, _batch, _full_params, _init, _spawn

pytestmark = pytest.mark.slow


def _optim(params, in_backward: bool, clip=None):
    return coat_ds.CoatAdamW(params, lr=LR, min_quant_numel=MIN_QUANT, step_in_backward=in_backward,
                             max_grad_norm=clip)


def _train(model, optim, steps, rank, world, clip_by_hand=None) -> list[float]:
    """Train `steps`; `clip_by_hand`: clip_grad_norm_ to it, then round the gradients to BF16
    as CoatAdamW(max_grad_norm=...) holds them."""
    norms = []
    for s in steps:
        x, y = _batch(s)
        ((model(x.chunk(world)[rank]) - y.chunk(world)[rank]) ** 2).mean().backward()
        if clip_by_hand is not None:
            norms.append(clip_grad_norm_(model, clip_by_hand))
            for p in model.parameters():
                p.grad = p.grad.bfloat16().float()
        optim.step()
        if optim.step_in_backward and optim.last_grad_norm() is not None:
            norms.append(float(optim.last_grad_norm()))
        optim.zero_grad()
    return norms


def _equal_worker(rank, world, init, out):
    _init(rank, world, init)
    runs = {}
    for in_backward in (False, True):
        torch.manual_seed(0)
        model = setup_fsdp(Net(300), mode="fsdp2")
        optim = _optim(model.parameters(), in_backward)
        _train(model, optim, range(4), rank, world)
        if in_backward:
            assert all(p.grad is None for p in model.parameters())
        runs[in_backward] = _full_params(model)
    torch.manual_seed(0)
    model = setup_fsdp(Net(300), mode="fsdp2")
    norms_ref = _train(model, _optim(model.parameters(), False), range(3), rank, world, clip_by_hand=1e9)
    runs["clip_ref"] = _full_params(model)
    torch.manual_seed(0)
    model = setup_fsdp(Net(300), mode="fsdp2")
    norms = _train(model, _optim(model.parameters(), True, clip=1e9), range(3), rank, world)
    runs["clip"] = _full_params(model)
    if rank == 0:
        torch.save({"runs": runs, "norms": (norms_ref, norms)}, out)
    end_worker()


def test_fsdp2_equals_step_and_measures_the_global_norm(tmp_path):
    out = tmp_path / "eq.pt"
    _spawn(_equal_worker, 2, tmp_path, str(out))
    got = torch.load(out)
    for k, v in got["runs"][False].items():
        _assert_bitwise(got["runs"][True][k], v, k)
    for k, v in got["runs"]["clip_ref"].items():  # clip_grad_norm_ on BF16-rounded gradients
        _assert_bitwise(got["runs"]["clip"][k], v, k)
    ref, norms = got["norms"]
    assert norms == pytest.approx(ref, rel=1e-5)


def _resume_worker(rank, world, init, ckpt, out):
    _init(rank, world, init)
    torch.manual_seed(0)
    model = setup_fsdp(Net(300), mode="fsdp2")
    optim = _optim(model.parameters(), True, clip=0.5)
    _train(model, optim, range(3), rank, world)
    save_checkpoint(ckpt, model, optim, step=3)
    _train(model, optim, range(3, 6), rank, world)
    straight = _full_params(model)
    torch.manual_seed(1)
    model2 = setup_fsdp(Net(300), mode="fsdp2")
    optim2 = _optim(model2.parameters(), True, clip=0.5)
    assert load_checkpoint(ckpt, model2, optim2) == 3
    _train(model2, optim2, range(3, 6), rank, world)
    resumed = _full_params(model2)
    if rank == 0:
        torch.save({"straight": straight, "resumed": resumed}, out)
    end_worker()


def test_fsdp2_dcp_resume_continues_bitwise(tmp_path):
    out = tmp_path / "resume.pt"
    _spawn(_resume_worker, 2, tmp_path, str(tmp_path / "ckpt"), str(out))
    got = torch.load(out)
    for k, v in got["straight"].items():
        _assert_bitwise(got["resumed"][k], v, k)


def _ddp_worker(rank, world, init, out):
    _init(rank, world, init)
    torch.manual_seed(0)
    model = DDP(Net(300))
    _optim(model.parameters(), True)  # its hooks keep it alive
    before = [p.detach().clone() for p in model.parameters()]
    x, y = _batch(0)
    try:
        ((model(x.chunk(world)[rank]) - y.chunk(world)[rank]) ** 2).mean().backward()
        message = ""
    except RuntimeError as e:
        message = str(e)
    unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    if rank == 0:
        torch.save({"message": message, "unchanged": unchanged}, out)
    dist.barrier()
    end_worker()


def test_plain_tensors_in_a_multi_rank_world_are_refused_before_any_update(tmp_path):
    out = tmp_path / "ddp.pt"
    _spawn(_ddp_worker, 2, tmp_path, str(out))
    got = torch.load(out)
    assert "plain tensor gradient in a world of 2 ranks" in got["message"] and "register_ddp" in got["message"]
    assert got["unchanged"]


def _ddp_equal_worker(rank, world, init, out):
    _init(rank, world, init)
    runs, norms = {}, {}
    for mode in ("step", "in_backward", "clipped", "step_accumulated", "accumulated"):
        torch.manual_seed(0)
        model = DDP(Net(300), bucket_cap_mb=0.05)  # several buckets
        optim = _optim(model.parameters(), not mode.startswith("step"), clip=1e9 if mode == "clipped" else None)
        if not mode.startswith("step"):
            optim.register_ddp(model)
        got = []
        for s in range(4):
            x, y = _batch(s)
            if mode.endswith("accumulated"):  # the first half without DDP's all-reduce, nor a step
                with model.no_sync(), optim.accumulating():
                    ((model(x[:4].chunk(world)[rank]) - y[:4].chunk(world)[rank]) ** 2).mean().backward()
                x, y = x[4:], y[4:]
            ((model(x.chunk(world)[rank]) - y.chunk(world)[rank]) ** 2).mean().backward()
            if mode.startswith("step"):
                got.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)))
            elif mode in ("in_backward", "accumulated"):  # stepped in backward, by the comm hook
                assert len(optim.state) == len(list(model.parameters()))
                assert all(float(st["step"]) == s + 1 for st in optim.state.values())
            else:  # clipped: DDP's reduced gradients wait for step()
                assert all(p.grad is not None for p in model.parameters())
                assert all(float(st["step"]) == s for st in optim.state.values())
            optim.step()
            if mode == "clipped":
                got.append(float(optim.last_grad_norm()))
            if not mode.startswith("step"):
                assert all(p.grad is None for p in model.parameters())
            optim.zero_grad()
        runs[mode] = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
        norms[mode] = got
    if rank == 0:
        torch.save({"runs": runs, "norms": norms}, out)
    end_worker()


def test_ddp_register_ddp_equals_step(tmp_path):
    """Through DDP's comm hook each all-reduced bucket is stepped in backward: the same
    parameters as DDP + step(), bit for bit. With clipping DDP's reduced gradients (which it
    keeps anyway) wait for step(): the same parameters again, and the same global norm. With
    accumulation (no_sync and accumulating() for the first micro-batch) the last one's buckets
    step, as DDP + step() would."""
    out = tmp_path / "ddp_eq.pt"
    _spawn(_ddp_equal_worker, 2, tmp_path, str(out))
    got = torch.load(out)
    for mode, ref in (("in_backward", "step"), ("clipped", "step"), ("accumulated", "step_accumulated")):
        for k, v in got["runs"][ref].items():
            _assert_bitwise(got["runs"][mode][k], v, (mode, k))
    assert got["norms"]["clipped"] == pytest.approx(got["norms"]["step"], rel=1e-5)
