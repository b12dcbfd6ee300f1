"""Whether any generation in this process is decoding right now: a
process-wide gate that generations enter and leave (a server's requests from
their preparing on), so that background work such as the prefix store's disk
writer can wait until decoding pauses.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class DecodingGate:
    """The generations decoding in this process (PromptCache.claim enters,
    release leaves), so that background work such as the prefix store's
    writer can wait until none is."""

    def __init__(self):
        self.changed = threading.Condition()
        self.running = 0
        self.idle_since = float("-inf")  # (time.monotonic) when the last generation ended

    def enter(self) -> None:
        with self.changed:
            self.running += 1

    def leave(self) -> None:
        with self.changed:
            self.running -= 1
            if self.running <= 0:
                self.idle_since = time.monotonic()
            self.changed.notify_all()

    def wait_idle(self, timeout: float, stop: Callable[[], bool] = lambda: False, quiet: float = 0.0) -> bool:
        """Wait until no generation has decoded for ``quiet`` seconds or
        ``stop()`` holds (True), or ``timeout`` seconds pass (False)."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while not stop():
                now = time.monotonic()
                if self.running <= 0 and now - self.idle_since >= quiet:
                    return True
                if now >= deadline:
                    return False
                # a generation's end (or wake) notifies; a quiet period's end is waited out
                until = deadline if self.running > 0 else min(deadline, self.idle_since + quiet)
                self.changed.wait(until - now)
            return True

    def wake(self) -> None:
        """Make waiters check their ``stop`` again."""
        with self.changed:
            self.changed.notify_all()


decoding = DecodingGate()
