"""What a new user meets first: train.py and `coat_ds.deepspeed_initialize` under plain `python`
(no launcher: a world of one) and from a directory other than the repository (the shipped
configs found there), and the start-up lines that say what a long wait is."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest

from helpers import ROOT

import coat_ds
from coat_ds.train.engine_setup import clipping_off_note
from coat_ds.integrations.deepspeed.engine import LAUNCH_VARS, comm_op_build_note, single_process_world
from coat_ds.train.config import parse_config
from coat_ds.config.shipped import find_ds_config, shipped_dirs

TRAIN = os.path.join(ROOT, "train.py")
_ALL_LAUNCH_VARS = LAUNCH_VARS + ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK",
                                  "MV2_COMM_WORLD_SIZE")


def _run_bare(cmd: list[str], cwd, timeout: int = 300) -> subprocess.CompletedProcess:
    """`cmd` from `cwd` as a user's shell would start it: no launcher variables at all."""
    env = {k: v for k, v in os.environ.items() if k not in _ALL_LAUNCH_VARS}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return proc


@pytest.fixture
def no_launcher(monkeypatch):
    """This process's environment without launcher variables, restored afterwards (the function
    under test sets some)."""
    for var in _ALL_LAUNCH_VARS:
        monkeypatch.setenv(var, "")  # recorded, so that undo restores or removes it
        monkeypatch.delenv(var)
    return monkeypatch


# -- plain python, from another directory ----------------------------------------------------

@pytest.mark.slow
def test_train_py_deepspeed_plain_python_from_another_directory(tmp_path):
    # Its own defaults (ds_configs/coat_zero2.json) and configs/tiny.yaml, named as in the README.
    proc = _run_bare([sys.executable, TRAIN, "--config", "configs/tiny.yaml", "--max-steps", "2",
                      "--log-interval", "1", "--eval-batches", "1"], tmp_path)
    out = proc.stdout
    assert "no launcher: running as one process, a world of one (RANK=0 WORLD_SIZE=1" in out
    assert f"deepspeed: {os.path.join(ROOT, 'ds_configs', 'coat_zero2.json')}" in out  # the file used
    assert out.index("loading data: Python's standard-library sources") < out.index("data: stdlib sources")
    # Each long wait is announced before it: the settings come before the process group (and its
    # op build), data and engine set-up each have a line, the first step's kernel load too.
    assert out.index("resolved config:") < out.index("deepspeed_shm_comm_op built successfully")
    assert "setting up the deepspeed engine with" in out
    assert "training steps 1 to 2, a log line every 1 steps (the first step also loads CoatAdamW's C++ host step" in out
    assert "1 rank(s)" in out and "step 2/2 (100%)" in out and "eval loss" in out
    assert "untested optimizer" not in proc.stdout + proc.stderr
    assert "gradient clipping: OFF" not in out  # the shipped JSON clips at 1.0


@pytest.mark.slow
def test_train_py_fsdp_plain_python_says_clipping_is_off_once(tmp_path):
    ds = json.load(open(os.path.join(ROOT, "ds_configs", "coat_zero2.json")))
    ds["gradient_clipping"] = -1.0
    (tmp_path / "noclip.json").write_text(json.dumps(ds))
    proc = _run_bare([sys.executable, TRAIN, "--fsdp", "--deepspeed", "noclip.json", "--config", "configs/tiny.yaml",
                      "--max-steps", "2", "--log-interval", "1", "--eval-batches", "1"], tmp_path)
    out = proc.stdout
    assert "no launcher: running as one process" in out and "step 2/2 (100%)" in out
    assert out.count("gradient clipping: OFF") == 1
    assert "gradient clipping: OFF (gradient_clipping is -1.0 in noclip.json; a value <= 0 turns it off" in out


