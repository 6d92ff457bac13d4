"""CoatAdamW under FSDP2 and FSDP1: 2 ranks on gloo (CPU), real process groups, no mocks.

The toy model has every awkward shape FSDP hands the optimizer: a (1, 130) weight (rank 1's
shard is empty, rank 0's is shorter than a group), a (3, hidden) weight (uneven 2/1 rows), a
1-D bias that is quantized (its shards do not start on group boundaries when hidden is not
a multiple of 2 * 128) and a 3-element bias that keeps FP32 moments.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

import coat_ds
from coat_ds.integrations.fsdp import (
    clip_grad_norm_,
    fsdp1_load_optim_state_dict,
    fsdp1_optim_state_dict,
    load_checkpoint,
    resolve_checkpoint,
    save_checkpoint,
    setup_fsdp,
)
from coat_ds.optim.sharded import mark_global_numel
from helpers import end_worker

pytestmark = pytest.mark.slow

LR = 1e-2
MIN_QUANT = 128  # low enough that every weight and the hidden bias get FP8 moments


class Net(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.gate = nn.Parameter(torch.randn(1, 130) * 0.5 + 1)
        self.blocks = nn.ModuleList([nn.Linear(130, hidden), nn.Linear(hidden, 3)])

    def forward(self, x):
        return self.blocks[1](torch.relu(self.blocks[0](x * self.gate)))


def _batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 130, generator=g), torch.randn(8, 3, generator=g)


def _optim(params):
    return coat_ds.CoatAdamW(params, lr=LR, min_quant_numel=MIN_QUANT)


def _optim_two_thresholds(model):
    """Weights need 600 elements for FP8 moments: the (3, 256) weight has 768, but its
    shards on 2 ranks have 512 and 256, so it is FP8 only if the decision is global."""
    named = dict(model.named_parameters())
    is_weight = {n: n.endswith(("blocks.0.weight", "blocks.1.weight")) for n in named}
    weights = [p for n, p in named.items() if is_weight[n]]
    others = [p for n, p in named.items() if not is_weight[n]]
    return coat_ds.CoatAdamW([{"params": weights, "min_quant_numel": 600}, {"params": others}],
                             lr=LR, min_quant_numel=MIN_QUANT)


def _train(model, optim, steps: range, rank: int, world: int) -> None:
    """Each rank takes its slice of the global batch; FSDP averages the gradients."""
    for s in steps:
        x, y = _batch(s)
        ((model(x.chunk(world)[rank]) - y.chunk(world)[rank]) ** 2).mean().backward()
        optim.step()
        optim.zero_grad()


def _train_single(model, optim, steps: range, world: int) -> None:
    """One process, same global batches, gradients of the per-rank slices averaged as FSDP
    does (sum of the per-slice gradients, each scaled by 1/world: exact for world = 2)."""
    for s in steps:
        x, y = _batch(s)
        for xs, ys in zip(x.chunk(world), y.chunk(world)):
            (((model(xs) - ys) ** 2).mean() / world).backward()
        optim.step()
        optim.zero_grad()


def _spawn(fn, world: int, tmp_path, *args) -> None:
    init = tmp_path / f"init-{fn.__name__}-{world}"
    mp.spawn(fn, args=(world, str(init), *args), nprocs=world, join=True)


def _init(rank: int, world: int, init: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)


def _full_params(model) -> dict:
    return {k: v.clone() for k, v in get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)).items()}


def _full_optim_state(model, optim) -> dict:
    """Gathered optimizer state, copied: DCP hands out live references where it can."""
    osd = get_optimizer_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"state": {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in st.items()}
                      for k, st in osd.get("state", {}).items()}}


def _local_state(optim) -> list[dict]:
    return [{k: v.clone() for k, v in optim.state[p].items()} for g in optim.param_groups for p in g["params"]]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of `t`'s bits (so -0.0 differs from 0.0 and FP8/NaN compare as bits)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(_bits(a), _bits(b)), what


def _relative_update_gap(params: dict, ref: dict, start: dict) -> float:
    """|| p - p_ref || / || p_ref - p_start || over all parameters."""
    num = sum(float((params[k] - ref[k]).norm() ** 2) for k in ref)
    den = sum(float((ref[k] - start[k]).norm() ** 2) for k in ref)
    return (num / den) ** 0.5


# -- FSDP2 training equals single-process training -------------------------------------------


def _fsdp2_train_worker(rank, world, init, hidden, out):
    _init(rank, world, init)
    torch.manual_seed(0)
    model = setup_fsdp(Net(hidden), mode="fsdp2")
    optim = _optim_two_thresholds(model)
    _train(model, optim, range(5), rank, world)
    params = _full_params(model)
    full_osd = _full_optim_state(model, optim)
    if rank == 0:
        torch.save({"params": params, "optim": full_osd}, out)
    end_worker()


def test_fsdp2_matches_single_process_bitwise(tmp_path):
    """With FSDP2 every 2-D weight is sharded by rows and groups never cross rows, so each
    rank quantizes exactly the groups the single process does; the hidden bias (256 =
    2 x 128) splits on a group boundary. Gradients are the same sums. So parameters and
    the gathered FP8 state must be bit-identical, not merely close. The state keys also
    show that FP32-or-FP8 was decided on whole tensors, not on shards."""
    out = tmp_path / "fsdp2.pt"
    _spawn(_fsdp2_train_worker, 2, tmp_path, 256, str(out))
    got = torch.load(out)
    torch.manual_seed(0)
    ref_model = Net(256)
    ref_optim = _optim_two_thresholds(ref_model)
    _train_single(ref_model, ref_optim, range(5), 2)
    assert "exp_avg_codes" in ref_optim.state[ref_model.blocks[1].weight]
    for k, v in ref_model.state_dict().items():
        _assert_bitwise(got["params"][k], v, k)
    ref_state = {name: ref_optim.state[p] for name, p in ref_model.named_parameters()}
    for name, state in ref_state.items():
        saved = got["optim"]["state"][name]
        assert set(saved) == set(state), name
        for key, v in state.items():
            if key.endswith(("_center", "_kcode", "_sexp", "group_skips")) and v.shape != saved[key].shape:
                # A 1-D parameter's checkpoint repeats each group's metadata on its elements.
                v = v.repeat_interleave(128, dim=1)[:, :saved[key].numel()].reshape(saved[key].shape)
            _assert_bitwise(saved[key], v, f"{name}.{key}")


# -- FSDP1 training is within the FP8 quantization noise of single-process training ---------------


def _fsdp1_train_worker(rank, world, init, use_orig_params, out):
    _init(rank, world, init)
    torch.manual_seed(0)
    model = setup_fsdp(Net(300), mode="fsdp1", use_orig_params=use_orig_params)
    optim = _optim(model.parameters())
    _train(model, optim, range(5), rank, world)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False)):
        params = {k.replace("_fsdp_wrapped_module.", ""): v.clone() for k, v in model.state_dict().items()}
    fp8 = optim.state_bytes()["fp8_numel"]
    counts = [None] * world
    dist.all_gather_object(counts, fp8)
    if rank == 0:
        torch.save({"params": params, "fp8_numel": sum(counts)}, out)
    end_worker()


@pytest.mark.parametrize("use_orig_params", [True, False])
def test_fsdp1_matches_single_process(tmp_path, use_orig_params):
    """FSDP1 hands the optimizer flat 1-D shards, so its groups of 128 cut rows differently
    from the single process: the two runs carry different (equally valid) FP8 rounding.
    The bound: their gap is at most twice the gap between CoatAdamW and FP32 AdamW on the
    same run (that gap is what FP8 moments cost; two independent roundings differ by about
    sqrt(2) times it). A real bug (wrong shard, lost state, wrong step) is far above it."""
    out = tmp_path / "fsdp1.pt"
    _spawn(_fsdp1_train_worker, 2, tmp_path, use_orig_params, str(out))
    got = torch.load(out)
    torch.manual_seed(0)
    start = {k: v.clone() for k, v in Net(300).state_dict().items()}
    torch.manual_seed(0)
    ref_model = Net(300)
    ref_optim = _optim(ref_model.parameters())
    _train_single(ref_model, ref_optim, range(5), 2)
    torch.manual_seed(0)
    fp32_model = Net(300)
    fp32_optim = torch.optim.AdamW(fp32_model.parameters(), lr=LR)
    _train_single(fp32_model, fp32_optim, range(5), 2)
    ref = ref_model.state_dict()
    noise = _relative_update_gap(fp32_model.state_dict(), ref, start)
    gap = _relative_update_gap(got["params"], ref, start)
    assert 0 < noise < 0.1
    assert gap <= 2 * noise, (gap, noise)
    # FP32-or-FP8 is decided on the whole tensor: as many FP8 elements as one process has
    # (use_orig_params=False: one flat parameter per unit, all of it above the threshold).
    assert got["fp8_numel"] >= ref_optim.state_bytes()["fp8_numel"]


# -- FSDP2 DCP checkpoints --------------------------------------------------------------------


def _trained_fsdp2_saved(rank, world, init, ckpt):
    """FSDP2 model and CoatAdamW after 3 steps, checkpointed at `ckpt` as step 3."""
    _init(rank, world, init)
    torch.manual_seed(0)
    model = setup_fsdp(Net(300), mode="fsdp2")
    optim = _optim(model.parameters())
    _train(model, optim, range(3), rank, world)
    save_checkpoint(ckpt, model, optim, step=3)
    return model, optim


def _fsdp2_ckpt_worker(rank, world, init, ckpt):
    """Save after 3 steps, load into a freshly built model and optimizer, check the state
    came back bit-exact, then both continue 2 steps and must stay bit-identical."""
    model, optim = _trained_fsdp2_saved(rank, world, init, ckpt)
    saved = _local_state(optim)

    torch.manual_seed(1)  # different initial weights: everything must come from the checkpoint
    model2 = setup_fsdp(Net(300), mode="fsdp2")
    optim2 = _optim(model2.parameters())
    assert load_checkpoint(ckpt, model2, optim2) == 3
    for i, (a, b) in enumerate(zip(saved, _local_state(optim2))):
        assert set(a) == set(b)
        for k in a:
            _assert_bitwise(b[k], a[k], f"param {i} {k}")

    # A full (gathered) optimizer state dict loads back bit-exactly as well.
    full = get_optimizer_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    full = {"state": {k: {n: v.clone() for n, v in st.items()} for k, st in full["state"].items()},
            "param_groups": full["param_groups"]}
    torch.manual_seed(2)
    model3 = setup_fsdp(Net(300), mode="fsdp2")
    optim3 = _optim(model3.parameters())
    set_optimizer_state_dict(model3, optim3, full, options=StateDictOptions(full_state_dict=True))
    for i, (a, b) in enumerate(zip(saved, _local_state(optim3))):
        for k in a:
            _assert_bitwise(b[k], a[k], f"full: param {i} {k}")

    _failed_saves_change_nothing(model, optim, ckpt)
    _train(model, optim, range(3, 5), rank, world)
    _train(model2, optim2, range(3, 5), rank, world)
    for (k, a), b in zip(_full_params(model).items(), _full_params(model2).values()):
        _assert_bitwise(b, a, k)
    end_worker()


def _failed_saves_change_nothing(model, optim, ckpt):
    """On every rank: a save over an existing checkpoint, and one that rank 1 fails to write,
    both raise and leave nothing new; loading the save folder then takes `ckpt`."""
    before = {f: os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt)}
    with pytest.raises(FileExistsError, match=f"{ckpt} already exists"):
        save_checkpoint(ckpt, model, optim, step=4)
    assert {f: os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt)} == before
    parent = os.path.dirname(ckpt)
    os.environ["COAT_DS_CKPT_FAULT"] = "rank=1,ckpt=step5,file=distcp,action=raise"
    try:  # DCP gathers rank 1's error and raises it (a BaseException) on every rank
        with pytest.raises(BaseException, match="injected failure writing .*step5.partial/__1_0.distcp"):
            save_checkpoint(os.path.join(parent, "step5"), model, optim, step=5)
    finally:
        del os.environ["COAT_DS_CKPT_FAULT"]
    assert not os.path.exists(os.path.join(parent, "step5"))
    assert resolve_checkpoint(parent) == ckpt
    assert load_checkpoint(parent, model, optim) == 3


def test_fsdp2_dcp_roundtrip_resumes_identically(tmp_path):
    """DCP save/load (sharded) and a full optimizer state dict both restore every rank's
    FP8 codes, scales and step bit-exactly; training then continues bit-identically."""
    _spawn(_fsdp2_ckpt_worker, 2, tmp_path, str(tmp_path / "ckpt"))


def _master_optim(model, master_weights: str):
    return coat_ds.CoatAdamW(model.parameters(), lr=LR, min_quant_numel=MIN_QUANT, master_weights=master_weights)


def _train_bf16(model, optim, steps: range, rank: int, world: int, each_step=None) -> None:
    """`_train` for a model whose parameters are BF16 (compute in BF16, loss in FP32)."""
    for s in steps:
        x, y = _batch(s)
        out = model(x.chunk(world)[rank].to(torch.bfloat16)).float()
        ((out - y.chunk(world)[rank]) ** 2).mean().backward()
        if each_step is not None:
            each_step()
        optim.step()
        optim.zero_grad()


def _masters(model, optim) -> list[torch.Tensor]:
    return [optim.fp32_master(p).to_local().clone() for p in model.parameters()]


def _fsdp2_master_worker(rank, world, init, ckpt):
    """master_weights="bf16+16" under FSDP2: the FP32 model becomes BF16 DTensors, which FSDP2
    all-gathers as they are, the FP32 shards freed at once; every step's FP32 masters are, bit for bit, what an FP32-master
    CoatAdamW gives on the same local gradient shards. DCP checkpoints resume bit-exactly in
    both forms: a "bf16+16" checkpoint into "bf16+16" and into an FP32-master run, and that
    run's own (FP32) checkpoint back into "bf16+16"."""
    _init(rank, world, init)
    torch.manual_seed(0)
    model = setup_fsdp(Net(300), mode="fsdp2")
    fp32_shards = [p.to_local() for p in model.parameters()]
    optim = _master_optim(model, "bf16+16")
    assert all(p.dtype == torch.bfloat16 and p.to_local().dtype == torch.bfloat16 for p in model.parameters())
    # The FP32 shards are freed as the optimizer converts them, not at FSDP2's first forward.
    assert all(t.untyped_storage().size() == 0 for t in fp32_shards)
    ref = [nn.Parameter(m) for m in _masters(model, optim)]
    for r, p in zip(ref, model.parameters()):
        mark_global_numel(r, p.numel())  # FP8 or FP32 moments as for the whole tensor
    ref_optim = coat_ds.CoatAdamW(ref, lr=LR, min_quant_numel=MIN_QUANT)

    def step_reference():
        for r, p in zip(ref, model.parameters()):
            r.grad = p.grad.to_local().float()
        ref_optim.step()

    _train_bf16(model, optim, range(3), rank, world, step_reference)
    for i, (m, r) in enumerate(zip(_masters(model, optim), ref)):
        _assert_bitwise(m, r.detach(), f"param {i} master")
        assert optim.state[list(model.parameters())[i]]["master_remainder"].dtype == torch.int16
    save_checkpoint(ckpt, model, optim, step=3)
    saved = _masters(model, optim)

    torch.manual_seed(1)  # other initial weights: everything must come from the checkpoint
    model2 = setup_fsdp(Net(300), mode="fsdp2")
    optim2 = _master_optim(model2, "bf16+16")
    assert load_checkpoint(ckpt, model2, optim2) == 3
    torch.manual_seed(2)
    model3 = setup_fsdp(Net(300), mode="fsdp2")
    optim3 = _master_optim(model3, "fp32")
    assert load_checkpoint(ckpt, model3, optim3) == 3
    for i, (a, b2, p3) in enumerate(zip(saved, _masters(model2, optim2), model3.parameters())):
        _assert_bitwise(b2, a, f"bf16+16 resumed: param {i}")
        _assert_bitwise(p3.to_local().detach(), a, f"fp32 resumed: param {i}")
    save_checkpoint(ckpt + "-fp32", model3, optim3, step=3)
    torch.manual_seed(3)
    model4 = setup_fsdp(Net(300), mode="fsdp2")
    optim4 = _master_optim(model4, "bf16+16")
    assert load_checkpoint(ckpt + "-fp32", model4, optim4) == 3
    for i, (a, b4) in enumerate(zip(saved, _masters(model4, optim4))):
        _assert_bitwise(b4, a, f"bf16+16 from an FP32 checkpoint: param {i}")
    for m, o in ((model, optim), (model2, optim2), (model4, optim4)):
        _train_bf16(m, o, range(3, 5), rank, world)
    for i, (a, b2, b4) in enumerate(zip(_masters(model, optim), _masters(model2, optim2), _masters(model4, optim4))):
        _assert_bitwise(b2, a, f"param {i} after resuming")
        _assert_bitwise(b4, a, f"param {i} after resuming from FP32")
    end_worker()


