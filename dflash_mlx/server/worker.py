"""Many clients, one device: jobs queue up and one thread serves them in
arrival order (the decode loop owns the device): one at a time with DFlash,
or, with several clients and the measurements in favour, batched."""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Optional

from dflash_mlx.cache.decoding import decoding

from .batch import BatchDecoder
from .decoder import Decoder
from .job import Job, Progress
from .path_choice import PathChoice

if TYPE_CHECKING:
    from .ranks import Leader

log = logging.getLogger("dflash_mlx.server")

# DFlash replies shorter than this say little about its speed
MIN_MEASURED_TOKENS = 8


class Worker:
    def __init__(
        self,
        decoder: Decoder,
        batcher: Optional[BatchDecoder] = None,
        choice: Optional[PathChoice] = None,
        arriving: Callable[[], int] = lambda: 0,
        leader: Optional[Leader] = None,
    ):
        self.decoder, self.batcher = decoder, batcher
        self.leader = leader  # across ranks: each DFlash job, then the stop, to the other ranks
        self.choice = choice or PathChoice(mode="off")
        self.arriving = arriving  # requests on their way, not yet submitted (their prompts being prepared)
        self.jobs: queue.Queue[Optional[Job]] = queue.Queue()
        # jobs taken off the queue and not yet served, with whether the batch may serve them
        self.backlog: deque[tuple[Job, bool]] = deque()
        self.running: list[Job] = []
        self.batching = False  # whether the running jobs are a batch's
        self.served = 0
        self.stopping = False
        self.thread = threading.Thread(target=self._serve, name="dflash-decode", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        for job in list(self.running):
            job.cancel()
        self.jobs.put(None)
        self.thread.join(timeout=30)

    def submit(self, job: Job) -> None:
        # how many are in the server with it: a lone request of a busy server is served as one of many
        self.choice.observe_clients(self.together + 1)
        self.jobs.put(job)

    @property
    def queued(self) -> int:
        return self.jobs.qsize() + len(self.backlog)

    @property
    def together(self) -> int:
        """Requests in the server: waiting, or being decoded. Not a batch's
        finished ones, nor a DFlash job answered or cancelled while its cache
        is kept: a client's next request does not count its last."""
        if self.batching:
            return self.queued + self.batcher.live
        return self.queued + sum(not (job.answered or job.cancelled.is_set()) for job in self.running)

    def _batchable(self, job: Job) -> bool:
        """Whether the batch may serve ``job``: one it serves as DFlash would,
        whose prompt no kept cache holds the most of (DFlash would reuse it)."""
        if self.batcher is None or not self.batcher.accepts(job):
            return False
        return 2 * self.decoder.pool.held(job.prompt) < len(job.prompt)

    def _add(self, job: Optional[Job]) -> None:
        if job is None:
            self.stopping = True
        elif not job.cancelled.is_set():  # a client that left while it waited is not served
            self.backlog.append((job, self._batchable(job)))

    def _drain(self, wait: bool) -> None:
        """Moves queued jobs to the backlog (waiting for one if ``wait``)."""
        while not self.stopping:
            try:
                self._add(self.jobs.get(block=wait and not self.backlog))
            except queue.Empty:
                return

    def _batch(self, ahead: int) -> bool:
        """Whether to serve the ``ahead`` batchable jobs batched."""
        return self.batcher is not None and self.choice.batch(min(ahead, self.batcher.max_batch))

    def _batchable_ahead(self) -> int:
        """How many jobs at the head of the backlog the batch may serve: the
        batch takes jobs in arrival order, and none past one it cannot serve."""
        n = 0
        for _, batchable in self.backlog:
            if not batchable:
                break
            n += 1
        return n

    def _take_batchable(self, room: int) -> list[Job]:
        """Up to ``room`` batchable jobs off the head of the backlog; none to a
        running batch once the measurements favour DFlash at the size it would
        grow to (it runs down, and DFlash serves the rest)."""
        self._drain(wait=False)
        ahead, running = self._batchable_ahead(), self.batcher.max_batch - room
        if not ahead or running and not self.choice.batch_wins(min(running + ahead, self.batcher.max_batch)):
            return []
        taken = []
        while self.backlog and len(taken) < room and self._batchable_ahead():
            job, _ = self.backlog.popleft()
            if not job.cancelled.is_set():
                taken.append(job)
        self.running += taken
        return taken

    def _serve(self) -> None:
        while True:
            self._drain(wait=True)
            if self.stopping:
                if self.leader is not None:
                    self.leader.stop()
                return
            # a burst's first request on an idle server has company on its way: not served alone
            self.choice.observe_clients(self.queued + self.arriving())
            if self._batch(self._batchable_ahead()):
                self._run_batched()
            else:
                job, _ = self.backlog.popleft()
                self._run_dflash(job)

    def _run_batched(self) -> None:
        self.batching = True
        try:
            first = self._take_batchable(self.batcher.max_batch)
            self.served += self.batcher.run(first, self._take_batchable)
        except BaseException:  # BatchDecoder.run answers its own failures; this is a last guard
            log.exception("the decode worker caught an unexpected error")
        finally:
            self.running, self.batching = [], False

    def _run_dflash(self, job: Job) -> None:
        self.running = [job]
        decoding.enter()  # the prefix cache's writer waits for the prefix's copy and prefill too
        try:
            new = len(job.prompt) - self.decoder.pool.held(job.prompt)
            if new > self.decoder.prefill_step_size:  # a keep-alive before a long prefill
                job.post(Progress(0, new))
            metrics = self.decoder.metrics
            before = metrics.last if metrics is not None else None
            if self.leader is not None:
                self.leader.send(job, len(self.decoder.pool))
            self.decoder.run(job)
            measured = metrics.last if metrics is not None else None
            if measured is not before and measured.generated_tokens >= MIN_MEASURED_TOKENS:
                self.choice.observe_dflash(measured.generation_tps)
        except BaseException:  # Decoder.run answers its own failures; this is a last guard
            log.exception("the decode worker caught an unexpected error")
        finally:
            decoding.leave()
            self.running = []
            self.served += 1
