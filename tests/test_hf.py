"""CoatAdamW under Hugging Face Trainer and Accelerate with real DeepSpeed: 2 CPU ranks over
gloo, a tiny Llama built from a LlamaConfig (no download), no mocks.

Run as a script this file is the worker that `torchrun` starts (all scenarios in one launch,
to keep CI time small); under pytest it launches it once and checks what each rank reports.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from helpers import end_worker, free_port

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STEPS, SAVE_AT, ACCUMULATE = 4, 2, 2
LR = 3e-3


def ds_config(stage: int, optimizer: bool = True) -> dict:
    """A DeepSpeed JSON as a Trainer user writes it: HF's "auto" wherever Trainer fills it."""
    cfg = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "gradient_clipping": "auto", "zero_optimization": {"stage": stage}, "steps_per_print": 10**9}
    if stage == 3:
        cfg["zero_optimization"].update({"stage3_param_persistence_threshold": 0, "sub_group_size": 2_000})
    if optimizer:
        cfg["optimizer"] = {"type": "CoatAdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                             "weight_decay": "auto", "min_quant_numel": 256}}
    return cfg


# -- worker side ------------------------------------------------------------------------------

def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))


def _dataset() -> list[dict]:
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(64):
        ids = torch.randint(0, 64, (16,), generator=g)
        rows.append({"input_ids": ids, "labels": ids})
    return rows


def _reset_hf_state() -> None:
    """Trainer and Accelerate keep process-wide singletons; each scenario starts clean."""
    from accelerate.state import AcceleratorState, GradientState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _digest(engine) -> str:
    """Hash of this rank's FP32 master partitions and CoatAdamW state, in a fixed order."""
    from coat_ds.integrations.deepspeed.engine import coat_optimizer, local_partitions

    h = hashlib.sha256()
    opt = coat_optimizer(engine)
    for t, _ in local_partitions(engine):
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        for key, v in sorted(opt.state[t].items()):
            v = v if torch.is_tensor(v) else torch.tensor(v)
            h.update(key.encode() + v.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# The JSON route trains a model prepared by coat_ds.prepare (the fused head loss among its
# edits, which Trainer's default remove_unused_columns once emptied every batch for), with
# gradient checkpointing; the other routes train the model as built.
RECIPES = {2: "memory", 3: "speed"}


def _trainer(out: str, stage: int, route: str, **extra):
    import coat_ds
    from transformers import Trainer, TrainingArguments

    _reset_hf_state()
    model = _model()
    if route == "json":
        coat_ds.prepare(model, RECIPES[stage])
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=STEPS, learning_rate=LR,
                             weight_decay=0.1, adam_beta2=0.95, logging_steps=1, save_steps=SAVE_AT,
                             report_to=[], deepspeed=ds_config(stage, optimizer=route == "json"), seed=0,
                             disable_tqdm=True, save_only_model=False, gradient_accumulation_steps=ACCUMULATE,
                             gradient_checkpointing=route == "json")
    if route == "cls":
        extra["optimizer_cls_and_kwargs"] = (coat_ds.CoatAdamW, {"lr": LR, "betas": (0.9, 0.95),
                                                                  "weight_decay": 0.1, "min_quant_numel": 256})
    return Trainer(model=model, args=args, train_dataset=_dataset(), **extra)


def _steps_run_callback():
    """A callback recording the global steps a Trainer runs itself (not those restored from a
    checkpoint)."""
    from transformers import TrainerCallback

    class StepsRun(TrainerCallback):
        def __init__(self):
            self.steps = []

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append(state.global_step)

    return StepsRun()


def _losses(trainer) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def _trainer_scenario(out: str, stage: int, route: str) -> dict:
    from coat_ds import CoatAdamW
    from coat_ds.integrations.deepspeed.engine import coat_optimizer
    from coat_ds.loss.fuse import LossHead

    run = os.path.join(out, f"trainer_{route}_zero{stage}")
    full = _trainer(run, stage, route)
    full.train()
    engine = full.model_wrapped
    coat = coat_optimizer(engine)
    result = {"coat": isinstance(coat, CoatAdamW), "lr": coat.defaults["lr"], "betas": list(coat.defaults["betas"]),
              "losses": _losses(full), "digest": _digest(engine), "fused_head": isinstance(full.model.lm_head, LossHead)}
    resumed = _trainer(run + "_resumed", stage, route)
    steps_run = _steps_run_callback()
    resumed.add_callback(steps_run)
    resumed.train(resume_from_checkpoint=os.path.join(run, f"checkpoint-{SAVE_AT}"))
    result["resumed_steps_run"] = steps_run.steps
    result["resumed_losses"] = _losses(resumed)
    result["resumed_digest"] = _digest(resumed.model_wrapped)
    return result