def test_fsdp2_bf16_master_weights_equal_fp32_and_resume_in_both_forms(tmp_path):
    _spawn(_fsdp2_master_worker, 2, tmp_path, str(tmp_path / "ckpt"))


def _fsdp2_save_worker(rank, world, init, ckpt, out):
    model, optim = _trained_fsdp2_saved(rank, world, init, ckpt)
    full_osd = _full_optim_state(model, optim)
    at_save = _full_params(model)
    _train(model, optim, range(3, 5), rank, world)
    end = _full_params(model)
    if rank == 0:
        torch.save({"at_save": at_save, "optim": full_osd, "end": end}, out)
    end_worker()


def _fsdp2_resume_worker(rank, world, init, ckpt, out):
    _init(rank, world, init)
    torch.manual_seed(1)
    model = setup_fsdp(Net(300), mode="fsdp2")
    optim = _optim(model.parameters())
    assert load_checkpoint(ckpt, model, optim) == 3
    at_load = _full_params(model)
    osd = _full_optim_state(model, optim)
    _train(model, optim, range(3, 5), rank, world)
    end = _full_params(model)
    if rank == 0:
        torch.save({"at_load": at_load, "optim": osd, "end": end}, out)
    end_worker()


def test_fsdp2_resume_on_fewer_ranks(tmp_path):
    """2 ranks save, 1 rank resumes. Weights and every 2-D weight's FP8 state come back
    bit-exact (compact per-row metadata); the 300-element bias was quantized in groups
    starting at 0 and 150 and is now grouped from 0: its first group is restored exactly,
    the others are decoded and quantized once more (within one FP8 rounding)."""
    ckpt = str(tmp_path / "ckpt")
    _spawn(_fsdp2_save_worker, 2, tmp_path, ckpt, str(tmp_path / "two.pt"))
    _spawn(_fsdp2_resume_worker, 1, tmp_path, ckpt, str(tmp_path / "one.pt"))
    two, one = torch.load(tmp_path / "two.pt"), torch.load(tmp_path / "one.pt")
    for k, v in two["at_save"].items():
        _assert_bitwise(one["at_load"][k], v, k)
    for name in ("gate", "blocks.0.weight", "blocks.1.weight", "blocks.1.bias"):
        for key, v in two["optim"]["state"][name].items():
            _assert_bitwise(one["optim"]["state"][name][key], v, f"{name}.{key}")
    bias_saved, bias_loaded = two["optim"]["state"]["blocks.0.bias"], one["optim"]["state"]["blocks.0.bias"]
    _assert_bitwise(bias_loaded["exp_avg_codes"][:128], bias_saved["exp_avg_codes"][:128], "first group")
    for name in ("exp_avg", "exp_avg_sq"):
        a, b = _decode(bias_saved, name), _decode(bias_loaded, name)
        # Re-quantizing a decoded E4M3 value moves it by at most a few mantissa steps (2^-3).
        assert torch.all((a - b).abs() <= 0.25 * a.abs()), name
    gap = _relative_update_gap(one["end"], two["end"], two["at_save"])
    assert gap < 0.05, gap


