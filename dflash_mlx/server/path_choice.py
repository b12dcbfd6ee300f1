"""Which path serves the requests waiting: DFlash one request at a time, or
mlx-lm's batched plain decoding of several at once; decided from running
measurements of both on this machine, and of how many clients it serves."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Optional

MODES = ("auto", "off", "always")


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"batching must be one of {', '.join(MODES)}; got {mode!r}.")
    return mode


@dataclass
class PathChoice:
    """Generated tokens per second, as exponential moving averages: DFlash
    serving one request, and batched plain decoding in total per batch size;
    and how many requests were in the server together lately.

    ``mode``: "auto" batches when the batch, at the size it would run at,
    measures within ``margin`` of DFlash or faster; "off" never batches;
    "always" batches every request it can, a lone one too. The size a batch
    would run at is the number waiting, or the most requests in the server
    together within the last ``window_s`` if more (those clients come back
    as their replies end and join it), at most ``max_batch``. At one, a lone
    request on a quiet server, it batches only where plain decoding alone
    measured faster than DFlash."""

    mode: str = "auto"
    max_batch: int = 8
    weight: float = 0.3  # of a new measurement in the average
    # several waiting go one at a time only if DFlash measured this much faster: within it the
    # measurements' noise decides, and a batch starts every waiting request at once
    margin: float = 1.1
    window_s: float = 2.0
    # after declining this many possible batches in a row, batch once: a batch measured slow in a
    # busy moment would otherwise never be measured again at that size
    retry_after: int = 8
    dflash_tps: Optional[float] = None
    batched_tps: dict[int, float] = field(default_factory=dict)
    declined: int = 0
    seen: dict[int, float] = field(default_factory=dict)  # requests together -> time.monotonic() last seen
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self):
        check_mode(self.mode)

    def _average(self, old: Optional[float], new: float) -> float:
        return new if old is None else (1 - self.weight) * old + self.weight * new

    def observe_dflash(self, tokens_per_s: float) -> None:
        if tokens_per_s > 0:
            with self.lock:
                self.dflash_tps = self._average(self.dflash_tps, tokens_per_s)

    def observe_batched(self, size: int, tokens_per_s: float) -> None:
        if size > 0 and tokens_per_s > 0:
            with self.lock:
                self.batched_tps[size] = self._average(self.batched_tps.get(size), tokens_per_s)

    def observe_clients(self, together: int, at: Optional[float] = None) -> None:
        """``together`` requests were in the server at once (running or
        waiting) at ``at`` (time.monotonic(); now by default)."""
        at = time.monotonic() if at is None else at
        with self.lock:
            self.seen[together] = max(at, self.seen.get(together, at))

    def clients(self) -> int:
        """The most requests in the server together within the last window_s (0: none)."""
        since = time.monotonic() - self.window_s
        with self.lock:
            return max((n for n, at in self.seen.items() if at >= since), default=0)

    def estimates(self) -> tuple[Optional[float], dict[int, float]]:
        """(DFlash's tokens/s, batched tokens/s by batch size), a snapshot."""
        with self.lock:
            return self.dflash_tps, dict(self.batched_tps)

    def batched_estimate(self, size: int) -> Optional[float]:
        """Batched total tokens/s at ``size``: measured, else the tightest
        bound the measured sizes set (total throughput grows at most linearly
        with the batch and does not fall as it grows), else None."""
        with self.lock:
            if size in self.batched_tps:
                return self.batched_tps[size]
            bounds = [tps * (size / n if n < size else 1.0) for n, tps in self.batched_tps.items()]
        return min(bounds) if bounds else None

    def size(self, waiting: int) -> int:
        """The size a batch of ``waiting`` requests would run at."""
        return min(max(waiting, self.clients()), self.max_batch)

    def batch_wins(self, waiting: int) -> bool:
        """Whether the measurements favour batching ``waiting`` requests (or
        a batch of that many admitting more), with no retry."""
        if self.mode == "always":
            return waiting >= 1
        if self.mode == "off" or waiting < 1:
            return False
        size = self.size(waiting)
        dflash = self.dflash_tps
        if size == 1:
            alone = self.batched_tps.get(1)
            return alone is not None and dflash is not None and alone > dflash
        if dflash is None:
            return True
        estimate = self.batched_estimate(size)
        return estimate is None or estimate * self.margin >= dflash

    def batch(self, waiting: int) -> bool:
        """Whether to start a batch for ``waiting`` requests."""
        if self.batch_wins(waiting):
            with self.lock:
                self.declined = 0
            return True
        if self.mode != "auto" or waiting < 1 or self.size(waiting) < 2:
            return False
        with self.lock:
            self.declined += 1
            retry = self.declined >= self.retry_after
            if retry:
                self.declined = 0
        return retry
