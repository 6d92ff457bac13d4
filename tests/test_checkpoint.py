"""Checkpoint folders appear only once complete, saves never touch an existing one, resume
picks the newest complete one, damaged files fail with their path; the atomic-write helper
and the metrics log. One process here; 2 real gloo ranks for FSDP2 (kill-and-resume of whole
training runs is in test_train.py and test_train_fsdp.py)."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from coat_ds.atomic import atomic_write
from coat_ds.checkpoint import (
    LATEST,
    RECORD,
    CheckpointError,
    check_new_checkpoints,
    find_checkpoint,
    staged_save,
    staging_path,
)
from coat_ds.metrics import MetricsLog


def _save(save_dir, name, step, payload=b"x" * 100):
    with staged_save(save_dir / name, step, engine="test") as staging:
        with open(os.path.join(staging, "data.bin"), "wb") as f:
            f.write(payload)
    return save_dir / name


def test_atomic_write_replaces_whole_or_not_at_all(tmp_path):
    path = tmp_path / "out.json"
    path.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_write(path) as f:
            f.write("half of the new cont")
            raise RuntimeError("crash mid-write")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["out.json"]
    with atomic_write(path) as f:
        f.write("new")
    assert path.read_text() == "new" and os.listdir(tmp_path) == ["out.json"]
    with pytest.raises(ValueError, match="mode"):
        with atomic_write(path, "a"):
            pass


def test_profiler_json_keeps_the_previous_file_when_writing_fails(tmp_path):
    from coat_ds.profile.report import write_json

    path = tmp_path / "profile.json"
    write_json({"a": 1}, str(path))
    with pytest.raises(TypeError):
        write_json({"a": 2, "b": object()}, str(path))  # json.dump fails half-way through
    assert json.loads(path.read_text()) == {"a": 1} and os.listdir(tmp_path) == ["profile.json"]


def test_staged_save_publishes_only_complete_checkpoints(tmp_path):
    save = tmp_path / "ckpt"
    _save(save, "step2", 2)
    record = json.loads((save / "step2" / RECORD).read_text())
    assert record["step"] == 2 and record["files"] == {"data.bin": 100} and record["world_size"] == 1
    assert (save / LATEST).read_text() == "step2"

    # A save that fails part-way: nothing named step4, `latest` unchanged, resume takes step2.
    with pytest.raises(OSError, match="disk full"):
        with staged_save(save / "step4", 4) as staging:
            open(os.path.join(staging, "data.bin"), "wb").write(b"half")
            raise OSError("disk full")
    assert not (save / "step4").exists() and os.path.isdir(staging_path(save / "step4"))
    assert (save / LATEST).read_text() == "step2"
    found = find_checkpoint(save)
    assert found.path == str(save / "step2") and found.step == 2
    assert [os.path.basename(f) for f, _ in found.skipped] == [".step4.partial"]

    # The same step saved again replaces the leftover staging folder, and becomes the newest.
    _save(save, "step4", 4)
    assert not os.path.exists(staging_path(save / "step4")) and (save / LATEST).read_text() == "step4"

    # An existing checkpoint is never modified: the save fails before writing anything.
    before = (save / "step4" / "data.bin").read_bytes()
    with pytest.raises(FileExistsError, match="step4 already exists"):
        _save(save, "step4", 4, payload=b"other run")
    assert (save / "step4" / "data.bin").read_bytes() == before
    with pytest.raises(FileExistsError, match="step4"):
        check_new_checkpoints(save, ["step3", "step4"])
    check_new_checkpoints(save, ["step6"])

    # A lower step saved later (a resume from step 2 into this folder) does not move `latest` back.
    _save(save, "step3", 3)
    assert (save / LATEST).read_text() == "step4" and find_checkpoint(save).path == str(save / "step4")


def test_resume_choice_and_damaged_files_name_their_path(tmp_path):
    save = tmp_path / "ckpt"
    _save(save, "step2", 2)
    _save(save, "step5", 5)
    (save / "step9").mkdir()  # a torn save of a version without records: model file, no record
    (save / "step9" / "mp_rank_00_model_states.pt").write_bytes(b"PK\x03\x04 cut")
    (save / LATEST).write_text("")  # an empty `latest` must not matter
    found = find_checkpoint(save)
    assert found.path == str(save / "step5") and found.step == 5
    why = dict(found.skipped)
    assert "no completion record" in why[str(save / "step9")] and "names ''" in why[str(save / LATEST)]

    with open(save / "step5" / "data.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(CheckpointError, match=f"{save / 'step5' / 'data.bin'} has 10 bytes"):
        find_checkpoint(save)
    with pytest.raises(CheckpointError, match="step9/mp_rank_00_model_states.pt is truncated"):
        find_checkpoint(save / "step9")  # named directly: loaded unverified, but checked
    os.makedirs(staging_path(save / "step7"))
    with pytest.raises(CheckpointError, match="unfinished save"):
        find_checkpoint(staging_path(save / "step7"))
    os.makedirs(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match=f"no complete checkpoint in {tmp_path / 'empty'}"):
        find_checkpoint(tmp_path / "empty")


def test_metrics_log_appends_only_new_steps(tmp_path):
    path = tmp_path / "m.jsonl"
    log = MetricsLog(path)
    assert log.last_step == 0
    for step in (1, 2, 3):
        assert log.write(step=step, loss=float(step))
    log.close()
    with open(path, "a") as f:
        f.write('{"step": 4, "lo')  # killed mid-line
    log = MetricsLog(path)  # a resume from step 1 replays steps 2, 3 and 4
    assert log.last_step == 3
    assert not log.write(step=2, loss=9.0) and not log.write(step=3, loss=9.0)
    assert log.write(step=4, loss=4.0) and log.write(step=4, eval_loss=4.5)
    log.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0}, {"step": 3, "loss": 3.0},
                     {"step": 4, "loss": 4.0}, {"step": 4, "eval_loss": 4.5}]
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match="m.jsonl, line 2"):
        MetricsLog(path)


# -- FSDP2 on 2 gloo ranks ------------------------------------------------------------------------


def _fsdp2_worker(rank, world, init, save_dir, out):
    from coat_ds import CoatAdamW
    from coat_ds.integrations.fsdp import load_checkpoint, save_checkpoint, setup_fsdp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = setup_fsdp(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 8)), mode="fsdp2")
    optim = CoatAdamW(model.parameters(), lr=1e-2, min_quant_numel=1)

    def step():
        model(torch.randn(4, 64, generator=torch.Generator().manual_seed(rank))).square().mean().backward()
        optim.step()
        optim.zero_grad()

    result = {}
    step()
    save_checkpoint(os.path.join(save_dir, "step1"), model, optim, 1)
    step()
    # Rank 1 fails writing its data file of step2: every rank raises, nothing named step2.
    os.environ["COAT_DS_CKPT_FAULT"] = "rank=1,ckpt=step2,file=distcp,action=raise"
    try:
        save_checkpoint(os.path.join(save_dir, "step2"), model, optim, 2)
    except BaseException as e:  # DCP's CheckpointException, on every rank, naming the failing rank's error
        result["error"] = f"{type(e).__name__}: {e}"
    del os.environ["COAT_DS_CKPT_FAULT"]
    result["step2_exists"] = os.path.exists(os.path.join(save_dir, "step2"))
    try:
        save_checkpoint(os.path.join(save_dir, "step1"), model, optim, 2)
    except FileExistsError as e:
        result["exists_error"] = str(e)
    # `load_checkpoint(save_dir)`: the newest complete checkpoint, step1.
    result["loaded_step"] = load_checkpoint(save_dir, model, optim)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # FSDP state keeps the group alive into finalization: see test_fsdp._finish


def test_fsdp2_failed_save_is_invisible_and_resume_takes_the_newest(tmp_path, capfd):
    save, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    mp.spawn(_fsdp2_worker, args=(2, str(tmp_path / "init"), str(save), str(out)), nprocs=2, join=True)
    r0, r1 = (json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1))
    for r in (r0, r1):
        assert "injected failure writing" in r["error"] and ".step2.partial/__1_0.distcp" in r["error"]
    assert not r0["step2_exists"] and sorted(os.listdir(save)) == [".step2.partial", "latest", "step1"]
    assert "step1 already exists" in r0["exists_error"] and "step1 already exists" in r1["exists_error"]
    assert r0["loaded_step"] == r1["loaded_step"] == 1
    err = capfd.readouterr().err
    assert f"WARNING: skipping {save / '.step2.partial'}" in err
