"""CoatAdamW on DTensor parameters in one process (a 1-rank gloo group): the state layout
`state_dict()` hands to DCP, and loading it back, including state saved with other shards."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import coat_ds
from coat_ds.kernels import QuantizedGroups, get

G = 128


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    init = tmp_path_factory.mktemp("pg") / "init"
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def _params(mesh, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = nn.Parameter(distribute_tensor(torch.randn(5, 300, generator=g), mesh, [Shard(0)]))
    b = nn.Parameter(distribute_tensor(torch.randn(300, generator=g), mesh, [Shard(0)]))
    return [w, b]


def _grads(params, step: int):
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = distribute_tensor(torch.randn(p.shape, generator=g), p.device_mesh, p.placements)


def _optim(params):
    return coat_ds.CoatAdamW(params, lr=1e-2, min_quant_numel=256)


def _trained(mesh, steps: int = 3):
    """(sharded parameters, CoatAdamW) after `steps` steps."""
    params = _params(mesh)
    optim = _optim(params)
    for s in range(steps):
        _grads(params, s)
        optim.step()
    return params, optim


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_state_dict_is_dtensors_sharded_like_the_parameter(mesh):
    params, optim = _trained(mesh)
    sd = optim.state_dict()
    w_state, b_state = sd["state"][0], sd["state"][1]
    for state in (w_state, b_state):
        assert not isinstance(state["step"], DTensor)
        for key, v in state.items():
            if key != "step":
                assert isinstance(v, DTensor) and v.placements == params[0].placements, key
    assert w_state["exp_avg_codes"].shape == (5, 300) and w_state["exp_avg_codes"].dtype == torch.uint8
    # 2-D: one metadata row per parameter row, so it shards on dim 0 with the rows.
    assert w_state["exp_avg_sexp"].shape == (5, 3) and w_state["exp_avg_sexp"].dtype == torch.int8
    # 1-D: the metadata is repeated on each element of its group.
    assert b_state["exp_avg_center"].shape == (300,)
    assert torch.equal(b_state["exp_avg_center"].to_local()[:G],
                       optim.state[params[1]]["exp_avg_center"][0, 0].expand(G))
    # The live state stays plain local tensors in the kernels' (rows, groups) layout.
    assert not isinstance(optim.state[params[1]]["exp_avg_center"], DTensor)
    assert optim.state[params[1]]["exp_avg_center"].shape == (1, 3)


def test_load_state_dict_round_trips_bitwise_and_resumes_identically(mesh):
    params, optim = _trained(mesh)
    params2 = [nn.Parameter(distribute_tensor(p.detach().full_tensor().clone(), mesh, [Shard(0)])) for p in params]
    optim2 = _optim(params2)
    optim2.load_state_dict(optim.state_dict())
    for p, p2 in zip(params, params2):
        assert set(optim.state[p]) == set(optim2.state[p2])
        for k, v in optim.state[p].items():
            assert not isinstance(optim2.state[p2][k], DTensor)
            assert _same(optim2.state[p2][k], v), k
    for s in range(3, 5):
        for ps in (params, params2):
            _grads(ps, s)
        optim.step()
        optim2.step()
    for p, p2 in zip(params, params2):
        assert torch.equal(p.to_local(), p2.to_local())


def _per_element(qg: QuantizedGroups, n: int) -> dict:
    """A shard's (1, groups) metadata repeated onto its n elements, as a checkpoint holds it."""
    return {part: getattr(qg, part).repeat_interleave(G, dim=1)[:, :n].reshape(n)
            for part in ("center", "kcode", "sexp")}


def _saved_state(values: dict[str, torch.Tensor], cuts: list[int], mesh) -> dict:
    """State of a 300-element vector quantized as shards starting at `cuts` (what ranks of
    another world size saved), in the per-element checkpoint layout."""
    codec = get("group_codec", torch.device("cpu"), "torch")
    state = {"step": torch.tensor(3.0)}
    for name, x in values.items():
        parts = {"codes": [], "center": [], "kcode": [], "sexp": []}
        for lo, hi in zip(cuts, cuts[1:] + [x.numel()]):
            qg = codec.quantize(x[lo:hi], G, "e4m3", True)
            parts["codes"].append(qg.codes)
            for k, v in _per_element(qg, hi - lo).items():
                parts[k].append(v)
        for k, v in parts.items():
            state[f"{name}_{k}"] = distribute_tensor(torch.cat(v), mesh, [Shard(0)])
    return state


def _decode(state: dict, name: str) -> torch.Tensor:
    qg = QuantizedGroups(*(state[f"{name}_{k}"].full_tensor().reshape(1, -1)
                           for k in ("codes", "center", "kcode", "sexp")))
    return get("group_codec", torch.device("cpu"), "torch").dequantize(qg, 1, "e4m3").reshape(-1)