def _decode(state: dict, name: str) -> torch.Tensor:
    """Element-wise decode of a gathered 1-D state (metadata repeated per element)."""
    from coat_ds.kernels import QuantizedGroups, get

    n = state[f"{name}_codes"].numel()
    qg = QuantizedGroups(*(state[f"{name}_{part}"].reshape(1, n) for part in ("codes", "center", "kcode", "sexp")))
    return get("group_codec", torch.device("cpu"), "torch").dequantize(qg, 1, "e4m3").reshape(n)


# -- FSDP1 checkpoints ------------------------------------------------------------------------


def _fsdp1_full(model, optim) -> tuple[dict, dict]:
    """FSDP1's full model and optimizer state dicts (FP32 moments), on every rank."""
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False),
                              FullOptimStateDictConfig(rank0_only=False)):
        params = {k: v.clone() for k, v in model.state_dict().items()}
        return params, fsdp1_optim_state_dict(model, optim)


def _fsdp1_ckpt_worker(rank, world, init, use_orig_params, ckpt, out):
    _init(rank, world, init)
    torch.manual_seed(0)
    model = setup_fsdp(Net(300), mode="fsdp1", use_orig_params=use_orig_params)
    optim = _optim(model.parameters())
    _train(model, optim, range(3), rank, world)
    fp32 = optim.fp32_state_dict()["state"]

    # Sharded: a DCP directory through save_checkpoint / load_checkpoint.
    save_checkpoint(ckpt, model, optim, step=3)
    at_save = _fsdp1_full(model, optim)
    if rank == 0:
        torch.save(at_save, out)
    torch.manual_seed(1)
    model2 = setup_fsdp(Net(300), mode="fsdp1", use_orig_params=use_orig_params)
    optim2 = _optim(model2.parameters())
    assert load_checkpoint(ckpt, model2, optim2) == 3
    _check_requantized(fp32, optim2)

    # Full: FSDP1's full optimizer state dict, as torch.optim.AdamW would have it.
    full = at_save[1]
    assert full["state"]["blocks.0.weight"]["exp_avg"].shape == (300, 130)
    assert full["state"]["blocks.0.weight"]["exp_avg"].dtype == torch.float32
    torch.manual_seed(2)
    model3 = setup_fsdp(Net(300), mode="fsdp1", use_orig_params=use_orig_params)
    optim3 = _optim(model3.parameters())
    with FSDP.state_dict_type(model3, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False),
                              FullOptimStateDictConfig(rank0_only=False)):
        fsdp1_load_optim_state_dict(model3, optim3, full)
    _check_requantized(fp32, optim3)

    # Resuming from the DCP checkpoint continues within one FP8 rounding of not stopping:
    # re-quantizing moves each moment by at most half an E4M3 step (2^-4 relative, more
    # where DRE compresses a group's range), so the next updates move by about as much.
    start = [p.detach().clone() for p in model.parameters()]
    _train(model, optim, range(3, 5), rank, world)
    _train(model2, optim2, range(3, 5), rank, world)
    num = sum(float((a - b).norm() ** 2) for a, b in zip(model.parameters(), model2.parameters()))
    den = sum(float((a - s).norm() ** 2) for a, s in zip(model.parameters(), start))
    gaps = [None] * world
    dist.all_gather_object(gaps, (num, den))
    gap = (sum(n for n, _ in gaps) / sum(d for _, d in gaps)) ** 0.5
    assert 0 <= gap < 0.125, gap
    end_worker()


