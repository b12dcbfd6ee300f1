"""Serves several jobs at once with mlx-lm's BatchGenerator (plain decoding,
continuous batching): each job's tokens go through its own detokenizer and
reply parser, out as the same events the DFlash path sends. Its caches are
the batch's own: a job served here leaves no prompt cache in the pool."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Optional

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from dflash_mlx.cache.decoding import decoding

from .errors import APIError
from .job import Done, Failed, Job, Progress, Usage
from .metrics import Generation, Metrics
from .path_choice import PathChoice
from .reply import ReplyParser, TokenLogprob

log = logging.getLogger("dflash_mlx.server")

# a batch size's speed is measured over a run's steps at that size, once this many (one step is noise)
MIN_TIMED_STEPS = 4


def can_batch(model) -> bool:
    """Whether mlx-lm can batch this model: every cache of it merges (mlx-lm's server asks the same)."""
    return all(hasattr(c, "merge") for c in make_prompt_cache(model))


def batched_figures(stream: _Stream) -> dict:
    """``usage.dflash`` of a batched reply: the DFlash figures' keys, every
    step a plain one (no drafts, no trees), and the largest batch it was decoded in."""
    return {
        "path": "batched",
        "batch_size": stream.largest_batch,
        "acceptance_length": None,
        "acceptance_rate": None,
        "cycles": stream.tokens,
        "block_sizes": [1],
        "plain_decoding": True,
        "plain_cycles": stream.tokens,
        "generation_tps": round(stream.generation_tps(), 2),
        "prompt_tps": round(stream.prompt_tps(), 2),
        "lookup_hits": 0,
        "lookup_tokens": 0,
        "rows_verified": 0,
        "tree_budget": None,
    }


class _Stream:
    """One job inside the batch: its text, stop strings, log-probs, counts."""

    def __init__(self, job: Job, tokenizer):
        self.job, self.tokenizer = job, tokenizer
        self.parser = ReplyParser(tokenizer, job.stops, job.structured, job.starts_in_reasoning, job.tools)
        self.detokenizer = tokenizer.detokenizer
        self.eos = set(tokenizer.eos_token_ids)
        self.tokens = 0
        self.largest_batch = 0
        self.pending: list[TokenLogprob] = []
        self.started = time.perf_counter()
        self.first_token_at: Optional[float] = None

    def generation_tps(self) -> float:
        if self.first_token_at is None or self.tokens < 2:
            return 0.0
        return (self.tokens - 1) / max(time.perf_counter() - self.first_token_at, 1e-9)

    def prompt_tps(self) -> float:
        if self.first_token_at is None:
            return 0.0
        return len(self.job.prompt) / max(self.first_token_at - self.started, 1e-9)

    def feed(self, token: int, logprobs: mx.array, batch_size: int) -> None:
        """One generated token: its text and log-probs sent as a Delta."""
        self.tokens += 1
        self.largest_batch = max(self.largest_batch, batch_size)
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        if token in self.eos:  # its text is not sent, as on the DFlash path
            return
        k = self.job.params.logprobs
        if k is not None:
            self.pending.append(self._logprob(token, logprobs, k))
        self.detokenizer.add_token(token)
        self._send(self.parser.feed(self.detokenizer.last_segment))

    def _logprob(self, token: int, logprobs: mx.array, k: int) -> TokenLogprob:
        text = self.tokenizer.decode
        scores = logprobs.astype(mx.float32)
        top = []
        if k > 0:
            ids = mx.argpartition(-scores, kth=k - 1)[:k]
            values = scores[ids]
            top = sorted(zip(ids.tolist(), values.tolist()), key=lambda p: -p[1])
        return TokenLogprob(text([token]), scores[token].item(), [(text([i]), v) for i, v in top])

    def _send(self, delta) -> None:
        if delta:
            delta.logprobs, self.pending = self.pending, []
            self.job.post(delta)

    def finish(self, reason: str) -> Done:
        self.detokenizer.finalize()
        self._send(self.parser.feed(self.detokenizer.last_segment))
        final = self.parser.finish()
        final.logprobs += self.pending
        finish = "stop" if self.parser.stopped or reason == "stop" else "length"
        if finish == "stop" and self.parser.made_tool_call:
            finish = "tool_calls"
        usage = Usage(len(self.job.prompt), self.tokens, 0, batched_figures(self))
        return Done(finish, self.parser.stop_sequence, usage, final)


class BatchDecoder:
    """Runs jobs batched; ``run`` returns once every job it took has finished."""

    def __init__(
        self,
        model,
        tokenizer,
        choice: PathChoice,
        *,
        max_batch: int = 8,
        prefill_step_size: int = 2048,
        metrics: Optional[Metrics] = None,
    ):
        self.model, self.tokenizer, self.choice = model, tokenizer, choice
        self.max_batch, self.prefill_step_size = max_batch, prefill_step_size
        self.metrics = metrics
        self.live = 0  # jobs the running batch has not finished
        self.timed: dict[int, list[float]] = {}

    @staticmethod
    def accepts(job: Job) -> bool:
        """Whether the batch can serve ``job`` as DFlash would: not a seeded
        sampled one (one batch shares one random stream, so its text would
        not be the seed's)."""
        p = job.params
        return p.temperature == 0 or p.seed is None

    def _sampler(self, job: Job):
        p = job.params
        if p.temperature == 0:
            return None  # the batch's own greedy sampler, one argmax for all
        return make_sampler(p.temperature, p.top_p, p.min_p, top_k=p.top_k)

    def run(self, jobs: list[Job], more: Callable[[int], list[Job]]) -> int:
        """Serve ``jobs``, and those ``more(room)`` hands over while they
        run (at most ``room``); returns how many jobs were served."""
        generator = BatchGenerator(
            self.model,
            stop_tokens=[[t] for t in self.tokenizer.eos_token_ids],
            completion_batch_size=self.max_batch,
            # one prompt at a time, in arrival order: the first request's first token waits for no other prefill
            prefill_batch_size=1,
            prefill_step_size=self.prefill_step_size,
        )
        streams: dict[int, _Stream] = {}
        self.timed: dict[int, list[float]] = {}  # batch size -> [steps, tokens, seconds] of this run
        served = 0
        decoding.enter()  # the prefix cache's writer waits for a batch as for DFlash
        try:
            served += self._admit(generator, streams, jobs)
            while streams:
                self._drop_cancelled(generator, streams)
                if len(streams) < self.max_batch:
                    served += self._admit(generator, streams, more(self.max_batch - len(streams)))
                if streams:
                    self._step(generator, streams)
        except Exception as e:  # a failure of the batch fails the jobs in it
            log.exception("batched generation failed")
            for stream in streams.values():
                stream.job.post(Failed(APIError(500, f"generation failed ({type(e).__name__}: {e}).")))
        finally:
            decoding.leave()
            self.live = 0
            generator.close()
            for size, (steps, tokens, seconds) in self.timed.items():
                if steps >= MIN_TIMED_STEPS:
                    self.choice.observe_batched(size, tokens / seconds)
        return served

    def _admit(self, generator: BatchGenerator, streams: dict[int, _Stream], jobs: list[Job]) -> int:
        jobs = [j for j in jobs if not j.cancelled.is_set()]
        if not jobs:
            return 0
        uids = generator.insert(
            [j.prompt for j in jobs],
            max_tokens=[j.params.max_tokens for j in jobs],
            samplers=[self._sampler(j) for j in jobs],
        )
        for uid, job in zip(uids, jobs):
            streams[uid] = _Stream(job, self.tokenizer)
            self.live = len(streams)
            if len(job.prompt) > self.prefill_step_size:
                job.post(Progress(0, len(job.prompt)))
        return len(jobs)

    def _drop_cancelled(self, generator: BatchGenerator, streams: dict[int, _Stream]) -> None:
        gone = [uid for uid, s in streams.items() if s.job.cancelled.is_set()]
        if gone:
            generator.remove(gone)
            for uid in gone:
                self._record(streams.pop(uid))
            self.live = len(streams)

    def _step(self, generator: BatchGenerator, streams: dict[int, _Stream]) -> None:
        start = time.perf_counter()
        self.choice.observe_clients(len(streams))
        prompted, generated = generator.next()
        for r in prompted:  # progress of prompts longer than a prefill step, as on the DFlash path
            job = streams[r.uid].job if r.uid in streams else None
            if job is not None and not r.end_of_prompt and len(job.prompt) > self.prefill_step_size:
                job.prefill_progress(*r.progress)
        finished = []
        for r in generated:
            stream = streams[r.uid]
            stream.feed(r.token, r.logprobs, len(generated))
            if r.finish_reason is not None or stream.parser.stopped:
                finished.append((r.uid, r.finish_reason))
        still_running = [uid for uid, reason in finished if reason is None]
        if still_running:  # stopped by a stop string: the batch no longer decodes it
            generator.remove(still_running)
        done = [(streams.pop(uid), reason) for uid, reason in finished]
        self.live = len(streams)  # before their clients hear: a client's next request is not company
        for stream, reason in done:
            stream.job.post(stream.finish(reason or "stop"))
            self._record(stream)
        if generated and not prompted:  # a step of decoding only: the batch's speed at its size, as served
            timed = self.timed.setdefault(len(generated), [0, 0, 0.0])
            timed[0] += 1
            timed[1] += len(generated)
            timed[2] += time.perf_counter() - start

    def _record(self, stream: _Stream) -> None:
        if self.metrics is None:
            return
        figures = Generation(len(stream.job.prompt), 0, stream.tokens, generation_tps=stream.generation_tps())
        self.metrics.record(figures, path="batched")
