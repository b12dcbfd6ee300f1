"""Runs one job on the decode loop: the best prompt cache from the pool,
stream_generate, the reply parser, events out; stops at a stop string, at
the end, or within one cycle of the client going away."""

from __future__ import annotations

import logging
from typing import Optional

from dflash_mlx import stream_generate

from .cache_pool import PromptCachePool
from .errors import APIError
from .job import Done, Failed, Job, Usage
from .metrics import Generation, Metrics
from .reply import ReplyParser, TokenLogprob

log = logging.getLogger("dflash_mlx.server")


def dflash_figures(last, block_sizes: set[int], tree_budget: int | str | None = None) -> dict:
    """DFlash's own figures for a reply, so a client can see what happened.
    The acceptance figures count drafting cycles only: null when every
    cycle was plain (nothing was drafted), not a 0 that reads as rejection.
    ``tree_budget``: the server's setting (None: blocks); with trees
    ``block_sizes`` are the rows each cycle verified."""
    plain_cycles = int(getattr(last, "plain_cycles", 0) or 0)
    drafted = int(last.cycles) > plain_cycles
    return {
        "path": "dflash",
        "acceptance_length": round(float(last.acceptance_length), 4) if drafted else None,
        "acceptance_rate": round(float(last.acceptance_rate), 4) if drafted else None,
        "cycles": int(last.cycles),
        "block_sizes": sorted(block_sizes),
        "plain_decoding": plain_cycles > 0,
        "plain_cycles": plain_cycles,
        "generation_tps": round(float(last.generation_tps), 2),
        "prompt_tps": round(float(getattr(last, "prompt_tps", 0.0)), 2),
        # prompt lookup: cycles whose drafts were looked up, and the tokens they committed
        "lookup_hits": int(getattr(last, "lookup_hits", 0)),
        "lookup_tokens": int(getattr(last, "lookup_tokens", 0)),
        # target rows the drafting cycles verified (a tree's nodes, or the blocks), and the trees asked for
        "rows_verified": int(getattr(last, "rows_verified", 0)),
        "tree_budget": tree_budget,
        # block "auto": what it was doing at the end and why, e.g. running plain steps
        "auto_reason": getattr(last, "auto_reason", None),
    }


class Decoder:
    def __init__(
        self,
        model,
        draft,
        tokenizer,
        pool: PromptCachePool,
        *,
        block_size=None,
        prefill_step_size: int = 2048,
        read_limit: Optional[int] = None,
        metrics: Optional[Metrics] = None,
        lookup: bool | str = False,
        tree_budget: int | str | None = None,
    ):
        self.model, self.draft, self.tokenizer = model, draft, tokenizer
        self.lookup = lookup  # stream_generate's: False, True or "auto"
        self.tree_budget = tree_budget  # stream_generate's: None, rows a cycle, or "auto"
        self.pool = pool
        self.block_size, self.prefill_step_size = block_size, prefill_step_size
        # with bounded caches a conversation runs past the context, but each
        # request may read fewer new prompt tokens than this (the context)
        self.read_limit = read_limit
        self.metrics = metrics

    def run(self, job: Job) -> None:
        """Serve ``job``; every outcome, failures included, goes to its events."""
        if self.read_limit is not None:
            new = len(job.prompt) - self.pool.held(job.prompt)
            if new >= self.read_limit:
                job.post(
                    Failed(
                        APIError(
                            400,
                            f"the prompt has {new} tokens no kept cache holds, and this model's context "
                            f"is {self.read_limit} tokens; shorten it.",
                            code="context_length_exceeded",
                        )
                    )
                )
                return
        cache, cached = self.pool.take(job.prompt)
        try:
            done = self._generate(job, cache, cached)
        except ValueError as e:  # bad generation arguments: the cache was not touched
            self.pool.give_back(cache, len(job.prompt))
            job.post(Failed(APIError(400, str(e))))
            return
        except Exception as e:  # a failure of this request only; its cache may be half-written
            log.exception("request failed")
            job.post(Failed(APIError(500, f"generation failed ({type(e).__name__}: {e}).")))
            return
        if done is not None:  # (the reply does not wait for its cache to be kept)
            job.post(done)
        self.pool.give_back(cache, len(job.prompt))

    def _generate(self, job: Job, cache, cached: int):
        p = job.params
        parser = ReplyParser(self.tokenizer, job.stops, job.structured, job.starts_in_reasoning, job.tools)
        responses = stream_generate(
            self.model,
            self.draft,
            self.tokenizer,
            job.prompt,
            max_tokens=p.max_tokens,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            min_p=p.min_p,
            seed=p.seed,
            block_size=self.block_size,
            prompt_cache=cache,
            prefill_step_size=self.prefill_step_size,
            prompt_progress=job.prefill_progress,
            logprobs=p.logprobs,
            lookup=self.lookup,
            tree_budget=self.tree_budget,
        )
        last, block_sizes = None, set()
        figures = Generation(len(job.prompt), cached)
        eos = set(self.tokenizer.eos_token_ids)
        pending: list[TokenLogprob] = []  # sent with the next text, so a chunk's log-probs are its tokens'
        try:
            for last in responses:
                if last.logprobs is not None:
                    pending += self._token_logprobs(last, eos)
                block_sizes.add(last.block_size)
                if last.accepted is not None:  # None: the prefill's first token, not a cycle
                    figures.add_cycle(last.block_size, last.accepted)
                figures.generated_tokens, figures.generation_tps = last.generation_tokens, last.generation_tps
                delta = parser.feed(last.text)
                if delta:
                    delta.logprobs, pending = pending, []
                    job.post(delta)
                if parser.stopped or job.cancelled.is_set():
                    break
        finally:
            responses.close()
            if self.metrics is not None:
                self.metrics.record(figures)
        if job.cancelled.is_set() or last is None:
            return None
        finish = "stop" if parser.stopped or last.finish_reason == "stop" else "length"
        final = parser.finish()
        final.logprobs += pending
        if finish == "stop" and parser.made_tool_call:
            finish = "tool_calls"
        usage = Usage(
            last.prompt_tokens, last.generation_tokens, cached, dflash_figures(last, block_sizes, self.tree_budget)
        )
        return Done(finish, parser.stop_sequence, usage, final)

    def _token_logprobs(self, response, eos: set[int]) -> list[TokenLogprob]:
        """A response's tokens but EOS (whose text is not sent) as TokenLogprobs."""
        text = self.tokenizer.decode
        tops = response.top_logprobs or [[] for _ in response.tokens]
        return [
            TokenLogprob(text([t]), lp, [(text([i]), v) for i, v in top])
            for t, lp, top in zip(response.tokens, response.logprobs, tops)
            if t not in eos
        ]