def _check_requantized(fp32: dict, optim) -> None:
    """Loaded moments decode to the saved FP32 moments within one more FP8 rounding."""
    loaded = optim.fp32_state_dict()["state"]
    assert set(loaded) == set(fp32)
    for pid, state in fp32.items():
        assert torch.equal(loaded[pid]["step"], state["step"])
        for name in ("exp_avg", "exp_avg_sq"):
            a, b = state[name], loaded[pid][name]
            assert torch.all((a - b).abs() <= 0.25 * a.abs() + 1e-30), (pid, name, a[:5], b[:5], a.shape)


@pytest.mark.parametrize("use_orig_params", [True, False])
def test_fsdp1_checkpoints(tmp_path, use_orig_params):
    """Sharded (DCP) and full optimizer state dicts of FSDP1 load back within one FP8
    rounding of the moments, and training continues within that of not stopping; the DCP
    checkpoint of 2 ranks also resumes on 1."""
    ckpt, two = str(tmp_path / "ckpt"), str(tmp_path / "two.pt")
    _spawn(_fsdp1_ckpt_worker, 2, tmp_path, use_orig_params, ckpt, two)
    _spawn(_fsdp1_resume_worker, 1, tmp_path, use_orig_params, ckpt, str(tmp_path / "one.pt"))
    (params2, osd2), (params1, osd1) = torch.load(two), torch.load(tmp_path / "one.pt")
    assert params1.keys() == params2.keys() and osd1["state"].keys() == osd2["state"].keys()
    for k, v in params2.items():
        _assert_bitwise(params1[k], v, k)
    for fqn, state in osd2["state"].items():
        assert torch.equal(osd1["state"][fqn]["step"], state["step"])
        for name in ("exp_avg", "exp_avg_sq"):
            a, b = state[name], osd1["state"][fqn][name]
            assert a.shape == b.shape
            assert torch.all((a - b).abs() <= 0.25 * a.abs()), (fqn, name)


