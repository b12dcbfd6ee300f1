"""One DFlash cycle on the device: draft, verify, accept, keep.

Between cycles the state is ``last`` (the last committed token, not yet in
the caches), ``length`` (positions both caches hold) and the caches; a cycle
reads and returns them without the host, so the next cycle can be queued
while this one runs. Rollback is setting both caches' length to
length + accepted + 1 on the device. A block of 1 is a plain target step; its
tapped states go into the drafter's context in one ``extend`` when drafting
resumes or the decode ends (``feed_deferred``). With prompt lookup the cycle
also writes its tokens to a device history of the committed ones and drafts a
looked-up continuation where one is found (draft/lookup.py).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass

import mlx.core as mx

from .. import compute_dtype
from ..device import constant_arange, device_scalar
from ..draft.dflash import DFlashDraft
from ..draft.lookup import LookupDraft, LookupParams, TokenHistory, agreeing, find, find_believed
from ..draft.tree import TreeParams, accepted_path, build_tree
from ..kv.buffer import BufferKVCache, DeviceLengthCache, set_lengths
from ..kv.window import is_buffer
from ..targets import DenseTarget
from ..targets.recurrent import DeltaCache
from .sampling import SamplingParams, accept_proposals, accepted_count, pick, position_key, seed_words
from .traces import traces_for


@dataclass
class Flight:
    """A queued cycle: its block size and the arrays it will produce."""

    block_size: int
    result: mx.array  # [1 + bs]: accepted drafts a, then tokens whose first a + 1 are committed
    last: mx.array
    length: mx.array
    launch_seconds: float = 0.0  # the host's, to build and queue it
    launched_at: float = 0.0  # time.perf_counter() once queued
    new_shape: bool = False  # it built new graphs: not a measure of its size's cost
    rows: int = 0  # the target rows it verifies (a tree's nodes, or the block)
    # With log-probs asked for: [bs, 1 + k] the picked token's then the top k's, and [bs, k] their ids.
    logprobs: mx.array | None = None
    top_ids: mx.array | None = None
    # With lookup: [a match was found, the block's drafts were looked up, the
    # drafts the other chain would have had accepted (a lower bound; -1 unknown)].
    lookup: mx.array | None = None


@dataclass(frozen=True)
class Plan:
    """What a cycle of one size verifies: the drafter's block, the target's
    rows, and whether they are a tree's nodes."""

    block: int
    rows: int
    tree: bool = False


def token_logprobs(logits: mx.array, tokens: mx.array, k: int):
    """The target's raw log-softmax [R, 1 + k] at ``tokens`` [R] then at the
    top ``k`` tokens (descending), and the top tokens' ids [R, k] (None for k 0)."""
    logprobs = logits.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logprobs, tokens[:, None], axis=-1)
    if k == 0:
        return chosen, None
    top = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
    values = mx.take_along_axis(logprobs, top, axis=-1)
    order = mx.argsort(-values, axis=-1)
    top = mx.take_along_axis(top, order, axis=-1).astype(mx.int32)
    return mx.concatenate([chosen, mx.take_along_axis(values, order, axis=-1)], axis=-1), top


def traceable(caches) -> bool:
    """Whether every cache can be handed to a compiled cycle: plain,
    quantized and rotating buffers, and delta-net states."""
    return all(isinstance(c, (DeviceLengthCache, DeltaCache)) for c in caches)


