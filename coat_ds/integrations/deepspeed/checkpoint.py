"""DeepSpeed checkpoints with CoatAdamW at another data-parallel size.

`engine.save_checkpoint` / `engine.load_checkpoint` already round-trip CoatAdamW bit-exactly
at the same world size: each rank saves its optimizer's `state_dict()` (FP8 codes and scales
in their own dtypes) and `CoatAdamW.load_state_dict` keeps those dtypes. What DeepSpeed cannot
do is re-partition it: its elastic and universal paths assume FP32 `exp_avg`/`exp_avg_sq`
shaped like the partition. So a resume at another size goes through the FP32 layout:

1. `consolidate_checkpoint(dir)` (offline, any process) dequantizes every rank's moments to
   FP32 and reassembles per-parameter tensors with DeepSpeed's own ZeRO layout code
   (`deepspeed.utils.zero_to_fp32`), next to the FP32 master weights.
2. `load_fp32_checkpoint(engine, ckpt)` scatters those tensors into the new engine's
   partitions with `deepspeed.utils.safe_set_full_fp32_param` and re-quantizes the moments
   through `CoatAdamW.load_fp32_state_dict`.

`load_checkpoint(engine, dir)` picks the direct or the converting path by the saved world size.
`save_checkpoint(engine, save_dir, tag)` wraps `engine.save_checkpoint` so that the checkpoint
becomes visible only once every rank has written it (`coat_ds.io.checkpoint_folders`).

Every load here reads DeepSpeed's files weights-only, DeepSpeed's own `torch.load` calls
included, permitting besides torch's types only the four DeepSpeed pickles
(`_deepspeed_globals`); a file holding anything else is refused naming it, unless
`trust_checkpoint=True`.
Command line: `python -m coat_ds.integrations.deepspeed.checkpoint CKPT_DIR OUT.pt [--tag TAG]
[--trust-checkpoint]`.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import itertools
import os

import torch
import torch.distributed as dist

from ..._compat.deepspeed import refresh_lp_params, set_full_fp32_param, zero3_param_groups_filled, zero_layout
from ...io.atomic import atomic_write
from ...io.checkpoint_folders import Found, find_checkpoint, report_skipped, staged_save
from ...io.faults import fault_point
from ...io.safe_load import CheckpointError, listed_refusal, load_file, reading_file, weights_only_loads
from ...kernels import master as bits
from ...optim import state as st
from .engine import bf16_masters, coat_optimizer, group_state_config, local_partitions

__all__ = ["FORMAT", "saved_world_size", "consolidate_checkpoint", "load_fp32_checkpoint", "load_checkpoint",
           "save_checkpoint"]

FORMAT = "coat_ds.deepspeed_fp32_checkpoint/1"

# Keys DeepSpeed itself writes into the model-states file; every other key is client state.
_ENGINE_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps", "global_steps",
    "global_samples", "dp_world_size", "mp_world_size", "checkpoint_parallel_dimensions", "ds_config",
    "ds_version", "sparse_tensor_module_names"})


def _deepspeed_globals() -> list:
    """The types DeepSpeed 0.19 pickles into ZeRO-0/1/2/3 checkpoints besides torch's (found by
    listing the globals of real ones, bf16, fp32 and offloaded): the loss scaler (static, or
    dynamic under fp16), the ZeRO stage and ZeRO-1/2's parameter fragment addresses. The one
    place this module names DeepSpeed's checkpoint types."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def _deepspeed_loads(trust_checkpoint: bool):
    """Every torch.load in the block (DeepSpeed's too) weights-only, DeepSpeed's types allowed."""
    return weights_only_loads(trust_checkpoint, () if trust_checkpoint else _deepspeed_globals())


def _resolve(load_dir: str, tag: str | None, trust_checkpoint: bool = False) -> Found:
    """The checkpoint folder to read: `load_dir/tag`, or `load_dir` itself when it is one,
    or the newest complete checkpoint in `load_dir` (see `coat_ds.io.checkpoint_folders`)."""
    found = find_checkpoint(os.path.join(load_dir, str(tag)) if tag is not None else load_dir, trust_checkpoint)
    report_skipped(found)
    return found


def _tag_dir(load_dir: str, tag: str | None, trust_checkpoint: bool = False) -> str:
    return _resolve(load_dir, tag, trust_checkpoint).path