def _fsdp1_resume_worker(rank, world, init, use_orig_params, ckpt, out):
    _init(rank, world, init)
    torch.manual_seed(1)
    model = setup_fsdp(Net(300), mode="fsdp1", use_orig_params=use_orig_params)
    optim = _optim(model.parameters())
    assert load_checkpoint(ckpt, model, optim) == 3
    torch.save(_fsdp1_full(model, optim), out)
    end_worker()


# -- setup_fsdp's activation-compression hook-in -------------------------------------------------


def _fsdp2_activation_worker(rank, world, init, out):
    _init(rank, world, init)
    losses = {}
    for compress in (False, True):
        torch.manual_seed(0)
        model = setup_fsdp(Net(256), mode="fsdp2",
                           activation=coat_ds.ActivationConfig(min_numel=0) if compress else None)
        optim = _optim(model.parameters())
        x, y = _batch(0)
        for _ in range(3):
            loss = ((model(x.chunk(world)[rank]) - y.chunk(world)[rank]) ** 2).mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
        losses[compress] = float(loss)
        if compress:
            stats = coat_ds.activation_stats(model)
            assert stats is not None and stats.compressed_tensors > 0
            assert stats.compressed_bytes < stats.uncompressed_bytes
    if rank == 0:
        torch.save(losses, out)
    end_worker()


