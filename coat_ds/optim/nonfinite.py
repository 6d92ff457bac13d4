"""Non-finite gradients in CoatAdamW: the check `nonfinite="raise"` makes before a step,
and the count of groups the kernels skipped, reported without a host sync in the step."""
from __future__ import annotations

import time
import warnings

import torch

__all__ = ["first_nonfinite", "SkipCounter"]

# A warning at most this often; each one says how many groups were skipped since the last.
WARN_INTERVAL_S = 60.0


def first_nonfinite(grads: list[torch.Tensor]) -> int | None:
    """Index of the first gradient whose step would be skipped (a NaN/inf element, or one
    whose square overflows float32 as the kernels compute it), else None. One fused max
    per device and dtype, one read back."""
    index = [i for i, g in enumerate(grads) if g.numel()]  # FSDP2 shards may be empty
    if not index:
        return None
    peaks = torch._foreach_norm([grads[i] for i in index], float("inf"))
    peak = torch.stack([p.to(peaks[0].device, torch.float32) for p in peaks]).cpu()
    bad = ~torch.isfinite(peak * peak)
    return index[int(bad.nonzero()[0, 0])] if bool(bad.any()) else None


class SkipCounter:
    """Groups skipped for non-finite values, one int64 counter per device, added to by the
    kernels. After each step a CUDA counter is copied to pinned host memory asynchronously
    and read at a later step once that copy has finished, so the warning costs no sync."""

    def __init__(self):
        self.counters: dict[torch.device, torch.Tensor] = {}
        self._host: dict[torch.device, tuple[torch.Tensor, object]] = {}
        self._reported = 0  # skipped groups already named in a warning
        self._last_warning = -float("inf")

    def counter(self, device: torch.device) -> torch.Tensor:
        if device not in self.counters:
            self.counters[device] = torch.zeros((), dtype=torch.int64, device=device)
        return self.counters[device]

    def total(self) -> int:
        """Groups skipped so far (reads every device's counter)."""
        return sum(int(c.item()) for c in self.counters.values())

    def _total_without_sync(self) -> int | None:
        total = 0
        for device, counter in self.counters.items():
            if device.type != "cuda":
                total += int(counter.item())
                continue
            pending = self._host.get(device)
            if pending is None or not pending[1].query():
                return None
            total += int(pending[0].item())
        return total

    def _start_copies(self) -> None:
        for device, counter in self.counters.items():
            if device.type == "cuda":
                buf = self._host[device][0] if device in self._host else torch.zeros(
                    (), dtype=torch.int64, pin_memory=True)
                buf.copy_(counter, non_blocking=True)
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))
                self._host[device] = (buf, event)

    def after_step(self) -> None:
        """Warn (at most every WARN_INTERVAL_S seconds) about groups skipped since the last
        warning, as far as the counters are known without waiting for the device."""
        total = self._total_without_sync()
        if total is not None:
            now = time.monotonic()
            if total > self._reported and now - self._last_warning >= WARN_INTERVAL_S:
                warnings.warn(
                    f"CoatAdamW skipped {total - self._reported} group(s) of non-finite gradients or moments "
                    f"since the last warning ({total} in all): their parameters and moments were left unchanged",
                    RuntimeWarning)
                self._reported, self._last_warning = total, now
        self._start_copies()
