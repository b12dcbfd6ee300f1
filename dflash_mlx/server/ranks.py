"""Serving a target split across ranks (``mlx.launch``): rank 0 alone
listens, and hands each DFlash job it runs to the other ranks, which run
the same job through the same decode loop (``Follower``). Every rank sees
the same jobs in the same order, so each pool makes the same cache choices
and every rank runs the same generations: the split target's forward needs
every rank in every call. A client leaving stops every rank after the same
cycle (distributed.AgreedStop); stop strings stop them alike."""

from __future__ import annotations

from dataclasses import dataclass, fields

import mlx.core as mx

from ..distributed import share_from_first_rank
from .config import ServerConfig, make_decoder
from .job import Job, QuietJob

# What a job says about its generation; ``cancelled`` is rank 0's handler's alone.
SHARED = tuple(f.name for f in fields(Job) if f.name != "cancelled")


@dataclass(frozen=True)
class JobMessage:
    """One of rank 0's jobs as the others get it (picklable), with how many
    prompt caches rank 0's pool keeps as it starts the job."""

    job: dict
    kept: int


class Leader:
    """Rank 0's side: each DFlash job to the other ranks before it runs, then
    the stop (None) as the server shuts down. Called on the decode worker."""

    def __init__(self, group: mx.distributed.Group):
        self.group = group

    def send(self, job: Job, kept: int) -> None:
        share_from_first_rank(JobMessage({name: getattr(job, name) for name in SHARED}, kept), self.group)

    def stop(self) -> None:
        share_from_first_rank(None, self.group)


class Follower:
    """Any other rank's side (rank 0 runs ``create_app(..., group=group)``):
    each of rank 0's jobs run as rank 0 runs it, its events posted nowhere.
    Made, it has refused what rank 0 refuses; ``run`` returns once rank 0 stops."""

    def __init__(self, model, draft, tokenizer, config: ServerConfig, group: mx.distributed.Group):
        config.check_across_ranks()
        self.decoder = make_decoder(model, draft, tokenizer, config)
        self.decoder.pool.max_bytes = None  # rank 0's pool weighs the caches; this one keeps as many (``kept``)
        self.group = group

    def run(self) -> None:
        while (message := share_from_first_rank(None, self.group)) is not None:
            self.decoder.pool.keep_newest(message.kept)
            self.decoder.run(QuietJob(**message.job))