class Cycle:
    # None: compile where launches dominate a cycle (a GPU, or a CPU on a fast
    # BLAS with g++ to build fused kernels), not where the products do.
    compile_graphs: bool | None = None
    defer_feed: bool = True

    def __init__(
        self,
        target: DenseTarget,
        draft: DFlashDraft,
        caches,
        sampling: SamplingParams,
        seed: int,
        logprobs: int | None = None,
        *,
        lookup: LookupParams | None = None,
        tree: TreeParams | None = None,
    ):
        self.target, self.draft, self.caches = target, draft, caches
        self.logprobs = logprobs  # None: none computed; k: the picked token's and the top k
        self.lookup_only = isinstance(draft, LookupDraft)
        self.lookup = lookup if lookup is not None or not self.lookup_only else LookupParams()
        # Draft trees where the drafter gives distributions and the target can verify one.
        takes = tree is not None and not self.lookup_only and target.takes_trees(caches.target)
        self.tree = tree if takes else None
        self.history: TokenHistory | None = None  # made by start_lookup
        # beside a drafter, whether a match is drafted from; an input of the graph, not a key
        self.lookup_on, self.lookup_enabled = True, mx.array(True)
        compiled = self.compile_graphs
        if compiled is None:
            compiled = mx.default_device().type == mx.DeviceType.gpu or (
                compute_dtype.on_fast_blas(target.dtype) and shutil.which("g++") is not None
            )
        self.compiled = compiled and traceable(caches.target + caches.draft)
        self.sampling = sampling
        self.temperature = sampling.temperature
        self.seed = seed_words(seed) if self.temperature > 0 else None
        self.taps = list(draft.config.target_layer_ids)
        self.mask_id = draft.config.mask_token_id
        self.selects = draft.selects_candidates
        self.draft_fused = draft.fused_projections()
        self.traces = traces_for(target, draft)
        self.defers = self.defer_feed and bool(caches.draft) and all(type(c) is BufferKVCache for c in caches.draft)
        # Plain steps' tapped states not in the drafter's context yet, from deferred_from on.
        self.deferred: list[mx.array] = []
        self.deferred_from: mx.array | None = None
        self.deferred_bound = 0
        self._plans: dict[int, Plan] = {}
        self._planned_over = None  # the first target cache the plans were made over (quantizing replaces it)

    def start_lookup(self, committed: list[int]) -> None:
        """The history lookup reads: every committed token, the last one included."""
        if self.lookup is not None:
            self.history = TokenHistory(committed)

    def enable_lookup(self, on: bool) -> None:
        """Whether later cycles draft a match beside the drafter (read on the device)."""
        if self.lookup_on != on:
            self.lookup_on, self.lookup_enabled = on, mx.array(on)

    def first_token(self, last_logits: mx.array, position: int) -> mx.array:
        """The token after the prompt, from the prefill's last logits [V]."""
        return pick(last_logits[None], mx.array([position], mx.int32), self.sampling, self.seed)

    def first_logprobs(self, last_logits: mx.array, token: mx.array):
        """``token_logprobs`` of the first token; (None, None) when not asked for."""
        if self.logprobs is None:
            return None, None
        return token_logprobs(last_logits[None], token, self.logprobs)

    def would_build(self, size: int, bound: int) -> bool:
        """Whether a cycle of ``size`` launched now at ``bound`` would build new graphs."""
        return self._shape(size, bound) not in self.traces.shapes

    def plan(self, size: int) -> Plan:
        """What a cycle of ``size`` verifies, decided once a size over the same caches."""
        first = self.caches.target[0] if self.caches.target else None
        if first is not self._planned_over:
            self._plans, self._planned_over = {}, first
        plan = self._plans.get(size)
        if plan is None:
            plan = self._plans[size] = self._plan(size)
        return plan

    def _plan(self, size: int) -> Plan:
        """A tree of ``size`` rows over the tree's block while the caches take
        trees (not once they are quantized); else a block of the size (at
        most the tree's block: a tree's size may exceed it)."""
        tree = self.tree
        if tree is not None and size > 2 and self.target.takes_trees(self.caches.target):
            return Plan(tree.block_size, tree.rows(size), tree=True)
        block = size if tree is None else min(size, tree.block_size)
        return Plan(block, block)

    def _shape(self, size: int, bound: int) -> tuple[int, int, int]:
        """(size, rows, the drafter's buffer width after its block) for a
        launch at ``bound``: what its graphs are built for. (Not the drafter's
        own bound: a queued cycle's block runs it ahead of the launch's.)"""
        plan = self.plan(size)
        block, rows = plan.block, plan.rows
        if not self.caches.draft:
            return size, rows, self.history.room(bound + block + 1)
        first = self.caches.draft[0]
        if size > 1 and self.deferred:
            return size, rows, first.room(self.deferred_bound + len(self.deferred) + block)
        return size, rows, first.room(bound + block)

    def launch(self, size: int, last: mx.array, length: mx.array, bound: int, exact: bool = False) -> Flight:
        """Build a cycle's graph and queue it without waiting for the device.
        ``bound``: a host-side upper bound on ``length``; ``exact``: it is the
        length. An exact plain step runs uncompiled: its widths change every step."""
        shape = self._shape(size, bound)
        new_shape = shape not in self.traces.shapes
        self.traces.shapes.add(shape)
        if size > 1 and self.deferred:
            self._feed(len(self.deferred))
        if self.history is not None:
            block = self.plan(size).block
            self.history.reserve(bound + block + 1)
            self.history.bound = bound + block
        exact_step = size == 1 and exact
        if self.compiled and not exact_step:
            # new_shape: whether it traced, not the shape's guess (which misses widths that grow apart)
            out = self._run_compiled(size, last, length, bound)
            result, new_last, new_length, taps, scores, looked, new_shape = out
        else:
            at_host = exact_step and all(is_buffer(c) for c in self.caches.target)
            read = "exact" if exact_step else "bound"
            result, new_last, new_length, taps, scores, looked = self._build(
                size, last, length, bound, self.seed, read=read, at_host=at_host
            )
        if taps is not None:
            if not self.deferred:
                self.deferred_from, self.deferred_bound = length, bound
            self.deferred.append(taps)
        flight = Flight(
            size, result, new_last, new_length, new_shape=new_shape, lookup=looked, rows=self.plan(size).rows
        )
        if scores is not None:
            flight.logprobs, flight.top_ids = scores
        extra = [a for a in (flight.logprobs, flight.top_ids, flight.lookup) if a is not None]
        if self.history is not None:
            extra.append(self.history.tokens)
        mx.async_eval(flight.result, flight.last, flight.length, *extra, *self.caches.arrays())
        return flight

    def feed_deferred(self, committed: int) -> None:
        """Feed the deferred states of positions below ``committed``: a step
        queued past the end of a decode is not committed."""
        if self.deferred:
            first = self.deferred_from.item()
            self._feed(max(0, min(len(self.deferred), committed - first)))

    def _feed(self, n: int) -> None:
        """Feed the first ``n`` deferred states; drop the rest."""
        if n:
            # The deferral's bound: the caller's, n positions on, would grow
            # the drafter's buffers past the target's.
            set_lengths(self.caches.draft, self.deferred_from, self.deferred_bound)
            taps = mx.concatenate(self.deferred[:n], axis=1)
            self.draft.extend(taps, self.caches.draft, self.draft_fused)
        self.deferred, self.deferred_from = [], None

    def _build(
        self, size: int, last: mx.array, length: mx.array, bound: int, seed, *, read: str, at_host: bool = False
    ):
        """The cycle's graph: (result, next last token, new length, a deferred
        plain step's tapped states or None, ``token_logprobs`` of every verify
        row or None). ``seed``: the sampler's two words
        (None when greedy); ``read``: how the forwards span the buffers
        (kv/buffer.py); ``at_host``: ``bound`` is the length, written as a
        host int (slice writes, as mlx-lm's step)."""
        target_cache, draft_cache = self.caches.target, self.caches.draft
        if not (at_host and self.defers):
            length = device_scalar(length)
        self.target.set_length(target_cache, bound if at_host else length, bound, read)
        defer = size == 1 and self.defers
        if not defer:
            set_lengths(draft_cache, length, bound, "fixed" if read == "fixed" else "bound")
        plan = self.plan(size)
        block_size = plan.block
        drafts, q, key, k_draft = None, None, None, None
        looked_up, matched, hit = None, None, None
        tree = None
        if plan.tree:
            guesses = self.draft(self._masked(last, block_size), None, draft_cache, self.draft_fused).squeeze(0)
            if self.lookup is not None:
                looked_up, matched, hit = self._look_up(length, block_size - 1, guesses)
            verify, tree = build_tree(guesses, plan.rows, self.tree.top_k, looked_up, hit, root=last)
        elif block_size > 1:
            if self.lookup_only:
                drafts, n = find(self.history.tokens, length, block_size - 1, self.lookup)
                matched = hit = n > 0
            else:
                block = self._masked(last, block_size)
                if self.selects:
                    if self.temperature > 0:
                        key, k_draft = mx.random.split(position_key(seed, length))
                    drafts, q = self.draft.propose(
                        block, None, draft_cache, self.temperature, k_draft, self.draft_fused
                    )
                else:
                    guesses = self.draft(block, None, draft_cache, self.draft_fused).squeeze(0)
                    drafts = mx.argmax(guesses, axis=-1).astype(mx.int32)
                if self.lookup is not None:
                    looked_up, matched, hit = self._look_up(length, block_size - 1, None if self.selects else guesses)
                    drafted = drafts
                    drafts = mx.where(hit, looked_up, drafts)
                    if q is not None:  # a looked-up draft is a one-hot proposal
                        one_hot = constant_arange(q.shape[-1])[None] == looked_up[:, None]
                        q = mx.where(hit, one_hot.astype(q.dtype), q)
            verify = mx.concatenate([last, drafts])
        else:
            verify = last
        if tree is None:
            logits, hidden = self.target(verify[None], target_cache, self.taps)
        else:
            self.target.set_tree(target_cache, tree)
            try:
                logits, hidden = self.target(verify[None], target_cache, self.taps)
            finally:
                self.target.set_tree(target_cache, None)
        if tree is not None:
            targets = pick(logits.squeeze(0), length + 1 + tree.depths, self.sampling, seed)
            accepted, path = accepted_path(verify, tree, targets, block_size - 1)
            tokens = targets[path]
            logits, hidden = logits[:, path], hidden[:, path]
            self.target.keep_path(target_cache, length, path)
        elif q is not None:
            kept = accept_proposals(drafts, q, logits.squeeze(0), self.sampling, key)
            accepted, tokens = kept[0], kept[1:]
        else:
            # squeeze, not [0]: an int index is a gather, a copy of the logits
            tokens = pick(logits.squeeze(0), length + 1 + constant_arange(block_size), self.sampling, seed)
            accepted = accepted_count(drafts, tokens) if drafts is not None else mx.array(0, mx.int32)
        new_length = length + accepted + 1
        self.target.set_length(target_cache, new_length, bound + size)
        if not defer:
            self.draft.extend(hidden, draft_cache, self.draft_fused)
            set_lengths(draft_cache, new_length, bound + size)
        result = mx.concatenate([accepted[None].astype(mx.int32), tokens])
        scores = None
        if self.logprobs is not None:  # of the logits the tokens were picked from
            scores = token_logprobs(logits.squeeze(0), tokens, self.logprobs)
        looked = None
        if self.history is not None:
            self.history.write(tokens, length + 1)
            looked = mx.array([0, 0, -1], mx.int32)  # a plain step drafts nothing
            if hit is not None:
                other = mx.array(-1, mx.int32)
                if looked_up is not None and q is None and tree is None:
                    # the other chain's drafts agree up to where the verified one broke off: a lower bound
                    other = mx.minimum(agreeing(mx.where(hit, drafted, looked_up), tokens), accepted + 1)
                looked = mx.stack([matched.astype(mx.int32), hit.astype(mx.int32), other.astype(mx.int32)])
        return result, tokens[accepted][None], new_length, hidden if defer else None, scores, looked

    def _masked(self, last: mx.array, block_size: int) -> mx.array:
        """The drafter's block [1, block_size]: the last committed token, then masks."""
        return mx.where(constant_arange(block_size) == 0, last, self.mask_id)[None]

    def _look_up(self, length: mx.array, n: int, logits: mx.array | None = None):
        """(the looked-up continuation [n], whether it is worth drafting,
        whether the cycle drafts from it): beside a drafter, whose block's
        logits [n, V] (where given) choose among shorter matches."""
        if logits is not None:
            looked_up, matched = find_believed(self.history.tokens, length, logits, self.lookup)
        else:
            looked_up, matched = find(self.history.tokens, length, n, self.lookup)
            matched = matched >= self.lookup.min_ngram
        return looked_up, matched, matched & self.lookup_enabled

    def _run_compiled(self, size: int, last: mx.array, length: mx.array, bound: int):
        """``_build``'s outputs through mx.compile, traced per key and input
        shapes, and whether this call traced. The trace reads this call's
        cycle, caches and bound from ``traces.now``, so a retrace in a later
        call builds that call's graph; the seed is an input. Each part
        (a layer's cache, or a record the target keeps beside them) hands its
        ``traced_inputs`` in and its ``traced_outputs`` back, and takes them
        after the call: a replay runs no Python of the cycle."""
        layers = self.caches.target + self.caches.draft
        parts = [self.caches.target] * hasattr(self.caches.target, "traced_outputs") + layers
        plan = self.plan(size)
        for c in layers:
            c.reserve(bound + max(plan.rows, plan.block))  # grow outside: shapes are fixed inside
        traces = self.traces
        now = traces.now
        defer = size == 1 and self.defers
        key = (
            size,
            self.sampling,
            self.seed is not None,
            self.target.fuse_projections,
            self.draft.fuse_projections,
            defer,
        )
        top = self.logprobs
        if top is not None:
            key += ("logprobs", top)
        history = self.history
        if history is not None:
            key += ("lookup", self.lookup, self.lookup_only)
        if plan.tree:
            key += ("tree", plan.rows, self.tree)

        def make():
            def step(last, length, seed, enabled, tokens, *inputs):
                cycle, parts = now["cycle"], now["parts"]
                given = iter(inputs)
                for c in parts:
                    c.set_traced(given)
                if history is not None:
                    cycle.lookup_enabled, cycle.history.tokens = enabled, tokens
                traced_seed = seed if cycle.seed is not None else None
                out = cycle._build(size, last, length, now["bound"], traced_seed, read="fixed")
                result, new_last, new_length, taps, scores, looked = out
                return (
                    result,
                    new_last,
                    new_length,
                    *([taps] if defer else []),
                    *([a for a in scores if a is not None] if top is not None else []),
                    *([looked, cycle.history.tokens] if history is not None else []),
                    *[a for c in parts for a in c.traced_outputs()],
                )

            return mx.compile(step)

        seed = self.seed if self.seed is not None else mx.zeros((2,), mx.uint32)
        enabled = self.lookup_enabled
        tokens = history.tokens if history is not None else enabled
        held = [c.enter_trace(length, bound) for c in parts]
        inputs = [a for c in parts for a in c.traced_inputs()]
        # mx.compile keys on its inputs' shapes, in order: a new one traces anew
        width = (*(a.shape for a in inputs), tokens.shape)
        with traces.lock:
            fn, traced = traces.compiled_step(key, width, make)
            try:
                now.update(cycle=self, parts=parts, bound=bound)
                result, new_last, new_length, *outputs = fn(last, length, seed, enabled, tokens, *inputs)
            finally:
                now.clear()
                for c, h in zip(parts, held):  # a trace left tracers here
                    c.leave_trace(h)
                self.lookup_enabled = enabled  # a trace left tracers here
                if history is not None:
                    history.tokens = tokens
        taps = outputs.pop(0) if defer else None
        scores = None
        if top is not None:
            scores = (outputs.pop(0), outputs.pop(0) if top > 0 else None)
        looked = None
        if history is not None:
            looked, history.tokens = outputs.pop(0), outputs.pop(0)
        at = 0
        for c in parts:
            c.take_outputs(outputs[at : at + c.traced_returns], length)
            at += c.traced_returns
        self.target.set_length(self.caches.target, new_length, bound + size)
        if not defer:
            set_lengths(self.caches.draft, new_length, bound + size)
        return result, new_last, new_length, taps, scores, looked, traced
