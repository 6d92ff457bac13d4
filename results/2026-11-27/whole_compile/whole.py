"""7B layer shapes: the decoder layers compiled (the bench's setup) against the whole Hugging Face
model compiled (model.compile(), as Trainer's torch_compile=True does), one side and mode per process.
Prints per-step CUDA-event times (each step from an idle GPU) and wall time per step of steps run
back to back, as a training loop runs them. From the repo root:
    SKIP_WHEELS=1 bash bench/device_env.sh bash results/2026-11-27/whole_compile/run.sh
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../../bench"))
import _common as C  # noqa: E402
import fp8_linear as F  # noqa: E402
import torch  # noqa: E402

side, mode = sys.argv[1], sys.argv[2]
model, opt = F.build("7b", side, 2048, compiled=mode == "layers")
if mode == "whole":
    torch._dynamo.config.automatic_dynamic_shapes = False
    torch._dynamo.config.recompile_limit = 64
    model.compile()
ids = torch.randint(0, model.config.vocab_size, (8, 2048), device=C.device())


def step():
    F.train_step(model, opt, ids)


ms = C.median_ms(step, 8)
wall = C.wall_ms(step, reps=10, warmup=2)
print(json.dumps({"side": side, "mode": mode, "event_ms": round(ms, 1), "wall_ms": round(wall, 1),
                  "peak_gb": round(C.peak_gb(), 1)}), flush=True)
