"""End to end: `torchrun train.py --fsdp` (FSDP2, CoatAdamW from ds_configs/coat_zero2.json) on
the tiny preset, 2 CPU ranks over gloo, SIGKILLed inside its last checkpoint save; then
`--resume <save_dir>` on 2 ranks (must skip the torn save and reproduce the losses bit for
bit) and a resume of the mid-run checkpoint on 1 rank (DCP reshards; must keep training)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch.distributed.checkpoint as dcp

from helpers import ROOT, free_port, read_metrics, run_failing_in_repo, run_in_repo, run_killed_in_save

TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def _cmd(nproc: int, *flags) -> list[str]:
    return [TORCHRUN, "--nproc_per_node", str(nproc), "--master_port", str(free_port()), "train.py", "--fsdp",
            "--config", "configs/tiny.yaml", "--max-steps", "6", "--log-interval", "2", "--eval-interval", "0",
            "--eval-batches", "2", *flags]


def _run(nproc: int, *flags) -> subprocess.CompletedProcess:
    return run_in_repo(_cmd(nproc, *flags), 180)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun not installed")
def test_train_py_fsdp2_killed_in_save_resumes(tmp_path):
    save, pidfile = tmp_path / "ckpt", tmp_path / "paused.pid"
    # Rank 1 pauses as it starts writing its data file of step 6; this test SIGKILLs it there.
    out = run_killed_in_save(_cmd(2, "--save-dir", str(save), "--save-interval", "4", "--metrics-file",
                                  str(tmp_path / "full.jsonl")), 180, pidfile=pidfile,
                             COAT_DS_CKPT_FAULT=f"rank=1,ckpt=step6,file=.distcp,action=pause,pidfile={pidfile}")
    assert "resolved config:" in out and "engine: fsdp" in out and "fsdp_mode: fsdp2" in out
    assert "2 rank(s), micro-batch 8" in out  # the batch size of the DeepSpeed JSON
    assert "model start: on the meta device" in out and "MFU: not reported: no dense BF16 peak known for cpu" in out
    assert "  rank 1: master 4.00 | optimizer 2.25 | gradients 4.00 | compute copies 0.00 | total 10.25" in out
    assert "optimizer state:" in out and "tok/s" in out and "peak mem" in out and "eval loss" in out
    assert "step 6/6 (100%)" in out and "health: max |w| " in out
    ref = read_metrics(tmp_path / "full.jsonl")
    assert 0 < ref[6]["moment_bound_ratio"] < 2 and ref[6]["param_absmax_of"].startswith(("blocks.", "embed", "head"))
    losses = [ref[s]["loss"] for s in (2, 4, 6)]
    assert all(math.isfinite(v) for v in losses) and losses[2] < losses[0]
    assert ref[1]["optimizer_state_gb"] > 0
    assert (save / "step4" / ".metadata").is_file() and (save / "step4" / "coat_ds_checkpoint.json").is_file()
    assert sorted(os.listdir(save)) == [".step6.partial", "latest", "step4"]

    # `--resume <save_dir>` under FSDP: the newest complete checkpoint, step4, the torn one
    # named and skipped. Same world size: steps 5..6 see the same batches and state, so the
    # same losses; its own step-6 save then replaces the leftover.
    same = _run(2, "--resume", str(save), "--save-dir", str(save), "--metrics-file", str(tmp_path / "same.jsonl"))
    assert f"resumed from {save / 'step4'} at step 4" in same.stdout and "settings unlike" not in same.stdout
    assert f"WARNING: skipping {save / '.step6.partial'}: incomplete checkpoint" in same.stderr
    got = read_metrics(tmp_path / "same.jsonl")
    assert got[6]["loss"] == ref[6]["loss"] and got[6]["eval_loss"] == ref[6]["eval_loss"]
    assert sorted(os.listdir(save)) == ["latest", "step4", "step6"] and (save / "latest").read_text() == "step6"

    # One rank: DCP reshards the checkpoint; this rank now holds the whole optimizer state
    # (the report counts local shards, so it doubles) and training goes on from step 4, with
    # the fused head loss, which the log names as a change from the checkpoint's run.
    one = _run(1, "--resume", str(save / "step4"), "--metrics-file", str(tmp_path / "one.jsonl"), "--fused-head-loss")
    assert "1 rank(s)" in one.stdout and "at step 4" in one.stdout and "step 6/6 (100%)" in one.stdout
    assert ("settings unlike the checkpoint's: fused_head_loss on (the checkpoint's run: off); training goes on "
            "with this run's") in one.stdout
    got = read_metrics(tmp_path / "one.jsonl")
    assert sorted(k for k, m in got.items() if "loss" in m) == [6]
    assert math.isfinite(got[6]["loss"]) and got[6]["loss"] < ref[2]["loss"]
    assert got[5]["optimizer_state_gb"] == pytest.approx(2 * ref[1]["optimizer_state_gb"], rel=0.02)

    # Resuming step 4 into the same save folder would save step6 again: refused before the
    # first training step (one process, no launcher), step6 left as it was.
    before = {f: (save / "step6" / f).read_bytes() for f in os.listdir(save / "step6")}
    again = run_failing_in_repo([sys.executable, "train.py", "--fsdp", "--config", "configs/tiny.yaml",
                                 "--max-steps", "6", "--resume", str(save / "step4"), "--save-dir", str(save)], 180)
    assert f"{save} already holds step6, which this run would save again" in again.stderr
    assert "step 6/6" not in again.stdout
    assert {f: (save / "step6" / f).read_bytes() for f in os.listdir(save / "step6")} == before


def _ranks_without_launcher(flags: list[str], nproc: int, log_dir) -> list[subprocess.Popen]:
    """`train.py --fsdp flags` as `nproc` processes started as a launcher on several machines
    would start them, with no agent that ends the others when one dies."""
    port, procs = free_port(), []
    for rank in range(nproc):
        env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc)}
        procs.append(subprocess.Popen([sys.executable, "train.py", "--fsdp", *flags], cwd=ROOT, env=env,
                                      stdout=open(log_dir / f"rank{rank}.log", "w"), stderr=subprocess.STDOUT))
    return procs


@pytest.mark.slow
def test_train_py_on_a_corpus_survives_a_killed_rank_and_a_full_disk(tmp_path):
    """A BPE corpus (this repository's Python sources, a glob); a rank SIGKILLed mid-run: the
    survivor ends within the heartbeat bound naming it and the checkpoint to resume from (no
    launcher ends it, as none would on several machines). The resume, on one rank, meets a full
    disk at its save: the error names the folder and ENOSPC, the last checkpoint stays; a second
    resume from it finishes."""
    from coat_ds.io.checkpoint_folders import find_checkpoint

    save, cache = tmp_path / "ckpt", tmp_path / "cache"
    corpus = ["--config", "configs/tiny.yaml", "--data", os.path.join(ROOT, "coat_ds", "**", "*.py"), "--tokenizer",
              "bpe", "--bpe-vocab-size", "512", "--data-cache", str(cache), "--eval-interval", "0", "--eval-batches",
              "2", "--log-interval", "1", "--save-dir", str(save), "--save-interval", "2"]
    procs = _ranks_without_launcher([*corpus, "--max-steps", "1000", "--heartbeat-timeout-s", "5",
                                     "--dist-timeout-s", "60"], 2, tmp_path)
    try:
        deadline = time.monotonic() + 150
        while not (save / "step2").exists():
            assert procs[0].poll() is None and time.monotonic() < deadline, (tmp_path / "rank0.log").read_text()[-3000:]
            time.sleep(0.05)
        procs[1].kill()
        killed = time.monotonic()
        status = procs[0].wait(60)
        took = time.monotonic() - killed
    finally:
        for p in procs:
            p.kill()
            p.wait()
    out = (tmp_path / "rank0.log").read_text()
    # Both ranks prepared the corpus: one built it, the other waited for it, then found it made.
    assert "corpus: training a byte-level BPE of 512 ids" in out + (tmp_path / "rank1.log").read_text()
    assert "(bpe512, vocabulary 512, uint16); train " in out and "(val_file_fraction 0.01)" in out
    newest = find_checkpoint(save)
    assert status == 1 and took < 30, (status, took, out[-3000:])
    assert (f"FATAL on rank 0: rank 1 of 2 stopped answering: no heartbeat for 5 s (heartbeat_timeout_s)" in out
            and f"To go on, relaunch every rank with --resume {save} (its newest complete checkpoint: {newest.path}, "
            f"step {newest.step})." in out), out[-3000:]
    # The model's vocabulary is the tokenizer's.
    emb = dcp.FileSystemReader(newest.path).read_metadata().state_dict_metadata["model.embed.weight"]
    assert emb.size[0] == 512

    # One rank resumes; its save hits a full disk (its data file is a link to /dev/full).
    end = newest.step + 2
    full = run_failing_in_repo([sys.executable, "train.py", "--fsdp", *corpus, "--resume", str(save), "--max-steps",
                                str(end)], 180, COAT_DS_CKPT_FAULT=f"rank=0,ckpt=step{end},file=.distcp,action=full")
    assert f"resumed from {newest.path} at step {newest.step}" in full.stdout and "(reused)" in full.stdout
    assert f"step {end}/{end} (100%)" in full.stdout
    assert (f"saving {save / f'step{end}'} failed on rank(s) [0]: ENOSPC: No space left on device; "
            f"{save / f'step{end}'} was not created and the partial save {save / f'.step{end}.partial'} was removed"
            in full.stderr), full.stderr[-3000:]
    assert f"(its newest complete checkpoint: {newest.path}, step {newest.step})" in full.stderr
    assert "Traceback" not in full.stderr
    assert find_checkpoint(save).path == newest.path and not (save / f".step{end}.partial").exists()

    again = run_in_repo([sys.executable, "train.py", "--fsdp", *corpus, "--resume", str(save), "--max-steps",
                         str(end)], 180)
    assert f"resumed from {newest.path} at step {newest.step}" in again.stdout
    assert f"saved checkpoint {save}/step{end}" in again.stdout and find_checkpoint(save).step == end


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun not installed")
def test_train_py_fsdp1_adamw_baseline_with_activation_compression(tmp_path):
    proc = _run(2, "--fsdp-mode", "fsdp1", "--deepspeed", "ds_configs/bf16_zero2.json", "--compress-activations",
                "--max-steps", "4", "--metrics-file", str(tmp_path / "m.jsonl"))
    assert "fsdp_mode: fsdp1" in proc.stdout and "compress_activations: true" in proc.stdout
    assert "saved activations" in proc.stdout and "step 4/4 (100%)" in proc.stdout
    got = read_metrics(tmp_path / "m.jsonl")
    assert 0 < got[1]["activation_compression_ratio"] < 0.8  # FP8 codes: about half of BF16/FP32
    assert math.isfinite(got[4]["loss"])


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun not installed")
def test_train_py_fsdp2_compiled_blocks_with_fp8_activations(tmp_path):
    """recipe memory (FP8 linears, fused norms, the head loss, FP8 activations), eager and with
    compiled blocks under FSDP2."""
    runs = {}
    for name, flags in (("eager", ()), ("compiled", ("--compile",))):
        proc = _run(2, "--recipe", "memory", *flags, "--metrics-file", str(tmp_path / f"{name}.jsonl"))
        assert "step 6/6 (100%)" in proc.stdout
        runs[name] = read_metrics(tmp_path / f"{name}.jsonl")
    assert "compile: true" in proc.stdout and "quantized inside the compiled blocks" in proc.stdout
    assert "recipe: memory" in proc.stdout and "  compress_activations applied" in proc.stdout
    # Same data and initial weights; the compiled blocks quantize every saved value per group
    # (eager: linear inputs per tensor), so the losses agree closely, not bit for bit.
    for step in (2, 4, 6):
        assert math.isfinite(runs["compiled"][step]["loss"])
        assert runs["compiled"][step]["loss"] == pytest.approx(runs["eager"][step]["loss"], rel=0.01)
    assert runs["compiled"][6]["loss"] < runs["compiled"][2]["loss"]


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun not installed")
def test_train_py_hsdp_replicates_across_groups(tmp_path):
    """--fsdp-shard-size 1 on 2 ranks: HSDP with each parameter whole on its rank and the
    gradients all-reduced; recipe max_memory (CoatAdamW stepping in backward, recomputed
    layers) trains as under plain FSDP2."""
    runs = {}
    for name, flags in (("hsdp", ("--fsdp-shard-size", "1")), ("fsdp2", ())):
        proc = _run(2, "--recipe", "max_memory", *flags, "--metrics-file", str(tmp_path / f"{name}.jsonl"))
        assert "step 6/6 (100%)" in proc.stdout
        runs[name] = read_metrics(tmp_path / f"{name}.jsonl")
        assert ("HSDP: each parameter sharded over 1 ranks, replicated 2 times" in proc.stdout) == (name == "hsdp")
    for step in (2, 4, 6):
        assert runs["hsdp"][step]["loss"] == pytest.approx(runs["fsdp2"][step]["loss"], rel=0.01)


def test_flags_pick_the_fsdp_engine_and_its_options():
    sys.path.insert(0, ROOT)
    import train

    cfg = train.parse_config(["--fsdp", "--fsdp-mode", "fsdp1", "--compress-activations"])
    assert (cfg.engine, cfg.fsdp_mode, cfg.compress_activations) == ("fsdp", "fsdp1", True)
    assert train.parse_config(["--engine", "fsdp", "--no-compress-activations"]).compress_activations is False
    assert train.parse_config([]).engine == "deepspeed"
    assert train.parse_config([]).cudnn_attention and not train.parse_config(["--no-cudnn-attention"]).cudnn_attention
    with pytest.raises(SystemExit, match="fsdp_mode"):
        train.parse_config(["--fsdp", "--fsdp-mode", "fsdp3"])
    # Compiled blocks under FSDP2 and every ZeRO stage (ZeRO-3: as leaves, compile_zero3_layers).
    assert train.parse_config(["--fsdp", "--compile", "--deepspeed", "ds_configs/coat_zero3.json"]).compile
    assert train.parse_config(["--compile", "--deepspeed", "ds_configs/coat_zero2.json"]).compile
    assert train.parse_config(["--compile", "--deepspeed", "ds_configs/coat_zero3.json"]).compile
    # Every recipe under either engine; max_memory steps in backward where FSDP2 allows it.
    for recipe in ("speed", "memory", "max_memory"):
        for engine in ([], ["--fsdp"], ["--fsdp", "--fsdp-mode", "fsdp1"]):
            cfg = train.parse_config([*engine, "--recipe", recipe])
            sib = recipe == "max_memory" and engine == ["--fsdp"]
            assert cfg.recipe == recipe and cfg.step_in_backward == sib, (recipe, engine)
            off = "step in backward: OFF although recipe max_memory asks for it"
            assert (off in "\n".join(train.settings_lines(cfg))) == (recipe == "max_memory" and not sib)
    assert train.parse_config(["--fsdp", "--fsdp-shard-size", "8"]).fsdp_shard_size == 8
    for flags in (["--fsdp-shard-size", "2"], ["--fsdp", "--fsdp-mode", "fsdp1", "--fsdp-shard-size", "2"]):
        with pytest.raises(SystemExit, match="fsdp_shard_size: got 2 .*0 unless engine is fsdp with fsdp_mode fsdp2"):
            train.parse_config(flags)
    refused = r"--fused-head-loss: fused_head_loss: got True \(bool\); allowed: off with recipe 'speed'"
    with pytest.raises(SystemExit, match=refused):
        train.parse_config(["--recipe", "speed", "--fused-head-loss"])
    with pytest.raises(SystemExit, match="recipe: got 'fast'"):
        train.parse_config(["--recipe", "fast"])


def test_ds_json_settings_for_the_fsdp_engine(tmp_path):
    import torch

    from coat_ds import CoatAdamW
    from coat_ds.train.engine_setup import build_optimizer, optimizer_state_bytes, read_ds_settings

    coat = read_ds_settings(os.path.join(ROOT, "ds_configs", "coat_zero2.json"), world_size=2)
    assert (coat.micro_batch, coat.grad_accum, coat.clip, coat.bf16) == (8, 1, 1.0, True)
    assert coat.optimizer_type == "CoatAdamW" and coat.optimizer_params["betas"] == (0.9, 0.95)
    base = read_ds_settings(os.path.join(ROOT, "ds_configs", "bf16_zero2.json"), world_size=2)
    assert base.optimizer_type == "AdamW" and "torch_adam" not in base.optimizer_params
    w = torch.nn.Parameter(torch.randn(64, 128))
    w.grad = torch.randn_like(w)
    for settings, cls in ((coat, CoatAdamW), (base, torch.optim.AdamW)):
        opt = build_optimizer(settings, [w])
        assert type(opt) is cls and opt.param_groups[0]["lr"] == 3e-4
        opt.step()
        assert optimizer_state_bytes(opt) > 0
    # two moments in FP32: 8 bytes per parameter
    assert optimizer_state_bytes(opt) == 8 * w.numel()

    def write(ds):
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(ds))
        return str(path)

    adam = {"type": "AdamW", "params": {"lr": 1e-3}}
    s = read_ds_settings(write({"train_batch_size": 32, "gradient_accumulation_steps": 2, "optimizer": adam}), 4)
    # No gradient_clipping key: DeepSpeed's default, 1.0, on both engines.
    assert (s.micro_batch, s.grad_accum, s.clip, s.bf16) == (4, 2, 1.0, False)
    s = read_ds_settings(write({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "optimizer": adam}), 2)
    assert s.grad_accum == 4
    with pytest.raises(ValueError, match="train_batch_size"):
        read_ds_settings(write({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4,
                                "gradient_accumulation_steps": 1, "optimizer": adam}), 2)
    with pytest.raises(ValueError, match="fp16"):
        read_ds_settings(write({"train_micro_batch_size_per_gpu": 4, "fp16": {"enabled": True}, "optimizer": adam}), 1)
    with pytest.raises(ValueError, match="optimizer.type"):
        read_ds_settings(write({"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Lamb"}}), 1)
    with pytest.raises(ValueError, match="unknown key"):
        read_ds_settings(write({"train_micro_batch_size_per_gpu": 4,
                                "optimizer": {"type": "CoatAdamW", "params": {"lr": 1e-3, "betaz": [0.9, 0.9]}}}), 1)
