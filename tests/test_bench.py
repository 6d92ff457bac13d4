"""The bench scripts on CPU: each imports and answers --help, and each CPU-sized mode runs to
its table (a broken script fails here, not on the next device call)."""
import glob
import gzip
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
SCRIPTS = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(BENCH, "[!_]*.py")))

# Each script runs in a process of its own: multi-process, so slow.
pytestmark = pytest.mark.slow


def _load(name: str):
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(BENCH, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(*argv: str, timeout: float = 600) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _last_table(out: str) -> list[str]:
    """The trailing Markdown table of a script's output (what it prints last)."""
    lines = out.rstrip().splitlines()
    start = len(lines)
    while start and lines[start - 1].startswith("|"):
        start -= 1
    assert start < len(lines) - 2, f"no table printed last:\n{out[-2000:]}"
    return lines[start:]


def test_bench_holds_few_short_files():
    # One script per question (and their shared modules and shell helpers), none long.
    files = [f for f in os.listdir(BENCH) if not f.startswith((".", "__"))]
    assert len(files) <= 17, files
    long = {f: n for f in files if (n := sum(1 for _ in open(os.path.join(BENCH, f)))) > 400}
    assert not long, f"bench files over 400 lines (one script per question): {long}"


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_imports_and_answers_help(name, capsys):
    mod = _load(name)
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("argv, rows", [
    (["bench/optim_step.py", "--stub-launch", "--iters", "5"], 3),
    (["bench/optim_step.py", "--host", "--numel", "65536", "--iters", "2", "--no-ds", "--fallback"], 2),
    (["bench/optim_step.py", "--loop", "--tiny"], 3),
    (["bench/activations.py", "--tiny"], 2),
    (["bench/activations.py", "--host", "--steps", "1"], 5),
    (["bench/fp8_linear.py", "--saved-bytes"], 3),
    (["bench/fp8_linear.py", "--census", "--reps", "1"], 6),
    (["bench/fp8_linear.py", "--shape", "tiny", "--sides", "bf16", "coat_fp8", "coat_fp8_fused",
      "coat_fp8_nocomp_headloss", "coat_fp8_nocomp_keepw_headloss", "coat_fp8_nocomp_keepwmlp_headloss",
      "coat_fp8_nocomp_headloss_c8192", "--eager", "--bs", "2", "--seq", "64", "--steps", "1"], 7),
    (["bench/quant_table.py", "--preset", "tiny", "--steps", "3", "--zero-steps", "3"], 2),
])
def test_cpu_mode_prints_its_table(argv, rows):
    table = _last_table(_run(*argv))
    assert len(table) >= 2 + rows and not any("failed" in line for line in table), table


def test_optim_step_ab_runs_each_tree_in_turn(tmp_path):
    """--tree: this tree's and the other tree's runs alternate, a row of both per case."""
    out = _run("bench/optim_step.py", "--stub-launch", "--iters", "3", "--tree", ROOT, "--rounds", "1",
               "--out", str(tmp_path))
    rows = json.loads((tmp_path / "optim_stub_launch_ab.json").read_text())
    assert [r["tree"] for r in rows] == ["other"] * 3 + ["this"] * 3  # step(), step_in_backward, the hooks' floor
    assert _last_table(out)[2].startswith("| 219 tensors, step() |")


def test_parity_seeds_run_apart_then_summary(tmp_path):
    out = _run("bench/parity.py", "--preset", "tiny", "--steps", "4", "--batch-size", "2", "--seq-len",
               "32", "--eval-batches", "1", "--max-data-bytes", "200000", "--variants", "adamw,coat", "--log-interval",
               "0", "--seeds", "1", "2", "--bound", "1", "--out", str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["eager_seed1.json", "eager_seed1.log", "eager_seed1.png",
                                           "eager_seed2.json", "eager_seed2.log", "eager_seed2.png"]
    assert "seeds: [1, 2]" in out and "| coat |" in out
    # The same summary from the saved runs, as --summary gives it.
    assert _load("parity").main(["--summary", *sorted(glob.glob(str(tmp_path / "*.json"))), "--bound", "1"]) == 0


def test_parity_deterministic_repeats_the_fast_recipe_with_the_fp8_head(tmp_path):
    """The variants of the recipe without compression build and train, deterministically;
    one variant run twice from a seed gives the same curve, the FP8 head a different one,
    24-bit master weights (bf16+8) and the max_memory recipe curves of their own close to it,
    and prepare's speed recipe the same curve."""
    _run("bench/parity.py", "--preset", "tiny", "--steps", "3", "--batch-size", "2", "--seq-len", "32",
         "--eval-batches", "1", "--max-data-bytes", "200000", "--pair-vocab", "304", "--deterministic",
         "--variants", "coat_fp8lin_head,coat_fp8lin_head,coat_fp8lin_head8x,coat_fp8lin_head_m8,recipe_speed,"
         "recipe_max_memory", "--log-interval", "0", "--out", str(tmp_path / "det"))
    doc = json.loads((tmp_path / "det.json").read_text())
    assert doc["meta"]["deterministic"] is True
    a, b, c, m8, speed, max_memory = (r["curve"] for r in doc["runs"])
    assert a == b and a != c and all(math.isfinite(x) for x in a + c)
    # BF16 parameters with 8-bit remainders: their own curve, near the FP32 masters' one.
    assert doc["runs"][3]["variant"] == "coat_fp8lin_head_m8" and m8 != a
    assert all(abs(x - y) < 0.01 * y for x, y in zip(m8, a))
    # prepare's speed recipe is that variant (its fused norms exact); max_memory near it.
    assert speed == a
    assert max_memory != a and all(abs(x - y) < 0.01 * y for x, y in zip(max_memory, a))


@pytest.mark.slow
def test_convergence_side_cut_by_its_limit_resumes_then_plots(tmp_path):
    """bench/convergence.py on 2 gloo ranks and a glob corpus: a launch ended by --limit keeps
    its saves, the next launch resumes them and finishes; plot puts each side beside bf16."""
    flags = ["--preset", "tiny", "--seq", "64", "--tokens", "400000", "--data", "coat_ds/**/*.py", "--vocab", "512",
             "--eval-interval", "20", "--eval-batches", "2", "--log-interval", "10", "--save-interval", "20",
             "--no-compile", "--nproc", "2", "--out", str(tmp_path)]
    cut = _run("bench/convergence.py", "run", "speed", *flags, "--limit", "20")
    assert "391 steps of 8 x 64 tokens on 2 ranks" in cut and "exit 124" in cut and "run it again" in cut
    assert (tmp_path / "speed" / "ckpt" / "latest").is_file()
    done = _run("bench/convergence.py", "run", "speed", *flags, "--limit", "300")
    assert "resuming" in done and "exit 0, at step 391 of 391" in done
    _run("bench/convergence.py", "run", "bf16", *flags, "--tokens", "20000", "--limit", "300")
    table = _run("bench/convergence.py", "plot", str(tmp_path), "--png", str(tmp_path / "c.png"))
    rows = {r.split("|")[1].strip(): r.split("|") for r in table.splitlines() if r.startswith("| ") and "side" not in r}
    assert set(rows) == {"bf16", "speed"} and rows["bf16"][4].strip() == "+0.00%"
    assert math.isfinite(float(rows["speed"][3])) and (tmp_path / "c.png").stat().st_size > 0
    assert "->" in rows["speed"][5] and "->" in rows["speed"][6]  # tokens/s and peak, early -> last window


def test_convergence_hands_what_follows_double_dash_to_train_py():
    conv = _load("convergence")
    args = conv.parse(["run", "speed", "--name", "m8", "--tokens", "5e7", "--", "--master-weights", "bf16+8"])
    assert (args.side, args.name, args.tokens, args.extra) == ("speed", "m8", 5e7, ["--master-weights", "bf16+8"])
    assert conv.parse(["run", "bf16"]).extra == []
    with pytest.raises(SystemExit):
        conv.parse(["plot", "runs", "--", "--seed", "1"])


def test_scaling_table_over_gpu_counts_engines_and_sides(tmp_path):
    """bench/scaling.py table on CPU ranks (gloo): every engine x side at 1 and 2 ranks, each
    row with its per-rank tokens/s, its efficiency against 1 rank and its ratio to bf16."""
    out = _run("bench/scaling.py", "table", "--preset", "tiny", "--gpus", "1", "2", "--engines", "zero3", "fsdp2",
                   "--sides", "bf16", "speed", "--steps", "4", "--log-interval", "1", "--seq", "64", "--micro", "2",
                   "--tokens", "200000", "--limit", "200", "--out", str(tmp_path))
    rows = [r.split("|")[1:-1] for r in _last_table(out)[2:]]
    assert [(r[0].strip(), r[1].strip(), r[2].strip()) for r in rows] == [
        (e, s, g) for g in ("1", "2") for e in ("zero3", "fsdp2") for s in ("bf16", "speed")]
    for engine, side, gpus, tps, eff, vs, peak in (map(str.strip, r) for r in rows):
        assert float(tps.replace(",", "")) > 0 and float(peak) > 0
        assert float(eff) > 0 and (gpus != "1" or eff == "1.000")
        assert (vs == "") == (side == "bf16") and (side == "bf16" or float(vs.rstrip("x")) > 0)


def test_grad_error_tables_eager_and_compiled():
    out = _run("bench/grad_error.py", "--preset", "tiny", "--train-steps", "2", "--batch-size", "2",
               "--grad-batch-size", "2", "--seq-len", "32", "--max-data-bytes", "200000")
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| attn.wqkv.weight")]
    assert len(rows) == 1 and len(rows[0]) == 7  # eager, compiled, compiled_cqkv: SQNR and norm ratio each
    for db in (float(c.split()[0]) for c in rows[0][1::2]):
        assert 10 < db < 100  # lossy, and not lost


def test_parity_act_config_overrides():
    acc = _load("_common")
    assert acc.act_overrides(["compress_attention_inputs=true", "group_size=32", "other_format=e5m2"]) == dict(
        compress_attention_inputs=True, group_size=32, other_format="e5m2")
    with pytest.raises(SystemExit, match="'bogus=1'.*compress_attention_inputs"):
        acc.act_overrides(["bogus=1"])
    with pytest.raises(SystemExit, match="group_size must be a power of two"):
        acc.act_overrides(["group_size=3"])


def test_gaps_puts_idle_time_on_the_launching_op(tmp_path):
    def op(name, ts, dur, cat="cpu_op", **args):
        return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat, "tid": 1, "args": args}

    events = [op("nvjet_sm90_qqtst_gemm", 0, 10, "kernel", correlation=1), op("early_work", 5, 25),
              op("my_host_work", 30, 15),
              op("cudaLaunchKernel", 40, 2, "cuda_runtime", correlation=2),
              op("triton_poi_fused_0", 50, 5, "kernel", correlation=2)]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    lines = _load("trace_gaps").gaps(str(path), top=5)
    assert "| GEMM, FP8 | 0.0 |" in lines and "| Inductor kernels | 0.0 |" in lines
    assert lines.index("| nvjet_sm90_qqtst_gemm | GEMM, FP8 | 1 | 0.01 |") < lines.index(
        "| triton_poi_fused_0 | Inductor kernels | 1 | 0.01 |")
    assert "| 0.04 | my_host_work | triton_poi_fused_0 |" in lines
    # The GPU went idle at 10 us, while the host still ran early_work (5-30 us).
    assert lines[-1] == "| 0.04 | early_work |"


def test_scale_model_bandwidth_from_a_trace_and_its_predictions(tmp_path):
    model = _load("scale_model")
    # Two all-gathers of 1M BF16 elements on 2 ranks: 1 MB through each rank in 10 and 20 us.
    # The slower one waited for its peer, so the faster half counts: 100 GB/s.
    events = []
    for i, dur in enumerate((10.0, 20.0)):
        events.append({"ph": "X", "name": "record_param_comms", "ts": 100 * i, "dur": 1, "cat": "cpu_op",
                       "args": {"Collective name": "_allgather_base", "dtype": "BFloat16", "In msg nelems": 500_000,
                                "Out msg nelems": 1_000_000, "Group size": 2}})
        events.append({"ph": "X", "name": "ncclDevKernel_AllGather_RING_LL(x)", "ts": 100 * i + 5, "dur": dur,
                       "cat": "kernel"})
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert model.trace_bus_gbs(str(path)) == {"AllGather": pytest.approx(100.0)}

    def rows(*extra):
        table = model.predict(model.parse(["--fit", "bf16=25000", "speed=35000", "--host-gbs", "200",
                                           "--check", "2:bf16=25000,speed=35000", *extra]))
        check = [r.split("|") for r in table if r.startswith("| 2 | ") and r.count("|") == 7]
        per_gpu = {int(r.split("|")[1]): [None if "no fit" in c else float(c.split("(")[0].replace(",", ""))
                                          for c in r.split("|")[2:5]]
                   for r in table[table.index(next(t for t in table if t.startswith("7b"))) + 3:][:10]}
        return check, per_gpu

    check, fsdp = rows()
    # The fitted run is reproduced; within a host the collectives hide and tokens/s per GPU hold.
    assert [abs(float(r[6].strip(" %+"))) for r in check] == [0.0, 0.0]
    assert fsdp[8][1] == pytest.approx(35000 / 2, rel=0.02) and fsdp[8][0] == pytest.approx(25000 / 2, rel=0.02)
    # Across hosts the network shows, more for the faster side; FP8 gathers give some back; HSDP more.
    assert fsdp[16][1] / fsdp[16][0] < fsdp[8][1] / fsdp[8][0]
    assert all(fsdp[n][2] >= fsdp[n][1] for n in fsdp) and fsdp[16][2] > fsdp[16][1]
    _, hsdp = rows("--hsdp")
    assert all(hsdp[n][1] >= fsdp[n][1] for n in fsdp) and hsdp[64][1] > 1.2 * fsdp[64][1]
    # 7B's BF16 state (16 bytes a parameter) and 55 GB of activations outgrow one 141 GB GPU; coat's fit.
    assert fsdp[1][0] is None and fsdp[1][1] is not None
    # Recomputing every forward costs a third more work; a check elsewhere names its preset.
    table = model.predict(model.parse(["--fit", "speed=35000", "--host-gbs", "200", "--check", "4:max_memory=5000@70b:2"]))
    row = next(r for r in table if r.startswith("| 4 | 70b, 2 | max_memory | 5,000 |")).split("|")
    seven = next(r for r in table if r.startswith("| 1 | ") and "(" in r).split("|")
    assert float(seven[2].split("(")[0].replace(",", "")) / float(seven[4].split("(")[0].replace(",", "")) == \
        pytest.approx(4 / 3, rel=1e-3)
    assert float(row[5].replace(",", "")) > 0
    # A recomputing side fitted on its own run reproduces it (its second forward counted once).
    table = model.predict(model.parse(["--fit", "max_memory=30000", "--host-gbs", "200", "--check", "2:max_memory=30000"]))
    assert next(r for r in table if r.startswith("| 2 | 7b, 6 | max_memory |")).endswith("| +0.0% |")
    with pytest.raises(SystemExit):
        model.parse(["--fit", "bf17=1", "--host-gbs", "1"])


def test_scaling_fit_runs_the_max_memory_recipe_side(tmp_path):
    """fit's coat_max side: train.py --recipe max_memory with bf16+8 masters and the no-clip
    JSON (every layer recomputed from FP8 inputs, stepping in backward), one process on CPU."""
    out = _run("bench/scaling.py", "fit", "--preset", "tiny", "--seq", "64", "--sides", "coat_max:2", "--steps", "3",
               "--limit", "280", "--out", str(tmp_path))
    row = next(r for r in _last_table(out) if r.startswith("| coat_max |")).split("|")
    assert row[2].strip() == "2" and row[7].strip() == ""
    log = (tmp_path / "fit_coat_max_mb2.log").read_text()
    assert "recompute            applied: 2 decoder layers recomputed" in log
    assert "step in backward: ON" in log and "no clipping" in log and "master 3.00" in log
