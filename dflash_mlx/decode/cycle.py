"""One DFlash cycle as a function of device state: draft, verify, accept, keep.

The state between cycles is two small arrays, ``last`` (the last committed
token, not yet in the caches) and ``length`` (how many positions both caches
hold), plus the caches themselves. A cycle reads and returns them without the
host looking at any of it, so the next cycle can be built and queued while
this one runs, as mlx-lm's plain ``generate_step`` does for single tokens:

1. the drafter fills the block [last, MASK, ...] at positions length.. from
   its context cache (a DFlash 2 drafter through its candidate selector);
2. the target verifies [last, drafts] in one forward, writing their keys and
   values at positions length..length+bs-1 of its cache;
3. the target's token at every position is picked (argmax, or the seeded
   Gumbel-max sample) and the drafts that match count as accepted (a); drafts
   sampled from a distribution q (DFlash 2's selector) are accepted by the
   general rule instead, min(1, p/q);
4. the drafter's context takes the verified positions' tapped states, and
   both caches keep length + a + 1 positions: rollback is that move, made on
   the device.

A block of 1 is a plain target step through the same machinery (no drafts).
The drafter's context still takes every position, so drafting can resume at
any time, but the plain steps' tapped states wait and go in with one
``extend`` when drafting resumes or the decode ends (``feed_deferred``): one
feed per step cost a third of a plain step on the CPU, and kernels to launch
on a GPU (BENCHMARKS.md).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass

import mlx.core as mx

from .. import compute_dtype
from ..cache.buffer import BufferKVCache, set_lengths
from ..device import constant_arange, device_scalar
from ..draft.dflash import DFlashDraft
from ..targets import DenseTarget
from .sampling import SamplingParams, accept_proposals, accepted_count, pick, position_key, seed_words
from .traces import traces_for


@dataclass
class Flight:
    """A queued cycle: its block size and the arrays it will produce."""

    block_size: int
    result: mx.array  # [1 + bs]: accepted drafts a, then the target's tokens (first a + 1 are committed)
    last: mx.array  # [1] the next cycle's last token
    length: mx.array  # () the target cache's length after this cycle (the drafter's too, unless deferred)
    launch_seconds: float = 0.0  # the host's time building and queuing it
    new_shape: bool = False  # the first cycle of its block size and buffer width: it paid one-off builds


class Cycle:
    # Trace each block size once with mx.compile (see _run_compiled). None:
    # where launching operations is what a cycle's time goes to, on a GPU
    # and on a CPU computing in float32 on a fast BLAS (fused elementwise
    # chains cut a CPU cycle by ~20%, BENCHMARKS.md); not where a CPU's
    # products take the reference BLAS or MLX's own loops (bfloat16), which
    # dominate, so compiling (MLX has g++ build the CPU's fused kernels, ~8 s
    # on first use) would not pay; nor where there is no g++ to build them.
    compile_graphs: bool | None = None
    # Plain steps leave the drafter's context feed for later (see the module
    # docstring), where its caches are plain buffers.
    defer_feed: bool = True

    def __init__(self, target: DenseTarget, draft: DFlashDraft, caches, sampling: SamplingParams, seed: int):
        self.target, self.draft, self.caches = target, draft, caches
        compiled = self.compile_graphs
        if compiled is None:
            compiled = mx.default_device().type == mx.DeviceType.gpu or (
                compute_dtype.on_fast_blas(target.dtype) and shutil.which("g++") is not None
            )
        # Only caches that are plain buffers can be handed to a compiled graph.
        buffers = all(isinstance(c, BufferKVCache) for c in caches.target + caches.draft)
        self.compiled = compiled and buffers
        self.sampling = sampling
        self.temperature = sampling.temperature
        self.seed = seed_words(seed) if self.temperature > 0 else None
        self.taps = list(draft.config.target_layer_ids)
        self.mask_id = draft.config.mask_token_id
        # A DFlash 2 drafter proposes through its candidate selector (greedy,
        # or sampled with its distribution q at temperature > 0).
        self.selects = draft.selects_candidates
        # The drafter's fused projections, checked for staleness once per call, not twice a cycle.
        self.draft_fused = draft.fused_projections()
        self.traces = traces_for(target, draft)
        self.defers = self.defer_feed and buffers and all(type(c) is BufferKVCache for c in caches.draft)
        # Plain steps whose tapped states [1, 1, n*H] are not in the drafter's
        # context yet, and the position of the first (the drafter's length).
        self.deferred: list[mx.array] = []
        self.deferred_from: mx.array | None = None
        self.deferred_bound = 0  # a host-side upper bound on deferred_from

    def pick(self, logits: mx.array, positions: mx.array) -> mx.array:
        return pick(logits, positions, self.sampling, self.seed)

    def first_token(self, last_logits: mx.array, position: int) -> mx.array:
        """The token after the prompt, from the prefill's last logits [V]."""
        return self.pick(last_logits[None], mx.array([position], mx.int32))

    def would_build(self, block_size: int) -> bool:
        """Whether a cycle of ``block_size`` launched now would build new
        graphs: its size meeting the buffers' next width for the first time."""
        return self._shape(block_size) not in self.traces.shapes

    def _shape(self, block_size: int) -> tuple[int, int]:
        """(block size, the drafter's buffer width once a cycle of it
        writes): what a cycle's graphs are built for. A drafting cycle
        after plain steps puts their deferred states in first."""
        first = self.caches.draft[0]
        if block_size > 1 and self.deferred:
            return block_size, first.room(self.deferred_bound + len(self.deferred) + block_size)
        return block_size, first.width_after(block_size)

    def launch(self, block_size: int, last: mx.array, length: mx.array, bound: int, exact: bool = False) -> Flight:
        """Build a cycle's graph and queue it; nothing here waits for the
        device. ``bound``: a host-side upper bound on ``length``; ``exact``:
        it is the length itself (as after a plain step, which commits one
        position). A plain step at an exact length reads exactly the filled
        keys with no mask (kv_cache.py), built uncompiled: its widths change
        every step."""
        # A block size meeting a buffer width for the first time builds new
        # graphs (a trace, where compiled; the backend's kernels): not its cost.
        shape = self._shape(block_size)
        new_shape = shape not in self.traces.shapes
        self.traces.shapes.add(shape)
        if block_size > 1 and self.deferred:
            self._feed(len(self.deferred))
        exact_step = block_size == 1 and exact
        if self.compiled and isinstance(self.caches.target[0], BufferKVCache) and not exact_step:
            # (a quantized cache runs uncompiled)
            result, new_last, new_length, taps = self._run_compiled(block_size, last, length, bound)
        else:
            plain = [c for c in self.caches.target if type(c) is BufferKVCache] if exact_step else []
            for c in plain:
                c.exact_bound = True
            try:
                # (written at the host's int where every target layer is a plain buffer)
                at_host = exact_step and len(plain) == len(self.caches.target)
                result, new_last, new_length, taps = self._build(block_size, last, length, bound, at_host)
            finally:
                for c in plain:
                    c.exact_bound = False
        if taps is not None:  # a plain step whose feed waits
            if not self.deferred:
                self.deferred_from, self.deferred_bound = length, bound
            self.deferred.append(taps)
        flight = Flight(block_size, result, new_last, new_length, new_shape=new_shape)
        mx.async_eval(flight.result, flight.last, flight.length, *self.caches.arrays())
        return flight

    def feed_deferred(self, committed: int) -> None:
        """Put the deferred plain steps' states of positions below
        ``committed`` into the drafter's context (at the end of a decode:
        a step queued past the end is not committed)."""
        if self.deferred:
            first = self.deferred_from.item()
            self._feed(max(0, min(len(self.deferred), committed - first)))

    def _feed(self, n: int) -> None:
        """The first ``n`` deferred states go into the drafter's context, which
        holds the positions before them; the rest are dropped."""
        if n:
            # (bounded by the bound it was deferred at: the caller's, n
            # positions on, would grow the drafter's buffers past the target's)
            set_lengths(self.caches.draft, self.deferred_from, self.deferred_bound)
            taps = mx.concatenate(self.deferred[:n], axis=1)
            self.draft.extend(taps, self.caches.draft, self.draft_fused)
        self.deferred, self.deferred_from = [], None

    def _build(self, block_size: int, last: mx.array, length: mx.array, bound: int, at_host: bool = False):
        """The cycle's graph: (result, the next last token, the new length,
        and the tapped states of a plain step whose feed waits, else None).
        ``at_host``: ``bound`` is the length itself (launch's exact plain step
        over plain buffers), so the target's caches are written at it as a
        host int, as mlx-lm's own step writes: slice writes at constant
        offsets, no position arrays."""
        target_cache, draft_cache = self.caches.target, self.caches.draft
        if not (at_host and self.defers):  # (an exact plain step's kernels read no length)
            length = device_scalar(length)  # what the cycle's kernels read, in device memory
        self.target.set_length(target_cache, bound if at_host else length, bound)
        defer = block_size == 1 and self.defers
        if not defer:
            set_lengths(draft_cache, length, bound)
        drafts, q, key, k_draft = None, None, None, None
        if block_size > 1:
            # [last, MASK, ...]: one select (a filled array and a concatenation: three launches)
            block = mx.where(constant_arange(block_size) == 0, last, self.mask_id)[None]
            if self.selects:
                if self.temperature > 0:
                    key, k_draft = mx.random.split(position_key(self.seed, length))
                drafts, q = self.draft.propose(block, None, draft_cache, self.temperature, k_draft, self.draft_fused)
            else:
                drafts = mx.argmax(self.draft(block, None, draft_cache, self.draft_fused).squeeze(0), axis=-1).astype(
                    mx.int32
                )
            verify = mx.concatenate([last, drafts])
        else:
            verify = last
        logits, hidden = self.target(verify[None], target_cache, self.taps)
        if q is not None:
            # sampled proposals: the general rule, min(1, p/q)
            kept = accept_proposals(drafts, q, logits.squeeze(0), self.sampling, key)
            accepted, tokens = kept[0], kept[1:]
        else:
            # row i predicts the token at position length + i + 1
            # (squeeze, not [0]: an int index is a gather, a copy of the logits on a GPU)
            tokens = self.pick(logits.squeeze(0), length + 1 + constant_arange(block_size))
            accepted = accepted_count(drafts, tokens) if drafts is not None else mx.array(0, mx.int32)
        new_length = length + accepted + 1
        self.target.set_length(target_cache, new_length, bound + block_size)
        if not defer:
            self.draft.extend(hidden, draft_cache, self.draft_fused)
            set_lengths(draft_cache, new_length, bound + block_size)
        result = mx.concatenate([accepted[None].astype(mx.int32), tokens])
        return result, tokens[accepted][None], new_length, hidden if defer else None

    def _run_compiled(self, block_size: int, last: mx.array, length: mx.array, bound: int):
        """The same graph through mx.compile: traced once per block size,
        sampling setting and buffer shape for the pair (kept across calls,
        see Traces), then replayed without Python, its elementwise chains
        fused. The trace reads the call's cycle, caches and bound from
        ``traces.now``, so a retrace (new buffer shapes) in a later call
        builds that call's graph; the seed is an input, not a constant."""
        layers = self.caches.target + self.caches.draft
        for c in layers:
            c.reserve(bound + block_size)  # grow outside, so shapes are fixed inside
        traces = self.traces
        now = traces.now
        defer = block_size == 1 and self.defers
        key = (
            block_size,
            self.sampling,
            self.seed is not None,
            self.target.fuse_projections,
            self.draft.fuse_projections,
            defer,
        )

        def make():
            def step(last, length, seed, *buffers):
                cycle, layers = now["cycle"], now["layers"]
                for c, k, v in zip(layers, buffers[0::2], buffers[1::2]):
                    c.keys, c.values, c.fixed_width = k, v, True  # (shapes must not follow the bound)
                kept_seed = cycle.seed
                cycle.seed = seed if kept_seed is not None else None
                try:
                    # (``bound`` inside only sizes buffers, reserved above for every call)
                    out = cycle._build(block_size, last, length, now["bound"])
                finally:
                    cycle.seed = kept_seed
                    for c in layers:
                        c.fixed_width = False
                result, new_last, new_length, taps = out
                return (
                    result,
                    new_last,
                    new_length,
                    *([taps] if defer else []),
                    *[a for c in layers for a in (c.keys, c.values)],
                )

            return mx.compile(step)

        seed = self.seed if self.seed is not None else mx.zeros((2,), mx.uint32)
        with traces.lock:  # one thread's trace never reads another's caches
            fn = traces.compiled_step(key, layers[0].capacity, make)
            try:
                now.update(cycle=self, layers=layers, bound=bound)
                result, new_last, new_length, *buffers = fn(
                    last, length, seed, *[a for c in layers for a in (c.keys, c.values)]
                )
            finally:
                now.clear()  # the call's caches are not held past it
        taps = buffers.pop(0) if defer else None
        for c, k, v in zip(layers, buffers[0::2], buffers[1::2]):
            c.keys, c.values = k, v
        self.target.set_length(self.caches.target, new_length, bound + block_size)
        if not defer:
            set_lengths(self.caches.draft, new_length, bound + block_size)
        return result, new_last, new_length, taps