def _silent_replacement(out: str) -> dict:
    """The case transformers gives no sign of: CoatAdamW passed through `optimizers=`."""
    import coat_ds
    from coat_ds.integrations.deepspeed.engine import coat_optimizer
    from coat_ds.optim.watch import REPLACED_MESSAGE

    dropped = coat_ds.CoatAdamW(_model().parameters())
    trainer = _trainer(os.path.join(out, "silent"), 2, "none", optimizers=(dropped, None))
    trainer.args.max_steps = 1
    trainer.args.save_strategy = "no"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    prefix = REPLACED_MESSAGE.split("{")[0]
    return {"engine_has_coat": coat_optimizer(trainer.model_wrapped) is not None,
            "stepping": type(trainer.model_wrapped.optimizer.optimizer).__name__,
            "warned": [str(w.message) for w in caught if str(w.message).startswith(prefix)]}


def _accelerate(stage: int) -> dict:
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, DummyOptim

    from coat_ds import CoatAdamW
    from coat_ds.integrations.deepspeed.engine import coat_optimizer

    _reset_hf_state()
    cfg = ds_config(stage)
    cfg.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1, gradient_clipping=1.0)
    # Accelerate fills "auto" only for lr and weight_decay (from the DummyOptim).
    cfg["optimizer"]["params"].update(betas=[0.9, 0.95], eps=1e-8)
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg))
    model = _model()
    model, optimizer = accelerator.prepare(model, DummyOptim(model.parameters(), lr=LR, weight_decay=0.1))
    rows = _dataset()
    losses = []
    for i in range(3):
        batch = rows[4 * i + 2 * accelerator.process_index:][:2]
        ids = torch.stack([r["input_ids"] for r in batch])
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    coat = coat_optimizer(model)
    return {"coat": isinstance(coat, CoatAdamW), "lr": coat.defaults["lr"], "losses": losses,
            "steps": sorted({float(s["step"]) for s in coat.state.values()})}


