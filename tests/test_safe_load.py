"""Checkpoint loads unpickle nothing but what torch, DeepSpeed and coat_ds write.

A crafted file whose pickle calls `builtins.eval` (which would create a marker file) sits where
each loader reads: a DeepSpeed optimizer-states or model-states file, a consolidated FP32
file, DCP's `.metadata`, one of DCP's pickled values, a train.py checkpoint folder. Every load
must refuse it with a `CheckpointError` naming the global and the file, the marker must not
appear, and `trust_checkpoint=True` (train.py: `--trust-checkpoint`) must load it. Real
checkpoints (ZeRO-1/2/3 on 2 gloo ranks, FSDP2 DCP) load with the default.

Run as a script this file is the DeepSpeed worker that `torchrun` starts.
"""
from __future__ import annotations

import dataclasses
import glob
import io
import json
import os
import pickle
import shutil
import sys
import types

import pytest
import torch

from coat_ds.io.checkpoint_folders import RECORD, find_checkpoint

from coat_ds.io.safe_load import CheckpointError, load_file
from helpers import end_worker, run_failing_in_repo, run_in_repo, run_ranks

GLOBAL = "builtins.eval"


class Payload:
    """Unpickles by calling builtins.eval, which creates `marker` and returns `value`."""

    def __init__(self, marker, value=None):
        self.marker, self.value = os.fspath(marker), value

    def __reduce__(self):
        return eval, (f"(open({self.marker!r}, 'w').close(), {self.value!r})[1]",)


def _add_payload(path, marker) -> None:
    """Rewrite the torch.save file `path` (a dict) with a payload under an extra key."""
    sd = torch.load(path, weights_only=False)  # written by this test: trusted
    sd["payload"] = Payload(marker)
    torch.save(sd, path)


def _crafted_copy(folder, name: str) -> str:
    """A copy of checkpoint `folder` without its completion record (its files will change)."""
    copy = os.path.join(os.path.dirname(folder), name)
    shutil.copytree(folder, copy)
    os.remove(os.path.join(copy, RECORD))
    return copy


def _assert_refused(message: str, path) -> None:
    assert f"refusing to load {path}" in message and GLOBAL in message, message
    assert "trust_checkpoint=True" in message, message


# -- one process --------------------------------------------------------------------------------


@pytest.mark.parametrize("zipped", [True, False])
def test_crafted_file_is_refused_unless_trusted(tmp_path, zipped):
    path, marker = tmp_path / "crafted.pt", tmp_path / "ran"
    torch.save({"weight": torch.ones(2), "payload": Payload(marker, 7)}, path, _use_new_zipfile_serialization=zipped)
    with pytest.raises(CheckpointError) as err:
        load_file(path)
    assert not marker.exists()
    if zipped:
        _assert_refused(str(err.value), path)
    else:  # torch cannot list a legacy file's globals; its own words name the function
        assert f"refusing to load {path}" in str(err.value) and "eval" in str(err.value), err.value
    got = load_file(path, trust_checkpoint=True)
    assert marker.exists() and got["payload"] == 7 and torch.equal(got["weight"], torch.ones(2))


def test_consolidated_fp32_file_is_refused_unless_trusted(tmp_path):
    from coat_ds.integrations.deepspeed.checkpoint import FORMAT, load_fp32_checkpoint

    path, marker = tmp_path / "fp32.pt", tmp_path / "ran"
    torch.save({"format": FORMAT, "params": {}, "payload": Payload(marker)}, path)
    no_coat = types.SimpleNamespace(optimizer=None)  # the file is read before the engine is used
    with pytest.raises(CheckpointError) as err:
        load_fp32_checkpoint(no_coat, path)
    _assert_refused(str(err.value), path)
    assert not marker.exists()
    with pytest.raises(ValueError, match="the engine's optimizer is not CoatAdamW"):
        load_fp32_checkpoint(no_coat, path, trust_checkpoint=True)
    assert marker.exists()


def test_deepspeed_fp16_loss_scaler_is_allowed(tmp_path):
    """fp16 ZeRO checkpoints hold DeepSpeed's dynamic loss scaler (fp16 cannot run on this
    CPU, so the object DeepSpeed stores is saved here directly)."""
    from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler

    from coat_ds.integrations.deepspeed.checkpoint import _read

    scaler = CreateLossScaler(torch.half, 0, True, {"init_scale": 2.0**16, "scale_window": 1000, "min_scale": 1,
                                                    "delayed_shift": 2, "consecutive_hysteresis": False})
    scaler.cur_scale, scaler.cur_iter, scaler.last_overflow_iter = 2.0**15, 7, 6  # as after an overflow
    torch.save({"loss_scaler": scaler}, tmp_path / "optim_states.pt")
    got = _read(str(tmp_path / "optim_states.pt"))["loss_scaler"]
    assert type(got) is type(scaler) and vars(got) == vars(scaler)


