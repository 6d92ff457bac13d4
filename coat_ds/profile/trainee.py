"""One side of the comparison (baseline or COAT) set up for training under one engine.

A `Trainee` exposes what the profiler needs and nothing more: one training step split into
forward / backward / step (so the allocator can be read between them), and the tensors that
are the engine's actual weights, gradients and optimizer state on this rank (local shards).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .._compat.deepspeed import release_zero3_references
from ..activation import compress_activations
from ..config import ActivationConfig
from ..integrations.deepspeed.config import load_ds_config
from ..integrations.deepspeed.engine import engine_gradients, initialize, local_partitions, optimizer_settings
from ..integrations.fsdp import setup_fsdp
from ..linear import convert_to_fp8_linear
from ..memory.training_state import TrainingStateBytes, gradient_bytes, training_state_bytes
from ..models.llama import Llama, ModelConfig
from ..optim import CoatAdamW
from ..optim.state import state_bytes

__all__ = ["Side", "load_side", "Trainee", "InBackwardTrainee", "build_trainee"]


@dataclass(frozen=True)
class Side:
    """One column of the comparison, read from a DeepSpeed JSON."""

    name: str  # "baseline" or "coat"
    config_path: str  # the DeepSpeed JSON it came from
    coat_kwargs: dict | None  # CoatAdamW keyword arguments, or None for torch AdamW
    adamw_kwargs: dict  # torch AdamW keyword arguments (used when coat_kwargs is None)
    fp8_linear: bool = False  # COAT side only: the model's linears converted to Fp8Linear

    @property
    def is_coat(self) -> bool:
        """COAT = CoatAdamW + FP8 activation compression; anything else is the BF16 baseline."""
        return self.coat_kwargs is not None

    @property
    def step_in_backward(self) -> bool:
        """CoatAdamW steps each parameter in backward and frees its gradient there."""
        return bool(self.coat_kwargs and self.coat_kwargs.get("step_in_backward"))


def load_side(name: str, path: str, fp8_linear: bool = False, step_in_backward: bool = False) -> Side:
    """`step_in_backward`: CoatAdamW(step_in_backward=True) whatever the JSON says (a JSON
    may also set it in its optimizer params)."""
    kind, params = optimizer_settings(load_ds_config(path), path)
    if kind == "CoatAdamW":
        return Side(name, path, {**params, "step_in_backward": True} if step_in_backward else params, {}, fp8_linear)
    # The baseline picks its AdamW implementation by device (fused on CUDA).
    return Side(name, path, None, {k: v for k, v in params.items() if k != "fused"})


class Trainee:
    """Base: a model, an optimizer, optional activation compression."""

    engine = "none"

    def __init__(self, side: Side, model: nn.Module, device: torch.device):
        self.side, self.device = side, device
        self.model = model
        # Linears converted first, then the hooks (they must see the FP8 codes the layers
        # save), then the engine: both sit on the modules, so every engine keeps them.
        if side.is_coat and side.fp8_linear:
            convert_to_fp8_linear(model)
        self.activations = compress_activations(model, config=ActivationConfig()) if side.is_coat else None

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    def step(self) -> None:
        raise NotImplementedError

    def zero_grad(self) -> None:
        raise NotImplementedError

    def weight_tensors(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def grad_tensors(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer whose `.state` holds the moments."""
        raise NotImplementedError

    def optimizer_state_bytes(self) -> int:
        # Every state tensor but the step counter: FP32 exp_avg/exp_avg_sq for AdamW; FP8
        # codes, scales, k and centres (plus FP32 moments of tiny tensors) for CoatAdamW.
        # Storages count once: ZeRO may keep states as views of flat buffers.
        return state_bytes(*self.optimizer().state.values(), storages=True)

    def live_gradient_bytes(self) -> int:
        """Gradient bytes held now (after backward): `grad_tensors` and those the optimizer
        keeps for its step (`coat_ds.memory.training_state.gradient_bytes`)."""
        return gradient_bytes(self.model, self.optimizer(), self.grad_tensors())

    def training_state(self, gradients: int) -> TrainingStateBytes:
        """This rank's training state by kind, read after a step; `gradients`: `live_gradient_bytes` after its backward."""
        return training_state_bytes(self.model, self.optimizer(), gradients)

    def close(self) -> None:
        if self.activations is not None:
            self.activations.remove()


def _make_optimizer(side: Side, params, device: torch.device) -> torch.optim.Optimizer:
    if side.is_coat:
        return CoatAdamW(params, **side.coat_kwargs)
    return torch.optim.AdamW(params, fused=device.type == "cuda", **side.adamw_kwargs)


