"""`compress_activations`: put the saved-tensor hooks around chosen modules of a model."""
from __future__ import annotations

import logging
import weakref
from typing import Callable

import torch
from torch import nn

from .._compat.torch import current_graph_task_id, inside_checkpoint, swap_functorch_options
from ..config import ActivationConfig
from .accounting import ActivationStats
from .hooks import SavedTensorCompressor
from .traced import compile_settings

__all__ = ["compress_activations", "ActivationCompression", "activation_stats"]

logger = logging.getLogger("coat_ds.activation")
# ActivationConfig.eager_min_region_numel's default on CUDA: eagerly the hooks cost host time per
# saved tensor (dozens per Llama decoder layer), which the GPU hides behind the layer's kernels
# only from about this size on (docs/benchmarks.md, "the eager size limits").
CUDA_EAGER_MIN_REGION_NUMEL = 2 ** 24


def _first_float(args, kwargs) -> torch.Tensor | None:
    """A region's first floating-point tensor argument (a decoder layer's hidden states; a
    whole causal LM's input ids are integers, so it has none)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return a
    return None

# model -> weak reference to its handle. The model's hooks keep the handle alive; a strong
# value here would keep the model alive through the handle's region list forever.
_HANDLES: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


def _handle_of(model: nn.Module) -> "ActivationCompression | None":
    ref = _HANDLES.get(model)
    return ref() if ref is not None else None


def _covering_region(modules: list[nn.Module]) -> "tuple[ActivationCompression, str] | None":
    """(handle, region) of a live compression whose regions hold one of `modules`, or None:
    nested regions would push a second pair of hooks inside the first."""
    ids = {id(m) for m in modules}
    for ref in list(_HANDLES.values()):
        handle = ref()
        if handle is None:
            continue
        for fqn, members in zip(handle.regions, handle._region_modules.values()):  # both in region order
            if any(id(m) in ids for m in members):
                return handle, fqn
    return None


def _inside_checkpoint_or_backward() -> bool:
    """True where our hooks must step aside.

    In backward (reentrant checkpoint's recomputation, or non-reentrant's inside its unpack
    hook) the recomputed tensors are used at once, so compressing them only costs time and,
    for non-reentrant checkpoint, would hide them from its recomputation hooks. Under the
    forward of a non-reentrant checkpoint, its hooks store nothing but placeholders, which
    beats any FP8 copy; ours, pushed above them, would take over and defeat the checkpoint."""
    return current_graph_task_id() != -1 or inside_checkpoint()


class ActivationCompression:
    """The handle `compress_activations` returns: statistics, pause, removal."""

    def __init__(self, model: nn.Module, regions: list[tuple[str, nn.Module]], config: ActivationConfig):
        self.config = config
        self._model = weakref.ref(model)
        self.compressor = SavedTensorCompressor(config)
        self._compile_settings = compile_settings(config)
        self.regions = [fqn for fqn, _ in regions]
        self._region_names = {id(m): fqn for fqn, m in regions}
        # (region class, numel) logged as too small to compress eagerly: the first as a
        # WARNING (shown without logging configured), the rest as INFO.
        self._told: set = set()
        self.enabled = True
        self._contexts: list = []
        self._handles = []
        linears = {}
        # A region's modules, listed once: walking module.buffers() on every forward costs
        # a generator per submodule. Buffers themselves are read live (they may be replaced).
        self._region_modules: dict[int, list[nn.Module]] = {}
        for _, region in regions:
            self._handles.append(region.register_forward_pre_hook(self._enter, with_kwargs=True))
            self._handles.append(region.register_forward_hook(self._exit, with_kwargs=True, always_call=True))
            mods = list(region.modules())
            self._region_modules[id(region)] = mods
            linears.update({id(m): m for m in mods if isinstance(m, nn.Linear)})
        for m in linears.values():
            self._handles.append(m.register_forward_pre_hook(self._linear_input))

    # Under torch.compile the region hooks run eagerly (a graph break at each region's
    # entry and exit); graphs compiled in between find our hooks on top of the stack and
    # get the FP8 quantization inlined (traced.py). Dynamo guards on which hooks are on
    # top, so a paused or removed compression recompiles rather than runs stale graphs.
    @torch.compiler.disable
    def _enter(self, module: nn.Module, args, kwargs):
        if not (self.enabled and torch.is_grad_enabled()) or _inside_checkpoint_or_backward():
            self._contexts.append(None)
            return
        comp = self.compressor
        # Entry: (hooks' context, AOTAutograd options before, whether eager tensors compress).
        compress = not self._too_small(module, args, kwargs)
        if compress:  # what the caller holds anyway: only the full pack reads it
            if self.config.keep_region_leaf_inputs:
                for a in (*args, *kwargs.values()):
                    for t in (a if isinstance(a, (tuple, list)) else (a,)):
                        if isinstance(t, torch.Tensor) and t.grad_fn is None:
                            comp.note_alive_anyway(t)
            for m in self._region_modules[id(module)]:
                for b in m._buffers.values():
                    comp.note_alive_anyway(b)
        ctx = torch.autograd.graph.saved_tensors_hooks(*(comp.hooks if compress else comp.eager_exact_hooks))
        ctx.__enter__()
        self._contexts.append((ctx, swap_functorch_options(self._compile_settings), compress))

    def _too_small(self, module: nn.Module, args, kwargs) -> bool:
        """Whether this call keeps its eager saved tensors exact: a first floating-point input
        of fewer than `eager_min_region_numel` elements (where the hooks' host work would slow
        the step more than the GPU hides). A region without such an input is compressed;
        compiled graphs compress whatever the size (`pack_eager_exact`)."""
        x = _first_float(args, kwargs)
        if x is None:
            return False
        limit = self.config.eager_min_region_numel
        if limit is None:
            limit = CUDA_EAGER_MIN_REGION_NUMEL if x.is_cuda else 0
        n = x.numel()
        if n >= limit:
            return False
        key = (type(module), n)
        if key not in self._told:
            level = logging.INFO if self._told else logging.WARNING
            self._told.add(key)
            logger.log(level, "compress_activations: %s (%s) called on an input of %d elements < "
                       "eager_min_region_numel %d: its eagerly saved tensors are not compressed (at this size the "
                       "hooks' host work would slow the step more than the GPU hides; compiled graphs, and "
                       "ActivationConfig(eager_min_region_numel=0), compress)",
                       self._region_names.get(id(module), "?") or "the model", type(module).__name__, n, limit)
        return True

    @torch.compiler.disable
    def _exit(self, module, args, kwargs, output):
        entry = self._contexts.pop() if self._contexts else None
        if entry is not None:
            ctx, previous, _ = entry
            swap_functorch_options(previous)
            ctx.__exit__(None, None, None)

    def _linear_input(self, module, args):
        # Traced as a no-op when compiling (no graph break per linear): a compiled graph
        # saves its own intermediates, so every compressed tensor is then per-group.
        if torch.compiler.is_compiling():
            return
        if self._contexts and self._contexts[-1] is not None and self._contexts[-1][2] and args:
            self.compressor.note_linear_input(args[0])

    def stats(self) -> ActivationStats:
        """Bytes saved for backward since the last `reset_stats()`, with and without compression."""
        return self.compressor.ledger.stats()

    def reset_stats(self) -> None:
        """Start a new accounting period (call once per optimizer step)."""
        self.compressor.ledger.reset()

    def remove(self) -> None:
        """Take every hook off; tensors already compressed still restore in backward."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        model = self._model()
        if model is not None and _handle_of(model) is self:
            del _HANDLES[model]