def test_crafted_dcp_metadata_is_refused_by_find_checkpoint(tmp_path):
    from torch.distributed.checkpoint.metadata import Metadata

    folder, marker = tmp_path / "step1", tmp_path / "ran"
    folder.mkdir()
    metadata = Metadata(state_dict_metadata={}, storage_data={})
    metadata.payload = Payload(marker)
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(CheckpointError) as err:
        find_checkpoint(folder)
    _assert_refused(str(err.value), folder / ".metadata")
    assert not marker.exists()
    assert find_checkpoint(folder, trust_checkpoint=True).path == str(folder)
    assert marker.exists()


def test_forced_unsafe_loads_are_named_with_the_two_ways_out(tmp_path, monkeypatch):
    """TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD set, torch refuses every weights-only load: each entry
    point says so before reading (DCP would wrap it per rank), trusting loads as it asks."""
    from coat_ds.integrations.deepspeed.checkpoint import load_checkpoint as deepspeed_load
    from coat_ds.integrations.fsdp import load_checkpoint_folder

    path = tmp_path / "mp_rank_00_model_states.pt"  # a sound file, DeepSpeed's name
    torch.save({"dp_world_size": 1, "weight": torch.ones(2)}, path)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    for load in (lambda: load_file(path), lambda: deepspeed_load(None, str(tmp_path)),
                 lambda: load_checkpoint_folder(tmp_path, None, None)):  # refused before the engine is used
        with pytest.raises(CheckpointError) as err:
            load()
        msg = str(err.value)
        assert "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 is set" in msg and "unset TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD" in msg
        assert "--trust-checkpoint" in msg, msg
    assert torch.equal(load_file(path, trust_checkpoint=True)["weight"], torch.ones(2))
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0")  # torch's "off"
    assert load_file(path)["dp_world_size"] == 1


def test_trust_checkpoint_flag_and_yaml_key(tmp_path):
    from coat_ds.train.config import parse_config

    assert parse_config([]).trust_checkpoint is False
    assert parse_config(["--trust-checkpoint"]).trust_checkpoint is True
    (tmp_path / "run.yaml").write_text("trust_checkpoint: true\n")
    assert parse_config(["--config", str(tmp_path / "run.yaml")]).trust_checkpoint is True
    (tmp_path / "bad.yaml").write_text("trust_checkpoint: maybe\n")
    with pytest.raises(SystemExit, match="trust_checkpoint"):
        parse_config(["--config", str(tmp_path / "bad.yaml")])


# -- DeepSpeed: 2 ranks on gloo ---------------------------------------------------------------


def worker_deepspeed(out: str) -> None:
    """Per ZeRO stage: save through coat_ds, load the real checkpoint by default (state
    bit-exact), then a copy whose optimizer-states file of rank 1 carries a payload: refused
    on every rank, rank 0 (whose own file is sound) included, then loaded with
    trust_checkpoint=True."""
    import torch.distributed as dist

    from coat_ds.integrations.deepspeed.engine import coat_optimizer
    from coat_ds.integrations.deepspeed.checkpoint import load_checkpoint, save_checkpoint
    from test_deepspeed_zero import _data, _engine, _same_state, _snapshot, _train

    data, results = _data(), {}
    for stage in (1, 2, 3):
        engine = _engine(stage)
        rank = engine.global_rank
        _train(engine, data, range(2), [rank])
        real = save_checkpoint(engine, os.path.join(out, f"zero{stage}"), "step2", {"step": 2})
        saved = _snapshot(coat_optimizer(engine))
        fresh = _engine(stage)
        _, client = load_checkpoint(fresh, os.path.dirname(real))
        r = {"real_loads": client["step"] == 2 and _same_state(saved, coat_optimizer(fresh))}

        crafted = os.path.join(out, f"zero{stage}", "crafted")
        if rank == 0:
            _crafted_copy(real, "crafted")
        dist.barrier()
        (refused,) = glob.glob(os.path.join(crafted, "*zero_pp_rank_1_mp_rank_00_optim_states.pt"))
        marker = os.path.join(out, f"ran_zero{stage}")
        if rank == 1:
            _add_payload(refused, marker)
        dist.barrier()
        target = _engine(stage)
        try:
            load_checkpoint(target, crafted)
            r["refusal"] = None
        except CheckpointError as e:
            r["refusal"] = str(e)
        r["file"], r["ran_untrusted"] = refused, os.path.exists(marker)
        dist.barrier()
        _, client = load_checkpoint(target, crafted, trust_checkpoint=True)
        dist.barrier()  # rank 1 has unpickled its file
        r["ran_trusted"] = os.path.exists(marker)
        r["trusted_loads"] = client["step"] == 2 and _same_state(saved, coat_optimizer(target))
        results[stage] = r
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