class PlainTrainee(Trainee):
    """BF16 model + FP32 master weights in the optimizer, as DeepSpeed's bf16 mode keeps them,
    in one process without an engine."""

    def __init__(self, side: Side, model: nn.Module, device: torch.device):
        model = model.to(torch.bfloat16)
        super().__init__(side, model, device)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.masters = [p.detach().float() for p in self.params]
        self.opt = _make_optimizer(side, self.masters, device)

    def forward(self, idx, targets):
        return self.model(idx, targets)

    def backward(self, loss):
        loss.backward()

    @torch.no_grad()
    def step(self):
        # FP32 copies of the BF16 gradients exist only during the step, as in DeepSpeed's
        # bf16 mode: the meter's step peak sees them, the gradients figure (after backward) not.
        for m, p in zip(self.masters, self.params):
            m.grad = p.grad.float()
        self.opt.step()
        for m, p in zip(self.masters, self.params):
            m.grad = None
            p.copy_(m)
        self.zero_grad()

    def zero_grad(self):
        for p in self.params:
            p.grad = None
        for m in self.masters:
            m.grad = None

    def weight_tensors(self):
        return [*self.params, *self.masters]

    def grad_tensors(self):
        return [p.grad for p in self.params]

    def optimizer(self):
        return self.opt


class InBackwardTrainee(Trainee):
    """One process without an engine, CoatAdamW stepping in backward: its hooks fire on the
    tensors autograd fills, so the optimizer steps the model's own FP32 parameters, computed
    in BF16 under autocast (no BF16 copy beside FP32 masters, as PlainTrainee keeps), and
    each FP32 gradient is freed once stepped."""

    def __init__(self, side: Side, model: nn.Module, device: torch.device):
        super().__init__(side, model, device)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = _make_optimizer(side, self.params, device)

    def forward(self, idx, targets):
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            return self.model(idx, targets)

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.opt.step()  # closes the step: what is left in the last bucket, clipping state
        self.zero_grad()

    def zero_grad(self):
        self.opt.zero_grad(set_to_none=True)

    def weight_tensors(self):
        return list(self.params)

    def grad_tensors(self):
        return [p.grad for p in self.params]

    def optimizer(self):
        return self.opt


class DeepSpeedTrainee(Trainee):
    engine = "deepspeed"

    def __init__(self, side: Side, model: nn.Module, device: torch.device):
        super().__init__(side, model, device)
        # The coat_ds initializer builds CoatAdamW from the JSON; a baseline JSON passes through.
        self.ds, _, _, _ = initialize(model=model, config=side.config_path)

    def forward(self, idx, targets):
        return self.ds(idx, targets)

    def backward(self, loss):
        self.ds.backward(loss)

    def step(self):
        self.ds.step()

    def zero_grad(self):
        self.ds.optimizer.zero_grad(set_to_none=True)

    def weight_tensors(self):
        # Under ZeRO-3 a parameter's `data` is an empty placeholder and `ds_tensor` this
        # rank's partition; the FP32 master partitions are what the optimizer steps.
        params = [getattr(p, "ds_tensor", p.data) for p in self.ds.module.parameters()]
        return params + [t for t, _ in local_partitions(self.ds)]

    def grad_tensors(self):
        weights = {t.untyped_storage().data_ptr() for t in self.weight_tensors()}
        return [t for t in engine_gradients(self.ds) if t.untyped_storage().data_ptr() not in weights]

    def optimizer(self):
        return getattr(self.ds.optimizer, "optimizer", self.ds.optimizer)

    def training_state(self, gradients: int) -> TrainingStateBytes:
        # Between steps ZeRO-3's optimizer holds no param groups' tensors: the masters are the FP32 partitions.
        return training_state_bytes(self.ds.module, self.optimizer(), gradients, [t for t, _ in local_partitions(self.ds)])

    def close(self):
        super().close()
        module = self.ds.module
        self.ds.destroy()
        # ZeRO-3 pushes the model onto a module-global stack when it is set up, and
        # submodules whose forward an out-of-memory error interrupted stay on it; its
        # coordinator memoizes parameters to release per coordinator on the class. destroy()
        # clears neither, and through them the model, its partitions and the optimizer would
        # outlive the engine.
        release_zero3_references(module)


class FsdpTrainee(Trainee):
    engine = "fsdp"

    def __init__(self, side: Side, model: nn.Module, device: torch.device):
        super().__init__(side, model, device)
        # FP32 sharded parameters, gathered in BF16 for compute (FSDP2 mixed precision).
        self.model = setup_fsdp(model, mode="fsdp2", param_dtype=torch.bfloat16)
        self.opt = _make_optimizer(side, [p for p in self.model.parameters() if p.requires_grad], device)

    def forward(self, idx, targets):
        return self.model(idx, targets)

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def zero_grad(self):
        self.opt.zero_grad(set_to_none=True)

    def weight_tensors(self):
        return list(self.model.parameters())

    def grad_tensors(self):
        return [p.grad for p in self.model.parameters()]

    def optimizer(self):
        return self.opt


_TRAINEES = {"none": PlainTrainee, "deepspeed": DeepSpeedTrainee, "fsdp": FsdpTrainee}


def build_trainee(engine: str, side: Side, mcfg: ModelConfig, device: torch.device, seed: int) -> Trainee:
    torch.manual_seed(seed)  # identical initial weights on every rank and for both sides
    with torch.device(device):  # initialise on the GPU: a 7B model's CPU init takes minutes
        model = Llama(mcfg)
    if engine == "none" and side.step_in_backward:
        return InBackwardTrainee(side, model, device)
    return _TRAINEES[engine](side, model, device)