def test_fsdp2_with_activation_compression(tmp_path):
    """`activation=` puts FP8 saved-tensor hooks on the model before sharding; training still
    runs under FSDP2 and fits the same batch about as well as without compression."""
    _spawn(_fsdp2_activation_worker, 2, tmp_path, str(tmp_path / "losses.pt"))
    losses = torch.load(tmp_path / "losses.pt")
    assert abs(losses[True] - losses[False]) <= 0.05 * losses[False], losses


# -- gradient clipping over shards ---------------------------------------------------------------


def _clip_worker(rank, world, init, mode, out):
    _init(rank, world, init)
    torch.manual_seed(0)
    model = setup_fsdp(Net(300), mode=mode)
    x, y = _batch(0)
    ((model(x.chunk(world)[rank]) - y.chunk(world)[rank]) ** 2).mean().backward()
    before = clip_grad_norm_(model, 0.1)
    after = clip_grad_norm_(model, 0.1)
    if rank == 0:
        torch.save((before, after), out)
    end_worker()


@pytest.mark.parametrize("mode", ["fsdp2", "fsdp1"])
def test_clip_grad_norm_is_global(tmp_path, mode):
    """The norm is over the whole model (all shards), as one process computes it, and
    clipping brings it to max_norm."""
    _spawn(_clip_worker, 2, tmp_path, mode, str(tmp_path / "norms.pt"))
    before, after = torch.load(tmp_path / "norms.pt")
    torch.manual_seed(0)
    ref = Net(300)
    x, y = _batch(0)
    for xs, ys in zip(x.chunk(2), y.chunk(2)):
        (((ref(xs) - ys) ** 2).mean() / 2).backward()
    expected = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf")))
    assert expected > 0.1
    assert before == pytest.approx(expected, rel=1e-5)
    assert after == pytest.approx(0.1, rel=1e-4)