@pytest.mark.slow
def test_deepspeed_loads_refuse_crafted_files(tmp_path):
    run_ranks(__file__, str(tmp_path), timeout=600, DS_ACCELERATOR="cpu")
    for rank in range(2):
        for stage, r in json.load(open(tmp_path / f"rank{rank}.json")).items():
            assert r["real_loads"], (rank, stage)
            _assert_refused(r["refusal"] or "", r["file"])
            assert not r["ran_untrusted"] and r["ran_trusted"] and r["trusted_loads"], (rank, stage, r)

    # Offline, one process: the converter reads every rank's file, and the model states.
    from coat_ds.integrations.deepspeed.checkpoint import consolidate_checkpoint, main

    crafted = tmp_path / "zero2" / "crafted"
    for marker in tmp_path.glob("ran_*"):
        marker.unlink()
    with pytest.raises(CheckpointError) as err:
        consolidate_checkpoint(str(crafted))
    _assert_refused(str(err.value), glob.glob(str(crafted / "*rank_1_mp_rank_00_optim_states.pt"))[0])
    with pytest.raises(CheckpointError, match=GLOBAL):
        main([str(crafted), str(tmp_path / "fp32.pt")])
    assert not list(tmp_path.glob("ran_*")) and not (tmp_path / "fp32.pt").exists()
    main([str(crafted), str(tmp_path / "fp32.pt"), "--trust-checkpoint"])
    assert (tmp_path / "ran_zero2").exists() and (tmp_path / "fp32.pt").exists()

    model_states = tmp_path / "zero1" / "crafted" / "mp_rank_00_model_states.pt"
    _add_payload(model_states, tmp_path / "ran_model_states")
    with pytest.raises(CheckpointError) as err:
        consolidate_checkpoint(str(model_states.parent))
    _assert_refused(str(err.value), model_states)
    assert not (tmp_path / "ran_model_states").exists()


# -- FSDP2: 2 ranks on gloo ---------------------------------------------------------------------