@pytest.mark.slow
def test_deepspeed_initialize_plain_python_from_another_directory(tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(
        "import torch\n"
        "import coat_ds\n"
        "from coat_ds.models.llama import Llama, model_config\n"
        "model = Llama(model_config('tiny'))\n"
        "engine, optimizer, _, _ = coat_ds.deepspeed_initialize(model=model, config='ds_configs/coat_zero2.json',\n"
        "                                                       model_parameters=model.parameters())\n"
        "x = torch.randint(0, 256, (engine.train_micro_batch_size_per_gpu(), 16))\n"
        "before = [p.detach().clone() for p in model.parameters()]\n"
        "engine.backward(engine(x, x))\n"
        "engine.step()\n"
        "moved = sum(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))\n"
        "print('params moved', moved, 'of', len(before), 'world', torch.distributed.get_world_size(), flush=True)\n"
        "torch.distributed.destroy_process_group()\n")
    proc = _run_bare([sys.executable, str(script)], tmp_path)
    assert "no launcher: running as one process" in proc.stdout
    assert "CoatAdamW rank 0" in proc.stdout and "world 1" in proc.stdout
    assert int(proc.stdout.split("params moved ")[1].split()[0]) > 0  # the step ran
    assert "untested optimizer" not in proc.stdout + proc.stderr


# -- the pieces --------------------------------------------------------------------------------

def test_single_process_world_sets_up_what_torchrun_would(no_launcher):
    line = single_process_world()
    assert line.startswith("no launcher: running as one process")
    assert "deepspeed script.py" in line and "torchrun --nproc_per_node N" in line
    env = {v: os.environ[v] for v in LAUNCH_VARS + ("LOCAL_WORLD_SIZE",)}
    assert env["RANK"] == env["LOCAL_RANK"] == "0" and env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "1"
    assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
    assert single_process_world() is None  # the variables are there now


def test_single_process_world_keeps_a_launchers_variables(no_launcher):
    for var, value in zip(LAUNCH_VARS, ("3", "4", "1", "10.0.0.2", "29500")):
        no_launcher.setenv(var, value)
    assert single_process_world() is None
    assert os.environ["RANK"] == "3" and os.environ["WORLD_SIZE"] == "4"


def test_single_process_world_refuses_half_set_variables(no_launcher):
    no_launcher.setenv("RANK", "1")
    with pytest.raises(RuntimeError, match=r"launcher variables half set \(RANK=1; missing WORLD_SIZE, LOCAL_RANK, "
                                           r"MASTER_ADDR, MASTER_PORT\): start it with `deepspeed script.py`") as e:
        single_process_world()
    assert "\n" not in str(e.value) and "torchrun --nproc_per_node N" in str(e.value)
    assert "WORLD_SIZE" not in os.environ


def test_single_process_world_under_mpi(no_launcher):
    import importlib.util

    no_launcher.setenv("OMPI_COMM_WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"MPI launcher \(OMPI_COMM_WORLD_SIZE=2\), which this engine cannot read: "
                                           r"start it with `torchrun"):
        single_process_world(mpi=False)
    if importlib.util.find_spec("mpi4py") is None:
        with pytest.raises(RuntimeError, match="mpi4py, which DeepSpeed reads it with, is not installed"):
            single_process_world()
    else:
        assert single_process_world() is None  # DeepSpeed reads the MPI launch itself
    assert "RANK" not in os.environ


def test_comm_op_build_note_only_before_the_first_build(tmp_path, monkeypatch):
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        pytest.skip("the shared-memory op is DeepSpeed's CPU accelerator's")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    note = comm_op_build_note()
    assert note.startswith("DeepSpeed: building its CPU shared-memory comm op (deepspeed_shm_comm)")
    assert "one-time build, about 2 minutes" in note and str(tmp_path / "deepspeed_shm_comm") in note
    (tmp_path / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").write_bytes(b"")  # where torch caches the build
    assert comm_op_build_note() is None


def test_clipping_off_note():
    for clip in (0, 0.0, -1.0):
        assert clipping_off_note({"gradient_clipping": clip}) == (
            f"gradient clipping: OFF (gradient_clipping is {clip} in DeepSpeed config; a value <= 0 turns it off, "
            "as in DeepSpeed)")
    assert clipping_off_note({"gradient_clipping": 0.5}) is None
    assert clipping_off_note({}) is None  # DeepSpeed's default clips at 1.0


def test_quiet_known_warnings_silences_only_deepspeeds_deprecated_collectives(monkeypatch):
    monkeypatch.syspath_prepend(ROOT)
    import train

    message = ("`torch.distributed.all_gather_into_tensor` is deprecated. Please use "
               "`torch.distributed.all_gather_single` instead.")
    zero3 = ("`torch.distributed.reduce_scatter_tensor` is deprecated. Please use "
             "`torch.distributed.reduce_scatter_single` instead.")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        train.quiet_known_warnings()
        for text, category, module in [(message, FutureWarning, "torch.distributed.c10d_logger"),
                                       (zero3, FutureWarning, "torch.distributed.c10d_logger"),
                                       (message, FutureWarning, "my_script"),
                                       ("another deprecation", FutureWarning, "torch.distributed.c10d_logger"),
                                       (message, UserWarning, "torch.distributed.c10d_logger")]:
            warnings.warn_explicit(text, category, "x.py", 1, module=module)
    assert [(str(w.message), w.category) for w in seen] == [
        (message, FutureWarning), ("another deprecation", FutureWarning), (message, UserWarning)]


# -- shipped configs from any directory --------------------------------------------------------

def test_ds_config_found_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert find_ds_config("ds_configs/coat_zero2.json") == os.path.join(ROOT, "ds_configs", "coat_zero2.json")
    cfg = parse_config(["--config", "configs/tiny.yaml"])  # the defaults and the README's preset
    assert cfg.deepspeed == os.path.join(ROOT, "ds_configs", "coat_zero2.json") and cfg.preset == "tiny"
    # A file that exists from the working directory wins over the shipped one.
    (tmp_path / "ds_configs").mkdir()
    (tmp_path / "ds_configs" / "coat_zero2.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 3}))
    assert find_ds_config("ds_configs/coat_zero2.json") == "ds_configs/coat_zero2.json"


def test_ds_config_not_found_names_the_path_and_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    looked = f"(relative paths start at {tmp_path}; ds_configs/<name> is also looked up in {', '.join(shipped_dirs())})"
    with pytest.raises(FileNotFoundError) as e:
        find_ds_config("ds_configs/nope.json")
    assert str(e.value) == f"DeepSpeed config file not found: ds_configs/nope.json {looked}"
    with pytest.raises(SystemExit) as e:
        parse_config(["--deepspeed", "ds_configs/nope.json"])
    assert str(e.value) == f"--deepspeed: DeepSpeed config file not found: ds_configs/nope.json {looked}"
    with pytest.raises(SystemExit, match=r"--config: YAML settings file not found: configs/nope.yaml \(relative "
                                         rf"paths start at {tmp_path}; configs/<name> is also looked up in "):
        parse_config(["--config", "configs/nope.yaml"])
    with pytest.raises(FileNotFoundError, match=r"DeepSpeed config file not found: ds_configs/nope.json \(relative"):
        coat_ds.deepspeed_initialize(model=None, config="ds_configs/nope.json")


@pytest.mark.slow
def test_train_py_traces_three_steps_after_warm_up(tmp_path):
    """--trace: rank 0's torch.profiler trace of the 3 steps after --trace-after, said in the
    log; a trace that would never start is refused, naming the key."""
    import gzip

    path = tmp_path / "traces" / "t.json.gz"
    proc = _run_bare([sys.executable, TRAIN, "--fsdp", "--config", "configs/tiny.yaml", "--max-steps", "5",
                      "--log-interval", "5", "--eval-batches", "1", "--trace", str(path), "--trace-after", "1"], tmp_path)
    assert f"tracing steps 2 to 4 into {path}" in proc.stdout
    assert f"trace of 3 step(s) written to {path}" in proc.stdout and "step 5/5 (100%)" in proc.stdout
    assert os.listdir(path.parent) == ["t.json.gz"]  # written beside, then renamed into place
    with gzip.open(path, "rt") as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    assert "aten::mm" in names or "aten::addmm" in names
    bad = subprocess.run([sys.executable, TRAIN, "--config", "configs/tiny.yaml", "--max-steps", "5", "--trace",
                          str(path), "--trace-after", "5"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "trace_after" in bad.stderr + bad.stdout and "never start" in bad.stderr + bad.stdout