def compress_activations(model: nn.Module, *, config: ActivationConfig | None = None,
                         module_filter_fn: Callable[[nn.Module, str], bool] | None = None) -> ActivationCompression:
    """Store what autograd saves for backward inside `model` (or the modules that
    `module_filter_fn(module, fqn)` selects; default: the whole model) in FP8.

    Hooks are registered on the modules, so the model trains as before: wrap before or after
    FSDP2's `fully_shard`, with or without activation checkpointing. Selected modules nested
    in another selected module are covered by the outer one; a module inside, or holding, one
    that an earlier call still compresses is refused. Returns a handle for stats."""
    config = config if config is not None else ActivationConfig()
    if not isinstance(config, ActivationConfig):
        raise TypeError(f"config must be an ActivationConfig, got {type(config).__name__}")
    if _handle_of(model) is not None:
        raise RuntimeError("compress_activations was already applied to this model; call .remove() on its handle first")
    chosen = module_filter_fn or (lambda m, fqn: fqn == "")
    regions: list[tuple[str, nn.Module]] = []
    for fqn, m in model.named_modules():
        if any(fqn.startswith(r + ".") or r == "" for r, _ in regions):
            continue
        if chosen(m, fqn):
            regions.append((fqn, m))
    if not regions:
        raise ValueError("module_filter_fn selected no module")
    for fqn, region in regions:
        covering = _covering_region(list(region.modules()))
        if covering is not None:
            what = "the model given" if not fqn else f"its module {fqn!r}"
            other = "a model" if not covering[1] else f"region {covering[1]!r} of a model"
            raise RuntimeError(f"compress_activations: {what} overlaps {other} that compress_activations was already "
                               "applied to (one holds the other); nested compression would compress its tensors "
                               "twice. Call .remove() on that handle first, or select every module in one call "
                               "(module_filter_fn)")
    handle = ActivationCompression(model, regions, config)
    _HANDLES[model] = weakref.ref(handle)
    return handle


def activation_stats(model: nn.Module) -> ActivationStats | None:
    """The stats of the compression applied to `model`, or None (for the memory profiler)."""
    handle = _handle_of(model)
    return handle.stats() if handle is not None else None
