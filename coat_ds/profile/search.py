"""The largest micro-batch that fits: doubling, then bisection, over a `fits(batch)` test.

Two tests: on a GPU a real training step at that batch (a CUDA out-of-memory error means
"does not fit"; memory is freed and the process goes on); on a CPU, or wherever asked, the
measured bytes against a budget: weights + gradients + optimizer states + engine buffers +
activation intercept + per-sample activation bytes * batch <= budget. Both assume more sequences never take less memory.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .measure import SideMeasurement, all_ranks_agree, free_after_oom, train_step

__all__ = ["Trial", "search_max_batch", "budget_fits", "CudaTrial"]


@dataclass(frozen=True)
class Trial:
    """One tried micro-batch."""

    batch: int  # sequences per rank
    fits: bool  # the step ran within memory (and the budget)
    peak_bytes: int | None  # CUDA: the allocator's peak of the step; budget test: the predicted total


def search_max_batch(fits: Callable[[int], tuple[bool, int | None]], limit: int,
                     say: Callable[[str], None] = print, label: str = "") -> tuple[int, list[Trial]]:
    """Largest b in [0, limit] with fits(b), assuming fits is monotone; 0 when 1 does not fit."""
    trials: list[Trial] = []

    def trial(b: int) -> bool:
        ok, peak = fits(b)
        trials.append(Trial(b, ok, peak))
        peak_txt = f", {peak / 1e9:.3f} GB" if peak is not None else ""
        say(f"[{label}] trial {len(trials)}: micro-batch {b} -> {'fits' if ok else 'does not fit'}{peak_txt}")
        return ok

    good, bad = 0, None
    b = 1
    while b <= limit:
        if not trial(b):
            bad = b
            break
        good, b = b, 2 * b
    if bad is None:  # every power of two up to the limit fitted
        if good == limit:
            return good, trials
        bad = limit + 1
    while bad - good > 1:
        mid = (good + bad) // 2
        if trial(mid):
            good = mid
        else:
            bad = mid
    return good, trials


def budget_fits(measurement: SideMeasurement, budget_bytes: float) -> Callable[[int], tuple[bool, int]]:
    def fits(b: int) -> tuple[bool, int]:
        total = measurement.predicted_total(b)
        return total <= budget_bytes, int(total)
    return fits


class CudaTrial:
    """fits(b): run one real training step at micro-batch b on the GPU.

    An out-of-memory error is caught, the half-built step's tensors dropped (gradients
    zeroed, garbage collected, the allocator's cache emptied) and "does not fit" returned.
    If the engine is left unusable by an OOM in the middle of its backward (ZeRO's reduction
    buckets half full), the next failing step rebuilds it through `rebuild` and retries once.
    `predicted(b)` (bytes, from the measured figures) skips batches far over `limit_bytes`:
    used with several ranks, where an OOM on one rank can hang the others."""

    def __init__(self, get_trainee: Callable, rebuild: Callable, seq_len: int, vocab: int, seed: int,
                 budget_bytes: float | None, say: Callable[[str], None],
                 predicted: Callable[[int], float] | None = None, limit_bytes: float | None = None):
        self.get_trainee, self.rebuild = get_trainee, rebuild
        self.seq_len, self.vocab, self.seed = seq_len, vocab, seed
        self.budget_bytes, self.say = budget_bytes, say
        self.predicted, self.limit_bytes = predicted, limit_bytes
        self.had_oom = False

    def _free(self) -> None:
        free_after_oom(self.get_trainee(), self.say)

    def _run(self, b: int) -> tuple[bool, int | None]:
        trainee = self.get_trainee()
        torch.cuda.synchronize(trainee.device)
        torch.cuda.reset_peak_memory_stats(trainee.device)
        oom = False
        try:
            train_step(trainee, b, self.seq_len, self.vocab, self.seed)
            torch.cuda.synchronize(trainee.device)
        except torch.cuda.OutOfMemoryError:
            oom = True
        # Outside the except block: the traceback and the frames holding the step's tensors are gone.
        peak = torch.cuda.max_memory_allocated(trainee.device)
        if oom:
            self.had_oom = True
            self.say(f"micro-batch {b}: CUDA out of memory; freeing and going on")
            self._free()
        ok = not oom and (self.budget_bytes is None or peak <= self.budget_bytes)
        return all_ranks_agree(ok, trainee.device), peak

    def __call__(self, b: int) -> tuple[bool, int | None]:
        # With several ranks an OOM on one rank mid-backward leaves the others waiting in a
        # collective: batches the measured figures put over the memory are not run. (Run
        # anyway within a margin, a 7B ZeRO-3 trial predicted just over ran out of memory on
        # one rank and hung the others.)
        over = self.predicted is not None and self.predicted(b) > self.limit_bytes
        # One rank skipping while another runs the step would hang the latter: skip together.
        if self.predicted is not None and not all_ranks_agree(not over, self.get_trainee().device):
            self.say(f"micro-batch {b}: predicted over the memory on a rank "
                     f"(here {self.predicted(b) / 1e9:.2f} GB); not run")
            return False, int(self.predicted(b))
        try:
            return self._run(b)
        except RuntimeError as e:
            if not self.had_oom:
                raise
            self.say(f"micro-batch {b}: engine unusable after an earlier OOM ({type(e).__name__}: {str(e)[:120]}); "
                     "rebuilding it and retrying once")
            self._free()
            self.rebuild()
            self.had_oom = False
            return self._run(b)