def _read(path: str, trust_checkpoint: bool = False):
    """torch.load of one checkpoint file (weights-only unless trusted), failing with its path."""
    return load_file(path, trust_checkpoint, () if trust_checkpoint else _deepspeed_globals())


def _refuse_on_every_rank(ckpt_dir: str) -> None:
    """Raise on every rank alike the first weights-only refusal among the folder's files, each
    rank listing its share of them from their pickles alone (no tensor is read). Refused only
    where DeepSpeed reads it, a rank's own optimizer file would end that rank alone: the others
    would load theirs, report the resume and then die on a closed connection."""
    files = sorted(os.path.join(ckpt_dir, f) for f in os.listdir(ckpt_dir) if f.endswith(".pt"))
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    with _deepspeed_loads(False):
        mine = next((str(e) for e in map(listed_refusal, files[rank::world]) if e is not None), None)
    found = [mine] * world
    if world > 1:
        dist.all_gather_object(found, mine)
    refusal = next((m for m in found if m), None)
    if refusal:
        raise CheckpointError(refusal)


def _model_state(ckpt_dir: str, trust_checkpoint: bool = False) -> dict:
    files = sorted(f for f in os.listdir(ckpt_dir) if f.endswith("model_states.pt"))
    if not files:
        raise CheckpointError(f"{ckpt_dir} holds no *model_states.pt file (it has {sorted(os.listdir(ckpt_dir))})")
    return _read(os.path.join(ckpt_dir, files[0]), trust_checkpoint)


@contextlib.contextmanager
def _guarded_files(engine, trust_checkpoint: bool = False):
    """DeepSpeed's checkpoint file I/O, for the duration of one save or load: writes pass
    through `fault_point` (tests kill a rank there), a file that cannot be read fails with
    its path (DeepSpeed's own error names none) and, refused, with what it holds."""
    ce = engine.checkpoint_engine
    save, load = ce.save, ce.load

    def guarded_save(state_dict, path):
        with fault_point(path):
            save(state_dict, path)

    def guarded_load(path, map_location=None):
        with reading_file(path, trust_checkpoint):
            return load(path, map_location=map_location)

    ce.save, ce.load = guarded_save, guarded_load
    try:
        yield
    finally:
        ce.save, ce.load = save, load


def save_checkpoint(engine, save_dir: str, tag: str, client_state: dict | None = None,
                    step: int | None = None) -> str:
    """`engine.save_checkpoint` made safe against a rank dying mid-save (call on every rank):
    written as `save_dir/.tag.partial`, renamed to `save_dir/tag` with its completion record
    once every rank has finished, then `latest` updated. Refuses an existing `save_dir/tag`.
    `step` (default: the engine's global step) goes into the record. Returns the folder."""
    final = os.path.join(os.path.abspath(save_dir), str(tag))
    step = engine.global_steps if step is None else step
    with staged_save(final, step, engine=f"deepspeed/zero{engine.zero_optimization_stage()}") as staging, \
            _guarded_files(engine):
        engine.save_checkpoint(os.path.dirname(staging), tag=os.path.basename(staging),
                               client_state=client_state or {}, save_latest=False)
    return final


def saved_world_size(load_dir: str, tag: str | None = None, trust_checkpoint: bool = False) -> int:
    """Data-parallel size the checkpoint in `load_dir` (tag, or the newest complete one) was saved at."""
    return int(_model_state(_tag_dir(load_dir, tag, trust_checkpoint), trust_checkpoint)["dp_world_size"])


def _fp32_moments(opt_sd: dict, lengths: list[int]) -> tuple[dict[str, list[torch.Tensor]], set[float]]:
    """Dequantized exp_avg / exp_avg_sq of one rank's flat tensors, cut to `lengths`
    (ZeRO-1/2 save FP32 partitions without their padding), and the steps seen."""
    out = {name: [] for name in st.MOMENTS}
    steps = set()
    ids = [(pid, group) for group in opt_sd["param_groups"] for pid in group["params"]]
    if len(ids) != len(lengths):
        raise ValueError(f"optimizer state has {len(ids)} tensors, checkpoint has {len(lengths)} FP32 partitions")
    for (pid, group), n in zip(ids, lengths):
        state = opt_sd["state"].get(pid)
        if not state:  # never stepped: AdamW's zeros
            for name in st.MOMENTS:
                out[name].append(torch.zeros(n))
            steps.add(0.0)
            continue
        cfg = dataclasses.replace(group_state_config(group), backend="torch")  # host tensors, reference codec
        fp32 = st.to_fp32(state, cfg, tuple(group["betas"]))  # group skips folded into the moments
        for name in st.MOMENTS:
            flat = fp32[name].reshape(-1)
            if flat.numel() < n:
                raise ValueError(f"{name} has {flat.numel()} elements, partition has {n}")
            out[name].append(flat[:n].contiguous())
        steps.add(float(state["step"]))
    return out, steps


