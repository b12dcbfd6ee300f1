"""Many clients, one device: jobs queue up and one thread serves them in
arrival order (the decode loop owns the device)."""

from __future__ import annotations

import logging
import queue
import threading
from typing import Optional

from .decoder import Decoder
from .job import Job

log = logging.getLogger("dflash_mlx.server")


class Worker:
    def __init__(self, decoder: Decoder):
        self.decoder = decoder
        self.jobs: queue.Queue[Optional[Job]] = queue.Queue()
        self.active: Optional[Job] = None
        self.served = 0
        self.thread = threading.Thread(target=self._serve, name="dflash-decode", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        if self.active is not None:
            self.active.cancel()
        self.jobs.put(None)
        self.thread.join(timeout=30)

    def submit(self, job: Job) -> None:
        self.jobs.put(job)

    @property
    def queued(self) -> int:
        return self.jobs.qsize()

    def _serve(self) -> None:
        while (job := self.jobs.get()) is not None:
            if job.cancelled.is_set():  # its client left while it waited
                continue
            self.active = job
            try:
                self.decoder.run(job)
            except BaseException:  # Decoder.run answers its own failures; this is a last guard
                log.exception("the decode worker caught an unexpected error")
            finally:
                self.active = None
                self.served += 1
