"""`prepare`: one call that applies a recipe of coat_ds's model edits, each also public on its own.

A recipe (config.RecipeConfig) names the edits; `prepare` finds which of them the model has
something for, applies those in an order that composes (the head loss before the FP8 linears,
which leave the head to it; the fusions after the FP8 linears, which they hand their max to;
compression and recomputation last, around what the model then computes), and reports each
edit as applied, with what it touched, or skipped, with why. Nothing is applied twice: a model
prepared before is refused, since the hooks and recomputed layers cannot be stacked."""
from __future__ import annotations

import functools
import logging
from typing import Callable

import torch
from torch import nn

from ..activation import compress_activations
from ..activation.api import ActivationCompression
from ..config import ActivationConfig, RecipeConfig
from ..linear import Fp8Linear, convert_to_fp8_linear, fp8_gemm_available, fuse_rms_norms, fuse_swiglu
from ..linear.layer import compute_device
from ..loss import fuse_lm_head_loss
from ..loss.fuse import LossHead, hf_causal_lm_class
from ..plan.layers import decoder_layers
from ..plan.recompute import is_recomputed, recomputed
from .regions import compile_regions
from .report import PrepareReport, Step

__all__ = ["prepare"]

logger = logging.getLogger("coat_ds")
_PREPARED = "_coat_prepared_recipe"
_Filter = Callable[[nn.Module, str], bool]
_NO_LAYERS = "no decoder layer list found (or module_filter_fn leaves every layer out)"
_OFF = "off in this recipe"


