"""Checkpoint folders appear only once complete, saves never touch an existing one, resume
picks the newest complete one, damaged files fail with their path; the atomic-write helper
and the metrics log. One process here; on 2 gloo ranks: test_fsdp.py (a failed save and a
save over an existing folder), test_train.py and test_train_fsdp.py (runs killed in a save)."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time

import pytest

from coat_ds.io.atomic import atomic_write
from coat_ds.io.checkpoint_folders import (
    LATEST,
    RECORD,
    check_new_checkpoints,
    find_checkpoint,
    staged_save,
    staging_path,
)
from coat_ds.io.safe_load import CheckpointError
from coat_ds.train.metrics import MetricsLog


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

    # A save that fails part-way, on a full disk (/dev/full fails every write with the kernel's
    # ENOSPC): the error names the folder and the cause, the partial folder is gone, nothing
    # named step4, `latest` unchanged, resume takes step2.
    with pytest.raises(CheckpointError, match=f"saving {save / 'step4'} failed on rank\\(s\\) \\[0\\]: ENOSPC: No "
                                              f"space left on device; .* partial save .*removed .*untouched"):
        with staged_save(save / "step4", 4) as staging:
            open(os.path.join(staging, "small.bin"), "wb").write(b"half")
            os.symlink("/dev/full", os.path.join(staging, "data.bin"))
            with open(os.path.join(staging, "data.bin"), "wb") as f:
                f.write(b"x" * 100)
    assert not (save / "step4").exists() and not os.path.exists(staging_path(save / "step4"))
    assert (save / LATEST).read_text() == "step2"
    found = find_checkpoint(save)
    assert found.path == str(save / "step2") and found.step == 2 and not found.skipped

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


@contextlib.contextmanager
def _unwritable(folder):
    """`folder` made unwritable: its mode 0555, or, for root (whom modes do not stop), its
    immutable attribute (chattr +i); skips the test where neither holds."""
    os.chmod(folder, 0o555)
    immutable = False
    try:
        if os.access(folder, os.W_OK):
            immutable = subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0
            if not immutable:
                pytest.skip("cannot make a folder unwritable here (root, and no chattr +i)")
        yield
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(folder)], check=True)
        os.chmod(folder, 0o755)


@pytest.mark.slow  # chattr, for root
def test_save_into_an_unwritable_folder_fails_naming_it_and_keeps_the_last_checkpoint(tmp_path):
    save = tmp_path / "ckpt"
    _save(save, "step2", 2)
    with _unwritable(save):
        with pytest.raises(CheckpointError, match=f"cannot save {save / 'step4'}: cannot create "
                                                  f"{staging_path(save / 'step4')}: (EACCES: Permission denied|EPERM: "
                                                  "Operation not permitted).*the checkpoints saved before it are "
                                                  "untouched"):
            _save(save, "step4", 4)
        with pytest.raises(CheckpointError, match=f"cannot save checkpoints in {save}: (EACCES|EPERM)"):
            check_new_checkpoints(save, ["step4"])  # what train.py checks before its first step
        found = find_checkpoint(save)  # verified against its record
    assert found.path == str(save / "step2") and (save / "step2" / "data.bin").read_bytes() == b"x" * 100
    assert sorted(os.listdir(save)) == [LATEST, "step2"] and (save / LATEST).read_text() == "step2"
    _save(save, "step4", 4)  # writable again: the save goes through
    assert find_checkpoint(save).step == 4


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


def test_save_removes_the_latest_temp_file_a_kill_left(tmp_path):
    save = tmp_path / "ckpt"
    _save(save, "step2", 2)
    # What a kill inside atomic_write(save/latest) leaves: its temporary file, never renamed.
    killed = save / ".latest.k1ll3d.tmp"
    killed.write_text("step")
    os.utime(killed, (time.time() - 3600, time.time() - 3600))
    live = save / ".latest.w0rk1n.tmp"  # another write of `latest` still under way: kept
    live.write_text("")
    other = save / ".metrics.jsonl.x.tmp"  # not `latest`'s: kept
    other.write_text("")
    os.utime(other, (time.time() - 3600, time.time() - 3600))
    _save(save, "step4", 4)
    assert not killed.exists() and live.exists() and other.exists()
    assert (save / LATEST).read_text() == "step4" and find_checkpoint(save).path == str(save / "step4")


def test_staging_folder_with_every_file_and_its_record_is_reported_as_unpublished(tmp_path):
    save = tmp_path / "ckpt"
    _save(save, "step2", 2)
    # A kill of rank 0 between writing the record and the rename: the staging folder holds the
    # whole checkpoint and its record, `latest` still names the previous one.
    _save(save, "step4", 4)
    os.rename(save / "step4", staging_path(save / "step4"))
    (save / LATEST).write_text("step2")
    os.makedirs(staging_path(save / "step6"))  # killed while ranks were writing: no record
    found = find_checkpoint(save)
    assert found.path == str(save / "step2")
    why = dict(found.skipped)
    unpublished = why[staging_path(save / "step4")]
    assert "complete save of step 4 that was never published" in unpublished
    assert "rename it to 'step4'" in unpublished and "stopped before every rank had written" not in unpublished
    assert "no completion record" in why[staging_path(save / "step6")]
    with pytest.raises(CheckpointError, match="never published"):
        find_checkpoint(staging_path(save / "step4"))
    # Its record still vouches for its files: a damaged one is not called complete.
    with open(os.path.join(staging_path(save / "step4"), "data.bin"), "r+b") as f:
        f.truncate(10)
    assert "data.bin has 10 bytes" in dict(find_checkpoint(save).skipped)[staging_path(save / "step4")]
    with open(os.path.join(staging_path(save / "step4"), "data.bin"), "ab") as f:
        f.write(b"x" * 90)
    # Following the advice publishes it.
    os.rename(staging_path(save / "step4"), save / "step4")
    assert find_checkpoint(save).path == str(save / "step4")

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