def _plain_deepspeed() -> dict:
    """Plain `deepspeed.initialize` with the JSON; before registration it is DeepSpeed's own
    assertion, after it a CoatAdamW inside ZeRO-2."""
    import deepspeed

    import coat_ds
    from coat_ds.integrations.deepspeed.engine import coat_optimizer

    cfg = {**ds_config(2), "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "gradient_clipping": 1.0}
    cfg["optimizer"] = {"type": "CoatAdamW", "params": {"lr": LR, "min_quant_numel": 256}}
    model = _model()
    try:
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        before = "ran"
    except AssertionError as e:
        before = str(e)
    coat_ds.register_deepspeed()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    ids = torch.stack([r["input_ids"] for r in _dataset()[:2]])
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    # DeepSpeed builds the registered CoatAdamW itself here, past deepspeed_initialize's check:
    # the optimizer refuses at the first hook, before any update.
    cfg["optimizer"]["params"]["step_in_backward"] = True
    sib_model = _model()
    sib, *_ = deepspeed.initialize(model=sib_model, model_parameters=sib_model.parameters(), config=cfg)
    try:
        sib.backward(sib(input_ids=ids, labels=ids).loss)
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    return {"before_registration": before, "coat": coat_optimizer(engine) is not None,
            "steps": [float(s["step"]) for s in coat_optimizer(engine).state.values()], "sib_refused": refused}


def worker(out: str) -> None:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    result = {"plain": _plain_deepspeed(), "silent": _silent_replacement(out)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for stage in (2, 3):
            for route in ("json", "cls"):
                result[f"{route}_zero{stage}"] = _trainer_scenario(out, stage, route)
        result["accelerate_zero3"] = _accelerate(3)
    result["other_warnings"] = [str(w.message) for w in caught if str(w.message).startswith("coat_ds:")]
    rank = torch.distributed.get_rank()
    with open(os.path.join(out, f"hf_rank{rank}.json"), "w") as f:
        json.dump(result, f)
    end_worker()


# -- pytest side ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    out = tmp_path_factory.mktemp("hf")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": ROOT + os.pathsep + HERE + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           __file__, str(out)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=400)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-8000:]}")
    return [json.load(open(out / f"hf_rank{r}.json")) for r in range(2)]


@pytest.mark.slow
def test_plain_deepspeed_initialize_after_registration(ranks):
    for r in ranks:
        assert "CoatAdamW is not a supported DeepSpeed Optimizer" in r["plain"]["before_registration"]
        assert r["plain"]["coat"] and r["plain"]["steps"] == [1.0]
        assert "CoatAdamW(step_in_backward=True)" in r["plain"]["sib_refused"], r["plain"]["sib_refused"]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("route", ["json", "cls"])
def test_trainer_deepspeed_uses_coat_and_resumes_bitwise(ranks, stage, route):
    for r in ranks:
        res = r[f"{route}_zero{stage}"]
        assert res["coat"], "the engine's optimizer is not CoatAdamW"
        # The JSON's "auto" values came from TrainingArguments.
        assert res["lr"] == LR and res["betas"] == [0.9, 0.95]
        losses = {int(k): v for k, v in res["losses"].items()}
        assert sorted(losses) == list(range(1, STEPS + 1)) and all(v == v for v in losses.values())
        resumed = {int(k): v for k, v in res["resumed_losses"].items()}
        # Steps 1..SAVE_AT come back from the checkpoint's log; the rest the resumed run computed.
        assert res["resumed_steps_run"] == list(range(SAVE_AT + 1, STEPS + 1))
        assert resumed == losses
        assert res["resumed_digest"] == res["digest"]
    assert ranks[0][f"{route}_zero{stage}"]["losses"] == ranks[1][f"{route}_zero{stage}"]["losses"]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_trainer_with_prepared_model_and_default_columns_trains_like_the_plain_model(ranks, stage):
    """Trainer's defaults (remove_unused_columns among them) with a prepared model: the head's
    loss is the fused one (ZeRO-3 gathers its weight inside the head's call), and the first
    step's loss, before any update, is the plain model's on the same batches to 1e-3 (FP8
    linears on CPU; compression and checkpointing change only backward)."""
    for r in ranks:
        prepared, plain = r[f"json_zero{stage}"], r[f"cls_zero{stage}"]
        assert prepared["fused_head"] and not plain["fused_head"]
        first, ref = prepared["losses"]["1"], plain["losses"]["1"]
        assert abs(first - ref) <= 1e-3 * ref, (first, ref)


@pytest.mark.slow
def test_trainer_optimizers_argument_replacement_is_warned(ranks):
    for r in ranks:
        silent = r["silent"]
        assert not silent["engine_has_coat"] and silent["stepping"] == "AdamW"
        assert len(silent["warned"]) == 1 and "optimizer_cls_and_kwargs" in silent["warned"][0]
        # ...and no CoatAdamW that really steps is warned about.
        assert r["other_warnings"] == []


@pytest.mark.slow
def test_accelerate_deepspeed_plugin_builds_coat(ranks):
    for r in ranks:
        acc = r["accelerate_zero3"]
        assert acc["coat"] and acc["lr"] == LR
        assert acc["steps"] == [3.0]
        assert all(v == v for v in acc["losses"])


if __name__ == "__main__":
    worker(sys.argv[1])


@pytest.mark.gpu
@pytest.mark.slow
def test_accelerate_fsdp2_plugin_trains_a_prepared_model(tmp_path):
    """Accelerate applies its FSDP plugin on GPUs only (on CPU it trains unsharded): there, a
    model prepared by coat_ds.prepare with CoatAdamW trains under the FSDP2 plugin, as the plain
    model with torch AdamW does, both from the same first loss."""
    from helpers import run_in_repo

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    run_in_repo([sys.executable, "bench/clients.py", "accelerate", "--shape", "tiny", "--seq", "64", "--micro", "2",
                 "--steps", "4", "--warmup", "2", "--out", str(tmp_path)], 600,
                NGPU=str(min(2, torch.cuda.device_count())))
    rows = {r["side"]: r for r in json.load(open(tmp_path / "clients_accelerate.json"))}
    assert set(rows) == {"bf16", "coat"} and all("error" not in r for r in rows.values()), rows
    assert "fp8_linear           applied" in rows["coat"]["report"]
    first = rows["bf16"]["losses"][0]
    assert abs(rows["coat"]["losses"][0] - first) <= 2e-2 * first, rows