def prepare(model: nn.Module, recipe: str = "speed", *, module_filter_fn: _Filter | None = None,
            **overrides) -> PrepareReport:
    """Apply `recipe` to `model` in place, before an engine or torch.compile wraps it; returns a
    `PrepareReport` (also logged at INFO on the "coat_ds" logger).

    Recipes (config.RecipeConfig.named): "speed" — FP8 linears, the eager fused RMSNorm and
    SwiGLU kernels, the fused LM-head loss; "memory" — speed + FP8 saved activations;
    "max_memory" — memory + every decoder layer recomputed in backward from an FP8 copy of
    its input, and `step_in_backward` suggested for CoatAdamW (report.optimizer_options).
    `overrides` set any RecipeConfig field: `prepare(model, "speed", head_loss=False,
    fp8_linear=Fp8LinearConfig(keep_weight_codes=True))`.

    Each edit applies where the model has something for it and is skipped, with the reason in
    the report, where it has not: Hugging Face Llama, Mistral, Qwen2 and Gemma models take all
    of them (Gemma's norms, 1 + weight, stay unfused); GPT-2 takes the head loss and compression
    (its Conv1D layers are not nn.Linear, its MLP is not gated); coat_ds.models.llama.Llama
    takes all but the SwiGLU fusion; any other module takes FP8 linears and compression.
    `module_filter_fn(module, fqn)` narrows which modules the FP8 linears and the fusions edit,
    which decoder layers are compressed (without it: the whole model) and recomputed, and
    whether the head's loss is fused.

    Under torch.compile: compile after prepare. The fused norms and SwiGLU then run their own
    torch code (Inductor fuses it). A whole-model compile (Trainer's torch_compile=True)
    compiles each decoder layer once, on its own, and runs the code between the layers eagerly
    (compile_regions); layers recomputed from FP8 inputs keep their checkpoint eager, so
    compile them with coat_ds.plan.compile_layer."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"prepare: model must be an nn.Module, got {type(model).__name__}")
    config = RecipeConfig.named(recipe, **overrides)
    done = getattr(model, _PREPARED, None)
    if done is not None:
        raise RuntimeError(f"prepare: this model was prepared before (recipe {done!r}); its hooks and layer edits "
                           "cannot be applied twice: prepare a fresh model")
    keep = module_filter_fn or (lambda m, fqn: True)
    steps = [_head_loss(model, config, keep), _fp8_linear(model, config, keep), _fuse_norms(model, config, keep),
             _fuse_swiglu(model, config, keep)]
    handle, step = _compress(model, config, keep, module_filter_fn is not None)
    steps += [step, _recompute(model, config, keep), _regions(model, config, keep)]
    setattr(model, _PREPARED, recipe)
    report = PrepareReport(recipe, _kind(model), tuple(steps),
                           {"step_in_backward": True} if config.step_in_backward else {}, handle)
    logger.info("%s", report)
    return report


def _kind(model: nn.Module) -> str:
    if hf_causal_lm_class(type(model)) is not None or type(model).__module__.startswith("transformers."):
        return f"Hugging Face {type(model).__name__}"
    if hasattr(model, "fused_head_loss"):
        return f"coat_ds {type(model).__name__}"
    return f"a {type(model).__name__} module"


def _edit(name: str):
    """Make `fn(model, config, keep) -> (applied, detail)` the recipe's edit `name`: skipped as
    "off in this recipe" where the config field of that name is unset."""
    def wrap(fn):
        @functools.wraps(fn)
        def run(model: nn.Module, config: RecipeConfig, keep: _Filter) -> Step:
            if not getattr(config, name):
                return Step(name, False, _OFF)
            return Step(name, *fn(model, config, keep))
        return run
    return wrap


def _head(model: nn.Module) -> tuple[str, nn.Module] | None:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else getattr(model, "head", None)
    if not isinstance(head, nn.Module):
        return None
    return next(((fqn, m) for fqn, m in model.named_modules() if m is head), None)


@_edit("head_loss")
def _head_loss(model: nn.Module, config: RecipeConfig, keep: _Filter) -> tuple[bool, str]:
    head = _head(model)
    if head is not None and not keep(head[1], head[0]):
        return False, f"module_filter_fn leaves the head ({head[0]}) out"
    try:
        fuse_lm_head_loss(model, chunk_tokens=config.head_loss_chunk_tokens)
    except TypeError as e:  # not a model it knows: its message says which are
        return False, str(e).removeprefix("fuse_lm_head_loss: ")
    chunk = config.head_loss_chunk_tokens
    return True, (f"{head[0]}: the loss in chunks of {chunk if chunk else 'about 256 MiB of'} "
                  f"{'tokens' if chunk else 'logits'}, never the full logits")


@_edit("fp8_linear")
def _fp8_linear(model: nn.Module, config: RecipeConfig, keep: _Filter) -> tuple[bool, str]:
    head = _head(model)
    before = {id(m) for m in model.modules() if isinstance(m, Fp8Linear)}
    convert_to_fp8_linear(model, config=config.fp8_linear,
                          module_filter_fn=lambda m, fqn: keep(m, fqn) and (head is None or m is not head[1]))
    converted = sum(1 for m in model.modules() if isinstance(m, Fp8Linear) and id(m) not in before)
    linears = [m for m in model.modules() if type(m) is nn.Linear or isinstance(m, LossHead)]
    left = f"{len(linears)} left as they are (the head, dims not multiples of 16, module_filter_fn)"
    if not converted:
        others = sorted({type(m).__name__ for m in model.modules() if type(m).__name__ in ("Conv1D",)})
        why = f"its projections are {', '.join(others)}, not nn.Linear" if others else "no nn.Linear to convert"
        return False, why + (f" ({left})" if linears else "")
    device = compute_device(model)
    fp8 = config.fp8_linear.fp8_gemm
    path = ("GEMMs in FP8" if fp8 == "on" or (fp8 == "auto" and fp8_gemm_available(device)) else
            f"GEMMs in the input's precision (fp8_gemm={fp8!r}; {device} has no FP8 GEMMs), the input saved in FP8")
    return True, f"{converted} nn.Linear -> Fp8Linear{', ' + left if linears else ''}; on {device}: {path}"


@_edit("fuse_norms")
def _fuse_norms(model: nn.Module, config: RecipeConfig, keep: _Filter) -> tuple[bool, str]:
    fused = fuse_rms_norms(model, config=config.fp8_linear, module_filter_fn=keep)
    norms = ", ".join(sorted({type(m).__name__ for m in model.modules()
                              if type(m).__name__.endswith("Norm") and not type(m).__name__.startswith("Fused")}))
    if not fused:
        return False, "no RMSNorm of either known order" + (f" ({norms} left as they are)" if norms else "")
    rest = f"; {norms} left as they are" if norms else ""
    return True, f"{fused} RMSNorm modules in one kernel each way (eager; compiled, their own code){rest}"


@_edit("fuse_swiglu")
def _fuse_swiglu(model: nn.Module, config: RecipeConfig, keep: _Filter) -> tuple[bool, str]:
    fused = fuse_swiglu(model, config=config.fp8_linear, module_filter_fn=keep)
    if not fused:
        gated = any(all(hasattr(m, p) for p in ("gate_proj", "up_proj", "down_proj")) for m in model.modules())
        return False, ("its gated MLPs' activation is not SiLU (see the coat_ds.linear log)" if gated else
                       "no gated MLP (gate_proj, up_proj, down_proj, act_fn) found")
    return True, f"{fused} SwiGLU MLPs: silu(gate) * up in one kernel each way (eager; compiled, their own code)"


def _layers(model: nn.Module, keep: _Filter) -> list[tuple[str, nn.Module]]:
    try:
        return [(fqn, m) for fqn, m in decoder_layers(model) if keep(m, fqn)]
    except ValueError:
        return []


def _compress(model: nn.Module, config: RecipeConfig, keep: _Filter,
              filtered: bool) -> tuple[ActivationCompression | None, Step]:
    """The compression step and its handle: the whole model, or with a filter the decoder
    layers it accepts (the model as a whole where it has none)."""
    name, c = "compress_activations", config.compress_activations
    if c is None:
        return None, Step(name, False, _OFF)
    layers = _layers(model, keep) if filtered else []
    if not filtered or (not layers and keep(model, "")):
        regions, where = None, "the whole model"
    elif not layers:
        return None, Step(name, False, "module_filter_fn leaves out the model and every decoder layer")
    else:
        chosen = {fqn for fqn, _ in layers}
        regions, where = (lambda m, fqn: fqn in chosen), f"{len(chosen)} decoder layers"
    handle = compress_activations(model, config=c, module_filter_fn=regions)
    return handle, Step(name, True, f"{where}: linear inputs in {c.linear_input_format} per tensor, other saved "
                                    f"tensors in {c.other_format} per group of {c.group_size}")


@_edit("recompute")
def _recompute(model: nn.Module, config: RecipeConfig, keep: _Filter) -> tuple[bool, str]:
    layers = _layers(model, keep)
    if not layers:
        return False, _NO_LAYERS
    fp8_input = config.compress_activations or ActivationConfig()
    for _, layer in layers:
        if not is_recomputed(layer):
            layer.forward = recomputed(layer.forward, fp8_input=fp8_input)
    return True, (f"{len(layers)} decoder layers recomputed in backward from their input kept as "
                  f"{fp8_input.other_format} codes (compile them with coat_ds.plan.compile_layer)")


@_edit("compile_regions")
def _regions(model: nn.Module, config: RecipeConfig, keep: _Filter) -> tuple[bool, str]:
    n = compile_regions(model, module_filter_fn=keep)
    if not n:
        return False, _NO_LAYERS
    return True, (f"{n} decoder layers: under a whole-model torch.compile each compiles on its own, one graph for "
                  "all, and the code between them runs eagerly")