@pytest.mark.parametrize("cuts", [[0], [0, 150], [0, 100, 200]])
def test_1d_state_saved_on_other_shards_loads(mesh, cuts):
    """Same grouping: restored bit-exactly. Other shard boundaries (2 or 3 ranks saved it):
    groups that now mix two saved groups are decoded and quantized again, within one FP8
    rounding; groups that do not are restored bit-exactly."""
    g = torch.Generator().manual_seed(7)
    values = {"exp_avg": torch.randn(300, generator=g) * 1e-3, "exp_avg_sq": torch.rand(300, generator=g) * 1e-6}
    saved = _saved_state(values, cuts, mesh)
    b = nn.Parameter(distribute_tensor(torch.randn(300), mesh, [Shard(0)]))
    optim = _optim([b])
    optim.load_state_dict({"state": {0: saved}, "param_groups": optim.state_dict()["param_groups"]})
    state = optim.state[b]
    assert state["exp_avg_codes"].dtype == torch.uint8 and state["exp_avg_center"].shape == (1, 3)
    # Which saved group each element came from; a group of ours is kept if it has one.
    origin = torch.cat([s * 1000 + torch.arange(hi - lo) // G
                        for s, (lo, hi) in enumerate(zip(cuts, cuts[1:] + [300]))])
    kept = [j for j in range(3) if origin[j * G:(j + 1) * G].unique().numel() == 1]
    for name in values:
        before = _decode(saved, name)
        after = optim.fp32_state_dict()["state"][0][name].to_local().reshape(-1)
        assert torch.all((after - before).abs() <= 0.25 * before.abs()), name
        for j in kept:
            sl = slice(j * G, min(300, (j + 1) * G))
            assert torch.equal(state[f"{name}_codes"][sl], saved[f"{name}_codes"].to_local()[sl]), (name, j)
            assert torch.equal(after[sl], before[sl]), (name, j)
    assert kept == {1: [0, 1, 2], 2: [0], 3: [2]}[len(cuts)]


@pytest.mark.filterwarnings("ignore:CoatAdamW skipped")
def test_group_skips_round_trip_through_dcp(mesh, tmp_path):
    import torch.distributed.checkpoint as dcp

    params = _params(mesh)
    optim = _optim(params)
    for s in range(3):
        _grads(params, s)
        if s < 2:
            params[0].grad.to_local()[3, 140] = float("nan")  # row 3, group 1 of the 2-D weight
            params[1].grad.to_local()[290] = float("inf")  # last group of the 1-D bias
        optim.step()
    skips = [optim.state[p]["group_skips"].clone() for p in params]
    assert skips[0][3, 1] == 2 and skips[0].sum() == 2 and skips[1].tolist() == [[0, 0, 2]]
    sd = optim.state_dict()
    # 2-D: (rows, groups) sharded with the rows; 1-D: repeated on each element of its group.
    assert sd["state"][0]["group_skips"].shape == (5, 3) and sd["state"][1]["group_skips"].shape == (300,)
    dcp.save({"optim": sd}, checkpoint_id=str(tmp_path))
    params2 = [nn.Parameter(distribute_tensor(p.detach().full_tensor().clone(), mesh, [Shard(0)])) for p in params]
    optim2 = _optim(params2)
    for p in params2:  # create the state DCP loads into
        p.grad = torch.zeros_like(p)
    optim2.step()
    target = {"optim": optim2.state_dict()}
    dcp.load(target, checkpoint_id=str(tmp_path))
    optim2.load_state_dict(target["optim"])
    for p, p2, want in zip(params, params2, skips):
        assert _same(optim2.state[p2]["group_skips"], want)
        for k, v in optim.state[p].items():
            assert _same(optim2.state[p2][k], v), k
    # A 1-D group that mixes saved groups (other shard boundaries) keeps the largest count.
    mixed = optim.state_dict()
    per_elem = mixed["state"][1]["group_skips"].to_local().clone()
    per_elem[:64] = 1
    mixed["state"][1]["group_skips"] = DTensor.from_local(per_elem, mesh, [Shard(0)])
    optim2.load_state_dict(mixed)
    assert optim2.state[params2[1]]["group_skips"].tolist() == [[1, 0, 2]]


def test_prepared_triton_step_of_dtensor_parameters_equals_plain_ones(mesh):
    """The prepared step reads DTensors through their local shards, every step."""
    dt = _params(mesh)
    plain = [nn.Parameter(p.to_local().clone()) for p in dt]
    opts = [coat_ds.CoatAdamW(ps, lr=1e-2, min_quant_numel=256, backend="triton") for ps in (dt, plain)]
    for s in range(3):
        _grads(dt, s)
        for p, q in zip(dt, plain):
            q.grad = p.grad.to_local().clone()
        for opt in opts:
            opt.step()
    for p, q in zip(dt, plain):
        assert _same(p.to_local(), q.detach())
        for key, t in opts[1].state[q].items():
            assert _same(opts[0].state[p][key], t), key