def _fp32_masters(opt_sd: dict, flats: list[torch.Tensor]) -> list[torch.Tensor]:
    """One rank's flat master partitions in FP32: BF16 ones (CoatAdamW master_weights
    "bf16+*") joined with their remainders, cut like the partitions."""
    ids = [pid for group in opt_sd["param_groups"] for pid in group["params"]]
    out = []
    for pid, flat in zip(ids, flats):
        rem = (opt_sd["state"].get(pid) or {}).get(st.REMAINDER_KEY)
        out.append(flat.float() if rem is None else bits.join(flat, rem.reshape(-1)[:flat.numel()]))
    return out


def consolidate_checkpoint(load_dir: str, tag: str | None = None, trust_checkpoint: bool = False) -> dict:
    """Per-parameter FP32 weights and AdamW moments of a ZeRO-1/2/3 CoatAdamW checkpoint (with
    master_weights "bf16+*", the weights are the BF16 partitions and remainders joined).

    Returns {"format", "zero_stage", "world_size", "step", "param_groups", "params",
    "exp_avg", "exp_avg_sq", "engine", "client_state"}; the three tensor dicts are keyed by
    parameter name with full shapes, like `model.state_dict()`. Its files are read
    weights-only unless `trust_checkpoint` (see the module's doc)."""
    layout = zero_layout()
    ckpt_dir = _tag_dir(load_dir, tag, trust_checkpoint)
    model_sd = _model_state(ckpt_dir, trust_checkpoint)
    files = layout.model_state_files(ckpt_dir)
    try:
        with contextlib.redirect_stdout(io.StringIO()), _deepspeed_loads(trust_checkpoint):
            model_states = layout.parse_model_states(files)
    except Exception as e:
        for f in files:  # name the unreadable (or refused) one
            _read(f, trust_checkpoint)
        raise CheckpointError(f"cannot parse the model states in {ckpt_dir}: {e}") from e
    sds = [_read(f, trust_checkpoint)["optimizer_state_dict"] for f in layout.optim_files(ckpt_dir)]
    stage = int(sds[0]["zero_stage"])
    world = sds[0]["partition_count"]
    world = max(world) if isinstance(world, list) else int(world)
    if world != len(sds):
        raise ValueError(f"{ckpt_dir}: saved at world size {world} but holds {len(sds)} optimizer files")
    if stage <= 2:
        if not isinstance(sds[0]["base_optimizer_state"], dict):
            raise ValueError(f"{ckpt_dir} is an elastic checkpoint; its FP8 scales are not recoverable")
        opt_sds = [sd["base_optimizer_state"] for sd in sds]
        masters = [sd["single_partition_of_fp32_groups"] for sd in sds]
    else:
        opt_sds = [sd["optimizer_state_dict"] for sd in sds]
        masters = [sd["fp32_flat_groups"] for sd in sds]
    if not all("first_moment_format" in g for g in opt_sds[0]["param_groups"]):
        raise ValueError(f"{ckpt_dir} was not written with CoatAdamW")
    moments, steps = {name: [] for name in st.MOMENTS}, set()
    for osd, flats in zip(opt_sds, masters):
        rank_moments, rank_steps = _fp32_moments(osd, [t.numel() for t in flats])
        flats[:] = _fp32_masters(osd, flats)
        for name in st.MOMENTS:
            moments[name].append(rank_moments[name])
        steps |= rank_steps
    if len(steps) != 1:
        raise ValueError(f"{ckpt_dir}: optimizer tensors were stepped unequal times {sorted(steps)}")

    def per_param(flat_groups: list[list[torch.Tensor]]) -> dict[str, torch.Tensor]:
        with contextlib.redirect_stdout(io.StringIO()):  # zero_to_fp32 narrates every call
            sd = layout.per_param(stage, world, flat_groups, model_states, sds[0].get("param_alignment_paddings"))
        names = {n for shapes in model_states[0].param_shapes for n in shapes}
        return {n: t.detach().clone() for n, t in sd.items() if n in names}

    return {
        "format": FORMAT,
        "zero_stage": stage,
        "world_size": world,
        "step": steps.pop(),
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt_sds[0]["param_groups"]],
        "params": per_param(masters),
        **{name: per_param(moments[name]) for name in st.MOMENTS},
        "engine": {k: model_sd.get(k) for k in ("global_steps", "global_samples", "skipped_steps", "lr_scheduler")},
        "client_state": {k: v for k, v in model_sd.items() if k not in _ENGINE_KEYS},
    }