def _craft_metadata(real: str, marker: str) -> str:
    """A copy of the DCP checkpoint `real` whose `.metadata` carries a payload."""
    crafted = _crafted_copy(real, "crafted_metadata")
    with open(os.path.join(crafted, ".metadata"), "rb") as f:
        metadata = pickle.load(f)  # written by this test: trusted
    metadata.payload = Payload(marker)
    with open(os.path.join(crafted, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    return crafted


def _craft_value(real: str, fqn: str, value, marker: str) -> tuple[str, str]:
    """A copy of `real` in which DCP's pickled value `fqn` unpickles through the payload
    (to `value`); returns the copy and the data file holding it."""
    crafted = _crafted_copy(real, "crafted_value")
    with open(os.path.join(crafted, ".metadata"), "rb") as f:
        metadata = pickle.load(f)
    buf = io.BytesIO()
    torch.save(Payload(marker, value), buf)
    for index, info in list(metadata.storage_data.items()):
        if index.fqn == fqn:  # appended to its data file, the index pointed there
            data = os.path.join(crafted, info.relative_path)
            offset = os.path.getsize(data)
            with open(data, "ab") as f:
                f.write(buf.getvalue())
            metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(buf.getvalue()))
    with open(os.path.join(crafted, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    return crafted, data


def _fsdp_worker(rank, world, init, out):
    import torch.distributed as dist

    from coat_ds.integrations.fsdp import load_checkpoint, load_checkpoint_folder, save_checkpoint, setup_fsdp
    from test_fsdp import LR, Net, _init, _local_state, _optim, _train

    _init(rank, world, init)

    def fresh():
        torch.manual_seed(1)
        model = setup_fsdp(Net(300), mode="fsdp2")
        return model, _optim(model.parameters())

    torch.manual_seed(0)
    model = setup_fsdp(Net(300), mode="fsdp2")
    optim = _optim(model.parameters())
    _train(model, optim, range(2), rank, world)
    real = save_checkpoint(os.path.join(out, "real"), model, optim, step=2)
    saved = _local_state(optim)
    markers = {"metadata": os.path.join(out, "ran_metadata"), "value": os.path.join(out, "ran_value")}
    if rank == 0:
        _craft_metadata(real, markers["metadata"])
        _craft_value(real, "optim.param_groups.0.lr", LR, markers["value"])
    dist.barrier()
    crafted = {"metadata": os.path.join(out, "crafted_metadata"), "value": os.path.join(out, "crafted_value")}

    def same_state(optim2) -> bool:
        return all(torch.equal(a[k].view(-1), b[k].view(-1)) for a, b in zip(saved, _local_state(optim2)) for k in a)

    m2, o2 = fresh()
    result = {"real_loads": load_checkpoint(real, m2, o2) == 2 and same_state(o2)}
    for name, folder in crafted.items():
        for how, load in (("search", load_checkpoint), ("folder", load_checkpoint_folder)):
            try:
                load(folder, *fresh())
                result[f"{name}_{how}"] = None
            except BaseException as e:  # DCP raises a failure on any rank as CheckpointException everywhere
                result[f"{name}_{how}"] = str(e)
        result[f"{name}_ran_untrusted"] = os.path.exists(markers[name])
    dist.barrier()
    for name, folder in crafted.items():
        m2, o2 = fresh()
        result[f"{name}_trusted_loads"] = (load_checkpoint(folder, m2, o2, trust_checkpoint=True) == 2
                                           and same_state(o2) and o2.param_groups[0]["lr"] == LR)
        result[f"{name}_ran_trusted"] = os.path.exists(markers[name])
    with open(os.path.join(out, f"fsdp_rank{rank}.json"), "w") as f:
        json.dump(result, f)
    end_worker()


@pytest.mark.slow
def test_fsdp_loads_refuse_crafted_files(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_fsdp_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    metadata = tmp_path / "crafted_metadata" / ".metadata"
    with open(tmp_path / "crafted_value" / ".metadata", "rb") as f:
        value_files = {info.relative_path for index, info in pickle.load(f).storage_data.items()
                       if index.fqn == "optim.param_groups.0.lr"}
    for rank in range(2):
        r = json.load(open(tmp_path / f"fsdp_rank{rank}.json"))
        assert r["real_loads"], r
        _assert_refused(r["metadata_search"] or "", metadata)
        _assert_refused(r["metadata_folder"] or "", metadata)
        for how in ("search", "folder"):
            assert any(f"refusing to load {tmp_path / 'crafted_value' / name}" in (r[f"value_{how}"] or "")
                       for name in value_files), r[f"value_{how}"]
            assert GLOBAL in r[f"value_{how}"]
        for name in ("metadata", "value"):
            assert not r[f"{name}_ran_untrusted"] and r[f"{name}_ran_trusted"] and r[f"{name}_trusted_loads"], r


# -- train.py --resume ------------------------------------------------------------------------


@pytest.mark.slow
def test_train_py_resume_refuses_crafted_checkpoint(tmp_path):
    common = [sys.executable, "train.py", "--fsdp", "--config", "configs/tiny.yaml", "--eval-interval", "0",
              "--eval-batches", "1", "--max-data-bytes", "100000"]
    run_in_repo([*common, "--max-steps", "1", "--save-dir", str(tmp_path / "ckpt")], timeout=300)
    crafted = _craft_metadata(str(tmp_path / "ckpt" / "step1"), str(tmp_path / "ran"))
    resume = [*common, "--max-steps", "2", "--resume", crafted]
    proc = run_failing_in_repo(resume, timeout=300)
    _assert_refused(proc.stderr, os.path.join(crafted, ".metadata"))
    assert "--trust-checkpoint" in proc.stderr and not (tmp_path / "ran").exists()
    proc = run_in_repo([*resume, "--trust-checkpoint"], timeout=300)
    assert f"resumed from {crafted} at step 1" in proc.stdout and (tmp_path / "ran").exists()


if __name__ == "__main__":
    worker_deepspeed(sys.argv[1])
    end_worker()