# -- HSDP: sharded within groups of ranks, replicated across them ------------------------------


def _hsdp_worker(rank, world, init, ckpt, ref_path):
    """4 ranks, shard_size 2: each parameter is a DTensor on a (replicate 2, shard 2) mesh holding
    half of it; CoatAdamW's step gives both replicas the same shards, training follows the
    single process as closely as plain FSDP2 does, and a DCP checkpoint resumes bit for bit
    under HSDP and loads into plain FSDP2 over the 4 ranks."""
    _init(rank, world, init)
    torch.manual_seed(0)
    model = setup_fsdp(Net(256), mode="fsdp2", shard_size=2)
    w = model.blocks[0].weight
    assert w.device_mesh.shape == (2, 2) and w.device_mesh.mesh_dim_names == ("replicate", "shard")
    assert w.to_local().shape == (128, 130)
    optim = _optim(model.parameters())
    _train(model, optim, range(3), rank, world)
    save_checkpoint(ckpt, model, optim, step=3)
    _train(model, optim, range(3, 5), rank, world)
    # The replicas of each shard are bit for bit the same: parameters and FP8 state.
    local = [p.to_local().detach() for p in model.parameters()] + [
        t for s in _local_state(optim) for t in s.values() if torch.is_tensor(t)]
    mine = torch.cat([_bits(t).flatten().to(torch.int64) for t in local])
    other = torch.empty_like(mine)
    peer = rank ^ 2  # the same shard in the other replica
    reqs = [dist.isend(mine, peer), dist.irecv(other, peer)]
    for r in reqs:
        r.wait()
    assert torch.equal(mine, other)
    params = _full_params(model)  # on rank 0 (full and offloaded to the CPU: that rank's alone)
    ref = torch.load(ref_path)
    if rank == 0:
        # Not bit for bit: 4 gradients summed in another order, then FP8 rounding of the
        # moments. Plain FSDP2 over these 4 ranks is 0.48% from the single process.
        gap = _relative_update_gap(params, ref["end"], ref["start"])
        assert gap < 0.01, gap

    torch.manual_seed(1)
    model2 = setup_fsdp(Net(256), mode="fsdp2", shard_size=2)
    optim2 = _optim(model2.parameters())
    assert load_checkpoint(ckpt, model2, optim2) == 3
    _train(model2, optim2, range(3, 5), rank, world)
    for (k, a), b in zip(params.items(), _full_params(model2).values()):
        _assert_bitwise(b, a, f"HSDP resumed: {k}")
    torch.manual_seed(2)
    model3 = setup_fsdp(Net(256), mode="fsdp2")
    optim3 = _optim(model3.parameters())
    assert load_checkpoint(ckpt, model3, optim3) == 3
    _train(model3, optim3, range(3, 5), rank, world)
    params3 = _full_params(model3)
    if rank == 0:
        assert _relative_update_gap(params3, params, ref["start"]) < 0.01
    with pytest.raises(ValueError, match="shard_size 3 does not divide the world size 4"):
        setup_fsdp(Net(256), mode="fsdp2", shard_size=3)
    end_worker()


def test_hsdp_trains_like_one_process_and_resumes(tmp_path):
    torch.manual_seed(0)
    model = Net(256)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for n, p in model.named_parameters():
        mark_global_numel(p, p.numel())
    _train_single(model, _optim(model.parameters()), range(5), 4)
    ref = tmp_path / "ref.pt"
    torch.save({"start": start, "end": {k: v.detach().clone() for k, v in model.state_dict().items()}}, ref)
    _spawn(_hsdp_worker, 4, tmp_path, str(tmp_path / "ckpt"), str(ref))


def test_hsdp_is_refused_where_it_does_not_apply():
    with pytest.raises(ValueError, match="shard_size must be None or an int >= 1, got 0"):
        coat_ds.integrations.fsdp.FsdpConfig(shard_size=0)
    with pytest.raises(ValueError, match="shard_size \\(HSDP\\) is for mode='fsdp2', not 'fsdp1'"):
        coat_ds.integrations.fsdp.FsdpConfig(mode="fsdp1", shard_size=2)
