"""A rank that dies must not leave the others waiting in a collective until the process-group
timeout: every rank beats a heartbeat into the launch's rendezvous store (the TCPStore at
MASTER_ADDR:MASTER_PORT), and watches the others'.

A rank whose heartbeat has not moved for `timeout_s` is gone (killed, crashed, its host down):
each survivor prints which rank, and how to go on (the checkpoint to resume from), and ends with
exit status 1. A rank whose run raised says so in the store before it ends, and the others end
at once naming it and its error. If the store itself stops answering, the process that held it
is gone (rank 0's, or the launcher agent's under torchrun), and the survivors end saying so.
A survivor whose own collective failed first (gloo fails at once when a peer's connection
closes) waits for the heartbeats to show which rank is gone before it ends.

Launchers on one machine (torchrun, deepspeed) end the remaining ranks themselves when one dies;
this covers the cases they do not (several machines, launchers that do not watch their ranks),
and an NCCL collective blocked on a dead peer, which no Python exception interrupts.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from ..io.checkpoint_folders import find_checkpoint
from ..io.safe_load import CheckpointError

__all__ = ["RankWatchdog", "start_watchdog", "resume_hint"]

_DONE = 1 << 52  # added to a rank's counter when its run has finished
_FAILED = "failed"


class RankWatchdog:
    """Heartbeats of every rank through the rendezvous store; see the module's doc. `hint()`
    says how to go on after a failure (it is called only then)."""

    def __init__(self, timeout_s: float, hint: Callable[[], str]):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.timeout_s, self.hint = timeout_s, hint
        self.interval = max(0.2, min(5.0, timeout_s / 6))
        self.address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        # A client of its own: the process group's is busy inside collectives.
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(seconds=max(5.0, self.interval * 2)), wait_for_workers=False)
        # Keys per attempt: torchrun's store outlives a restarted attempt's ranks.
        self.store = dist.PrefixStore(f"coat_ds/heartbeat/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/",
                                      store)
        self.keys = [f"rank{r}" for r in range(self.world)]
        for r, key in enumerate(self.keys):  # every key exists from here on: multi_get would wait for a missing one
            self.store.add(key, int(r == self.rank))  # this rank's first beat
        self.lock = threading.Lock()
        self.seen = {r: (None, time.monotonic()) for r in range(self.world) if r != self.rank}
        self.done = set()
        self.finished = False
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="coat_ds-rank-watchdog", daemon=True)
        self.thread.start()

    def finish(self) -> None:
        """This rank's run ended well: the others stop watching it."""
        with self.lock:
            self.store.add(self.keys[self.rank], _DONE)
        self.finished = True

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()

    def failed(self, error: BaseException) -> None:
        """Call on the main thread when the run raised `error`, before re-raising it. If a
        peer's death caused it, this ends the process with the message naming that rank;
        otherwise it tells the others that this rank failed, and returns. A SystemExit or
        KeyboardInterrupt only stops the watchdog: train.py exits so on purpose, on every rank."""
        if not isinstance(error, Exception):
            self.stop()
            return
        # Every other rank alive means a beat of each after this first read; else the thread
        # finds the silent one first and ends the process.
        _, base = self._read()
        deadline = time.monotonic() + self.timeout_s + 2 * self.interval
        while time.monotonic() < deadline:
            time.sleep(self.interval / 2)
            failure, counts = self._read()
            if failure and not failure.startswith(f"rank {self.rank}:"):
                self._end(_failed_rank(failure))  # another rank failed first; this one's error followed
            if all(c > b or c >= _DONE for r, (c, b) in enumerate(zip(counts, base)) if r != self.rank):
                break
        first = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
        with self.lock:
            self.store.compare_set(_FAILED, "", f"rank {self.rank}: {first[:500]}")
        self.stop()

    def _read(self, beat: bool = False) -> tuple[str | None, list[int]]:
        """(the failure a rank reported or None, every rank's heartbeat count), after a beat of
        this rank's with `beat`. Ends the process if the store does not answer, unless this rank
        has finished (the store's holder may end first then)."""
        try:
            with self.lock:
                if beat:
                    self.store.add(self.keys[self.rank], 1)
                failure = self.store.get(_FAILED).decode() if self.store.check([_FAILED]) else None
                return failure, [int(v) for v in self.store.multi_get(self.keys)]
        except Exception as e:  # noqa: BLE001 (any error of the store's client: it is gone)
            if self.finished or self.stopped.is_set():
                raise SystemExit from None  # ends the thread; the main thread goes on
            self._end(f"the rendezvous store at {self.address} stopped answering ({type(e).__name__}); the process "
                      "that held it, rank 0's (or the launcher's agent under torchrun), is gone")

    def _run(self) -> None:
        while not self.stopped.wait(self.interval):
            failure, counts = self._read(beat=True)
            if failure and not failure.startswith(f"rank {self.rank}:"):
                self._end(_failed_rank(failure))
            now = time.monotonic()
            for r, count in enumerate(counts):
                if r == self.rank:
                    continue
                if count >= _DONE:
                    self.done.add(r)
                elif count != self.seen[r][0]:
                    self.seen[r] = (count, now)
            gone = [r for r, (_, changed) in self.seen.items() if r not in self.done and now - changed > self.timeout_s]
            if gone:
                who = f"rank{'s' * (len(gone) > 1)} {', '.join(map(str, gone))} of {self.world}"
                self._end(f"{who} stopped answering: no heartbeat for {self.timeout_s:g} s (heartbeat_timeout_s); the "
                          "process was killed or crashed, or its host is unreachable")

    def _end(self, why: str) -> None:
        sys.stdout.flush()
        print(f"FATAL on rank {self.rank}: {why}. Ending this rank now instead of waiting in a collective until the "
              f"process-group timeout. {self.hint()}", file=sys.stderr, flush=True)
        os._exit(1)


def _failed_rank(failure: str) -> str:
    rank, _, what = failure.partition(": ")
    return f"{rank} failed with {what} (its own log has the traceback)"


def start_watchdog(timeout_s: float, hint: Callable[[], str]) -> RankWatchdog | None:
    """A started RankWatchdog, or None where there is nothing to watch (one rank, or
    `timeout_s` 0) or no rendezvous store to watch through (no MASTER_ADDR:MASTER_PORT)."""
    if timeout_s <= 0 or not dist.is_initialized() or dist.get_world_size() == 1 or "MASTER_PORT" not in os.environ:
        return None
    return RankWatchdog(timeout_s, hint)


def resume_hint(save_dir: str, resumed_from: str) -> str:
    """How to go on after a failure: the checkpoint a relaunch resumes from."""
    if save_dir:
        try:
            found = find_checkpoint(save_dir)
            return (f"To go on, relaunch every rank with --resume {save_dir} (its newest complete checkpoint: "
                    f"{found.path}, step {found.step}).")
        except (FileNotFoundError, CheckpointError):
            pass
        if resumed_from:
            return f"No checkpoint saved in {save_dir} yet: relaunch with --resume {resumed_from} to go on."
        return f"No checkpoint saved in {save_dir} yet: relaunch to start again."
    if resumed_from:
        return f"This run saves no checkpoints (save_dir is empty): relaunch with --resume {resumed_from} to go on."
    return ("This run saves no checkpoints (save_dir is empty): relaunch to start again, with --save-dir DIR to keep "
            "them.")
