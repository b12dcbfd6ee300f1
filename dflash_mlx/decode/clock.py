"""What a cycle costs, as ``auto`` is told it: the host's time between two
reads of results, split into launches, waits for results, the caller's
(while the loop is suspended at a yield) and the loop's own."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import TypeVar

import mlx.core as mx

from .cycle import Flight

T = TypeVar("T")


class CycleClock:
    # seconds: a read of a result already there takes less; a longer wait
    # means the device was still busy with the cycle
    WAITED = 2e-4

    def __init__(self):
        self._restart(time.perf_counter())

    def _restart(self, now: float) -> None:
        self.since = now
        self.launching = self.waiting = self.away = 0.0
        self.done_at: float | None = None

    def launch(self, start: Callable[[], Flight]) -> Flight:
        tic = time.perf_counter()
        flight = start()
        flight.launched_at = time.perf_counter()
        flight.launch_seconds = flight.launched_at - tic
        self.launching += flight.launch_seconds
        return flight

    def wait(self, *arrays: mx.array) -> None:
        """Wait for ``arrays``."""
        self.wait_for(lambda: mx.eval(*arrays))

    def wait_for(self, read: Callable[[], T]) -> T:
        """``read()``, which waits for the device; the first wait since the
        last read found the cycle being read finished when it ended."""
        tic = time.perf_counter()
        out = read()
        now = time.perf_counter()
        self.waiting += now - tic
        if self.done_at is None:
            self.done_at = now
        return out

    @contextmanager
    def caller(self):
        """The loop suspended at a yield: the caller's time, not a cycle's."""
        tic = time.perf_counter()
        try:
            yield
        finally:
            self.away += time.perf_counter() - tic

    def cost(self, flight: Flight) -> float:
        """``flight``'s seconds as a run of its size pays them, once it is read.
        The host's share is its launch and the loop's own work since the last
        read (the next launch and the caller's time are not this cycle's).
        Where the host then waited, the device was busy with the cycle from
        its start until the wait ended, which the host's share overlapped:
        that span, where longer, is what a run of its size pays a cycle."""
        now = time.perf_counter()
        own = flight.launch_seconds + (now - self.since) - self.away - self.launching - self.waiting
        seconds = own
        if self.waiting > self.WAITED and self.done_at is not None:
            seconds = max(own, self.done_at - max(self.since, flight.launched_at))
        self._restart(now)
        return seconds
