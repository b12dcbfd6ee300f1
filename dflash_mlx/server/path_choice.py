"""Which path serves the requests waiting: DFlash one request at a time, or
mlx-lm's batched plain decoding of several at once; decided from running
measurements of both on this machine."""

from __future__ import annotations

import threading
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
    serving one request, and batched plain decoding in total per batch size.

    ``mode``: "auto" batches two or more requests when the batched
    estimate for that many could beat DFlash (measured there, or an upper
    bound from another size: total throughput grows at most linearly with
    the batch and does not fall as it grows), and a lone one only where
    plain decoding was measured faster than DFlash; "off" never batches;
    "always" batches every request it can, a lone one too."""

    mode: str = "auto"
    weight: float = 0.3  # of a new measurement in the average
    dflash_tps: Optional[float] = None
    batched_tps: dict[int, float] = field(default_factory=dict)
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

    def estimates(self) -> tuple[Optional[float], dict[int, float]]:
        """(DFlash's tokens/s, batched tokens/s by batch size), a snapshot."""
        with self.lock:
            return self.dflash_tps, dict(self.batched_tps)

    def batched_estimate(self, size: int) -> Optional[float]:
        """Batched total tokens/s at ``size``: measured, else the tightest
        bound the measured sizes set, else None (nothing measured yet)."""
        with self.lock:
            if size in self.batched_tps:
                return self.batched_tps[size]
            bounds = [tps * (size / n if n < size else 1.0) for n, tps in self.batched_tps.items()]
        return min(bounds) if bounds else None

    def batch(self, size: int) -> bool:
        """Whether to serve ``size`` waiting requests batched."""
        if self.mode == "always":
            return size >= 1
        if size < 1 or self.mode == "off":
            return False
        if size == 1:  # only where plain decoding measured faster than DFlash (a batch's last steps measure it)
            with self.lock:
                alone = self.batched_tps.get(1)
            return alone is not None and self.dflash_tps is not None and alone > self.dflash_tps
        if self.dflash_tps is None:
            return True
        estimate = self.batched_estimate(size)
        return estimate is None or estimate > self.dflash_tps
