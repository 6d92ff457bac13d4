"""`apply_plan`: put a `Plan`'s choice on each decoder layer of a model, in place, reversibly."""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .._compat.torch import set_activation_memory_budget
from ..activation import compress_activations
from ..config import ActivationConfig, Fp8LinearConfig
from ..linear import Fp8Linear, convert_to_fp8_linear
from .layers import decoder_layers
from .plan import Plan
from .recompute import is_recomputed, recomputed

__all__ = ["ApplyConfig", "apply_plan", "AppliedPlan"]


@dataclass(frozen=True)
class ApplyConfig:
    """How the FP8 choices are carried out.

    Attributes:
        activation: FP8 saved activations of "fp8"/"fp8_linear" layers; None: defaults
        fp8_linear: FP8 GEMMs of "fp8_linear" layers; None: defaults
        recompute_input_fp8: "recompute" layers keep their input until backward as FP8 codes (activation's format, groups)
    """

    activation: ActivationConfig | None = None
    fp8_linear: Fp8LinearConfig | None = None
    recompute_input_fp8: bool = False

    def __post_init__(self):
        if self.activation is not None and not isinstance(self.activation, ActivationConfig):
            raise TypeError(f"ApplyConfig.activation must be an ActivationConfig or None, "
                            f"got {type(self.activation).__name__}")
        if self.fp8_linear is not None and not isinstance(self.fp8_linear, Fp8LinearConfig):
            raise TypeError(f"ApplyConfig.fp8_linear must be an Fp8LinearConfig or None, "
                            f"got {type(self.fp8_linear).__name__}")
        if not isinstance(self.recompute_input_fp8, bool):
            raise TypeError(f"ApplyConfig.recompute_input_fp8 must be a bool, got {self.recompute_input_fp8!r}")


class AppliedPlan:
    """What `apply_plan` did to the model: the compression handle, and `remove()`."""

    def __init__(self, plan: Plan, activations, recomputed: list[nn.Module], converted: list[tuple[nn.Module, type]]):
        self.plan = plan
        self.activations = activations  # compress_activations' handle, or None
        self._recomputed = recomputed
        self._converted = converted
        self._budget_before = None  # torch's activation-memory budget before the plan set its own

    def remove(self) -> None:
        """Every layer back as it was (compression hooks off, linears plain, no checkpointing)."""
        if self.activations is not None:
            self.activations.remove()
            self.activations = None
        for layer in self._recomputed:
            if is_recomputed(layer):
                del layer.forward
        for m, cls in self._converted:
            m.__class__ = cls
            del m.fp8_config
        self._recomputed, self._converted = [], []
        if self._budget_before is not None:
            set_activation_memory_budget(self._budget_before)
            self._budget_before = None


def _check_layers(model: nn.Module, plan: Plan) -> dict[str, nn.Module]:
    layers = dict(decoder_layers(model))
    missing = [f for f, _ in plan.layers if f not in layers]
    if missing:
        raise ValueError(f"plan names layer(s) {missing[:4]} that the model does not have; its decoder layers "
                         f"are {list(layers)[:2]}...{list(layers)[-1:]} ({len(layers)})")
    unplanned = [f for f in layers if f not in dict(plan.layers)]
    if unplanned:
        raise ValueError(f"plan has no choice for layer(s) {unplanned[:4]} of the model ({len(unplanned)} in all)")
    for fqn, choice in plan.layers:
        if choice == "recompute" and "forward" in layers[fqn].__dict__:
            raise ValueError(f"layer {fqn}: its forward is already replaced (recomputed by an earlier apply_plan?)")
    return layers


def apply_plan(model: nn.Module, plan: Plan, *, config: ApplyConfig | None = None) -> AppliedPlan:
    """Give each decoder layer of `model` the plan's choice, in place; returns a handle whose
    `remove()` undoes it. Apply before `torch.compile` of the layers and before the engine
    wraps the model (FSDP2 `fully_shard`, DeepSpeed), as `compress_activations` and
    `convert_to_fp8_linear` are. The micro-batch is the caller's to use (`plan.micro_batch`).

    A plan with `compile_memory_budget` sets torch.compile's activation-memory budget
    (functorch's `activation_memory_budget` option) until `remove()`. torch reads it
    when a graph is compiled, for every graph compiled meanwhile, and does not recompile
    graphs compiled before: compile after applying.

    With `recompute_input_fp8`, a recomputed layer's checkpoint runs eagerly (traced, it
    would save the exact input): compile such layers with `compile_layer`, which compiles
    the forward inside the checkpoint, rather than `layer.compile()`."""
    config = config if config is not None else ApplyConfig()
    if not isinstance(config, ApplyConfig):
        raise TypeError(f"config must be an ApplyConfig, got {type(config).__name__}")
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a Plan, got {type(plan).__name__}")
    layers = _check_layers(model, plan)
    fp8_input = (config.activation or ActivationConfig()) if config.recompute_input_fp8 else None
    done = AppliedPlan(plan, None, [], [])
    try:
        if plan.compile_memory_budget is not None:
            done._budget_before = set_activation_memory_budget(plan.compile_memory_budget)
        for fqn, choice in plan.layers:
            layer = layers[fqn]
            if choice == "recompute":
                layer.forward = recomputed(layer.forward, fp8_input=fp8_input)
                done._recomputed.append(layer)
            elif choice == "fp8_linear":
                before = {id(m): type(m) for m in layer.modules() if not isinstance(m, Fp8Linear)}
                convert_to_fp8_linear(layer, config=config.fp8_linear)
                done._converted += [(m, before[id(m)]) for m in layer.modules()
                                    if isinstance(m, Fp8Linear) and id(m) in before]
        compressed = {f for f, c in plan.layers if c in ("fp8", "fp8_linear")}
        if compressed:
            done.activations = compress_activations(model, config=config.activation,
                                                    module_filter_fn=lambda m, fqn: fqn in compressed)
    except BaseException:
        done.remove()  # a half-applied plan is worse than none
        raise
    return done