def _scatter(engine, named, parts, full: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Write per-parameter tensors into this rank's flat FP32 partitions through DeepSpeed's
    own mapping (padding left at zero); returns the partitions' new contents."""
    for t in parts:
        t.data.zero_()
    for name, p in named:
        set_full_fp32_param(p, full[name].to(torch.float32))
    return [t.detach().clone() for t in parts]


def _split_masters(engine, named, parts, params: dict[str, torch.Tensor], coat) -> tuple[dict, dict]:
    """(each partition's remainder state by its index, the values to scatter as masters): under
    master_weights "bf16+*" (BF16 partitions) `params` split into BF16 values and remainders,
    else nothing and `params`. DeepSpeed's mapping writes values into the BF16 partitions, so a
    remainder goes through it as values a BF16 holds exactly: an 8-bit one whole, a 16-bit one
    as its two bytes."""
    kinds = {g["master_weights"] for g in coat.param_groups}
    if len(kinds) > 1:
        raise ValueError(f"load_fp32_checkpoint: param groups with different master_weights {sorted(kinds)}")
    n = bits.MASTER_KINDS[kinds.pop()]
    if not n:
        return {}, params
    split = {name: bits.split(params[name].to(torch.float32), n) for name, _ in named}
    rems = {name: r.to(torch.int32) for name, (_, r) in split.items()}
    if n == 8:
        rem = [t.to(torch.int8) for t in _scatter(engine, named, parts, {k: r.float() for k, r in rems.items()})]
    else:
        high = _scatter(engine, named, parts, {k: torch.div(r, 256, rounding_mode="floor").float()
                                               for k, r in rems.items()})
        low = _scatter(engine, named, parts, {k: torch.remainder(r, 256).float() for k, r in rems.items()})
        rem = [(h.to(torch.int32) * 256 + lo.to(torch.int32)).to(torch.int16) for h, lo in zip(high, low)]
    return {i: {st.REMAINDER_KEY: r} for i, r in enumerate(rem)}, {k: hi.float() for k, (hi, _) in split.items()}


def load_fp32_checkpoint(engine, ckpt, trust_checkpoint: bool = False) -> dict:
    """Load a `consolidate_checkpoint` result (dict or path) into `engine`, at any
    data-parallel size: master weights, BF16 weights, re-quantized moments, step, the
    engine's step counters and LR scheduler. Returns the saved client state. A path is read
    weights-only unless `trust_checkpoint`."""
    if not isinstance(ckpt, dict):
        ckpt = _read(ckpt, trust_checkpoint)
    if ckpt.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} file (format={ckpt.get('format')!r})")
    coat = coat_optimizer(engine)
    if coat is None:
        raise ValueError("the engine's optimizer is not CoatAdamW")
    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    missing = [n for n, _ in named if n not in ckpt["params"]]
    if missing:
        raise KeyError(f"checkpoint lacks parameters {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    parts = [t for t, _ in local_partitions(engine)]
    moments = {name: _scatter(engine, named, parts, ckpt[name]) for name in st.MOMENTS}
    remainders, masters = _split_masters(engine, named, parts, ckpt["params"], coat)
    _scatter(engine, named, parts, masters)  # last: leaves the masters in place
    refresh_lp_params(engine.optimizer)

    with zero3_param_groups_filled(engine.optimizer):
        sd = coat.state_dict()
        index = {id(t): i for i, t in enumerate(parts)}
        tensors = itertools.chain.from_iterable(g["params"] for g in coat.param_groups)
        pids = itertools.chain.from_iterable(g["params"] for g in sd["param_groups"])
        sd["state"] = {}
        for pid, t in zip(pids, tensors):
            i = index[id(t)]
            sd["state"][pid] = {"step": torch.tensor(float(ckpt["step"])),
                                **{name: moments[name][i] for name in st.MOMENTS}, **remainders.get(i, {})}
        for group, saved in zip(sd["param_groups"], ckpt["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        coat.load_fp32_state_dict(sd)

    counters = ckpt["engine"]
    for key in ("global_steps", "global_samples", "skipped_steps"):
        if counters.get(key) is not None:
            setattr(engine, key, counters[key])
    if engine.lr_scheduler is not None and counters.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(counters["lr_scheduler"])
    return dict(ckpt["client_state"])


def load_checkpoint(engine, load_dir: str, tag: str | None = None,
                    trust_checkpoint: bool = False) -> tuple[str, dict]:
    """`engine.load_checkpoint` when the world size and the form of the master weights match the
    saved ones (bit-exact), else consolidate and re-partition through the FP32 layout (which
    joins saved remainders into FP32 masters and splits them again for this engine's
    `master_weights`: DeepSpeed's own load would pair an FP32 checkpoint's rounded weights with
    remainders seeded from the weights the run started from). `load_dir` is a save_dir (then
    `tag`, or its newest complete checkpoint, see `coat_ds.io.checkpoint_folders.find_checkpoint`) or one
    checkpoint folder. Every file is read weights-only, DeepSpeed's own reads included, unless
    `trust_checkpoint`. Returns (the checkpoint folder loaded, client_state)."""
    ckpt_dir = _tag_dir(load_dir, tag, trust_checkpoint)
    if not trust_checkpoint:
        _refuse_on_every_rank(ckpt_dir)
    saved = _model_state(ckpt_dir, trust_checkpoint)
    live_bf16 = _bf16_masters_live(engine)
    same_form = bf16_masters(saved.get("ds_config") or {}) == live_bf16
    if not same_form and engine.global_rank == 0:
        print(f"coat_ds: {ckpt_dir} holds {'FP32' if live_bf16 else 'BF16 + remainder'} master "
              "weights and this run the other form: converted through the FP32 layout", flush=True)
    if same_form and int(saved["dp_world_size"]) == engine.dp_world_size:
        with _guarded_files(engine, trust_checkpoint), _deepspeed_loads(trust_checkpoint):
            path, client_state = engine.load_checkpoint(os.path.dirname(ckpt_dir), tag=os.path.basename(ckpt_dir))
        if path is None:
            raise CheckpointError(f"DeepSpeed could not load {ckpt_dir}")
        return ckpt_dir, client_state
    consolidated = consolidate_checkpoint(ckpt_dir, trust_checkpoint=trust_checkpoint)
    return ckpt_dir, load_fp32_checkpoint(engine, consolidated)


def _bf16_masters_live(engine) -> bool:
    opt = coat_optimizer(engine)
    return opt is not None and any(g.get("master_weights", "fp32") != "fp32" for g in opt.param_groups)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Convert a CoatAdamW DeepSpeed checkpoint to per-parameter FP32 "
                                 "(weights + AdamW moments), loadable at any data-parallel size.")
    ap.add_argument("checkpoint_dir", help="the save_dir given to engine.save_checkpoint")
    ap.add_argument("output", help="output .pt file")
    ap.add_argument("--tag", default=None, help="checkpoint tag (default: the newest complete checkpoint)")
    ap.add_argument("--trust-checkpoint", action="store_true",
                    help="unpickle types besides those DeepSpeed writes (only for a checkpoint from a trusted source)")
    args = ap.parse_args(argv)
    ckpt = consolidate_checkpoint(args.checkpoint_dir, args.tag, trust_checkpoint=args.trust_checkpoint)
    with atomic_write(args.output, "wb") as f:  # a crash leaves no truncated output behind
        torch.save(ckpt, f)
    n = sum(t.numel() for t in ckpt["params"].values())
    print(f"wrote {args.output}: {len(ckpt['params'])} tensors, {n:,} params, step {ckpt['step']:g}, "
          f"from ZeRO-{ckpt['zero_stage']} at world size {ckpt['world_size']}")


if __name__ == "__main__":
    main()
