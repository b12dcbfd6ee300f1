"""Which piece of a verify rounds differently from mlx-lm's one-row decode step.

Reported in BENCHMARKS.md, "Greedy output against mlx-lm's".

    python benchmarks/verify_rounding.py                                  # the built-in pair's target
    DFLASH_MLX_KERNELS=on python benchmarks/verify_rounding.py --shape qwen3-8b --prompt-tokens 1024
    python benchmarks/verify_rounding.py --shape qwen3-8b --quantize 4 --json rounding.json
    python benchmarks/verify_rounding.py --model PATH --rows 16 --committed 3
    DFLASH_MLX_KERNELS=exact python benchmarks/verify_rounding.py --shape qwen3-8b --prompt-tokens 200 --prefill

After a prompt of P synthetic tokens and C committed ones, mlx-lm's own
``generate_step`` decodes R tokens a row at a time (greedy), and our adapter
verifies the same R tokens as one block, as a DFlash cycle does, with the
kernels this machine serves (``DFLASH_MLX_KERNELS`` or ``--kernels``). Each
layer's pieces are captured in both and compared row by row, bit for bit:
a cell is the rows (of R) whose bits differ from the one-row step's, then
the largest absolute difference; ``.`` where the piece cannot be seen.

mlx-lm's side is read by wrapping its modules (restored afterwards). Ours
cannot be wrapped without changing its path (our products dispatch on the
exact module types), so its pieces come from a replay of the layer through
the same functions (layers/blocks.py's ``dense_block``), from the layer's
captured input, cache and mask; the layer's output, the keys and values it
wrote and the logits are the verify's own, and ``replay`` says whether the
replay reproduced each layer's output bit for bit. A piece a kernel folds
into a neighbour's launch (the CUDA block product's norm, SwiGLU, residual)
is replayed without the fold. A second table replays each piece of ours
from mlx-lm's inputs to it: its own rounding, where the first shows what
each piece inherits too, so one run names every piece that rounds otherwise.

The verify runs over mlx-lm's own cache (its prompt and committed tokens), so
its table is the verify's rounding alone; ``history`` compares that cache
with ours after our prefill and a committed block, and ``own history``
verifies over ours, as DFlash runs. ``compiled`` runs the verify through
mx.compile, as the cycle does on a GPU (layer outputs, cache, logits). Then
each of our kernels and fusions that serves here is switched off in turn
(and all at once): the run where the differences go names the culprit.

``--prefill`` compares our prefill instead (decode/loop.py's: chunks of
``--prefill-step`` ids, then the last id alone, PromptCache.chunks' rule)
with generate_step's reading of the same prompt: the last id's one-row
forward over mlx-lm's cache and over our own chunks' (``history``: the
chunks' keys and values), the same row read at a plain step's exact length
(no mask), and a plain step (a block of 1) at P+C, its length on the host,
on the device, and compiled; each table as the verify's, and the first
layer's mask on each side. ``--chunks`` compares the chunks' rows too (they
hold every piece of every row: mind the memory at long prompts).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from dflash_mlx.decode.sampling import greedy as greedy_token

LAYER_PIECES = (
    "input norm",
    "q",
    "k",
    "v",
    "q rope",
    "k rope",
    "attention",
    "o_proj",
    "h+attn",
    "post norm",
    "gate",
    "up",
    "swiglu",
    "down",
    "out",
)
MODEL_PIECES = ("final norm", "logits")
ISOLATED = "each from mlx-lm's input"
BITS = {mx.bfloat16: mx.uint16, mx.float16: mx.uint16, mx.float32: mx.uint32}

Pieces = dict[tuple, mx.array]  # (layer index or "model", piece) -> rows [R, width]


@dataclass
class Difference:
    rows: int  # rows whose bits differ from the one-row step's
    worst: float  # the largest |ours - one-row|

    def cell(self) -> str:
        return "0" if self.rows == 0 else f"{self.rows}/{self.worst:.0e}"


def as_rows(a: mx.array) -> mx.array:
    """[1, L, width] or [1, heads, L, D] -> [L, width]."""
    if a.ndim == 4:
        a = a.transpose(0, 2, 1, 3)
        return a.reshape(a.shape[1], -1)
    return a.reshape(-1, a.shape[-1])


def difference(ours: mx.array, theirs: mx.array) -> Difference:
    if ours.dtype == theirs.dtype and ours.dtype in BITS:
        same = (ours.view(BITS[ours.dtype]) == theirs.view(BITS[ours.dtype])).all(axis=-1)
    else:
        same = (ours.astype(mx.float32) == theirs.astype(mx.float32)).all(axis=-1)
    worst = mx.abs(ours.astype(mx.float32) - theirs.astype(mx.float32)).max()
    return Difference(int((~same).sum().item()), float(worst.item()))


def compare(ours: Pieces, theirs: Pieces, layers: range) -> dict[tuple, Difference]:
    """Each piece both sides have alike, in the order a forward computes them
    (a family caching other than rotated keys, e.g. MLA's latents, has no "k rope" to compare)."""
    order = [(i, p) for i in layers for p in LAYER_PIECES] + [("model", p) for p in MODEL_PIECES]
    alike = [key for key in order if key in ours and key in theirs and ours[key].shape == theirs[key].shape]
    return {key: difference(ours[key], theirs[key]) for key in alike}


def first_difference(diffs: dict[tuple, Difference]) -> tuple | None:
    return next((key for key, d in diffs.items() if d.rows), None)


# ---- mlx-lm's one-row steps -------------------------------------------------


class Probe(nn.Module):
    """Calls ``inner`` and hands its inputs and output to ``seen``."""

    def __init__(self, inner, seen: Callable):
        super().__init__()
        self.inner = inner
        self.seen = seen

    def __call__(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        self.seen(args, out)
        return out

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:  # (a model reading a layer's settings, e.g. llama's use_sliding)
            if "inner" not in self:
                raise
            return getattr(self["inner"], name)


# (module path in a layer, what it shows: its input's or its output's piece)
LAYER_PROBES = (
    ("input_layernorm", "in", "input norm"),  # ("in": the layer's input, not compared)
    ("self_attn.q_proj", None, "q"),
    ("self_attn.k_proj", None, "k"),
    ("self_attn.v_proj", None, "v"),
    ("self_attn.rope", None, ("q rope", "k rope")),  # called for the queries, then the keys
    ("self_attn.o_proj", "attention", "o_proj"),
    ("post_attention_layernorm", "h+attn", "post norm"),
    ("mlp.gate_proj", None, "gate"),
    ("mlp.up_proj", None, "up"),
    ("mlp.down_proj", "swiglu", "down"),
)


@contextlib.contextmanager
def probed(model: nn.Module, layers: list[int], record: Callable[[tuple, mx.array], None], whole: bool = True):
    """mlx-lm's modules of ``layers`` wrapped to ``record`` their pieces
    (``whole``: the layers themselves and the final norm too)."""
    inner = getattr(model, "language_model", model).model
    undo = []

    def wrap(parent, name, key_in, key_out, i):
        calls = [0]

        def seen(args, out):
            if key_in is not None:
                record((i, key_in), args[0])
            key = key_out if isinstance(key_out, str) else key_out[calls[0] % len(key_out)]
            calls[0] += 1
            record((i, key), out)

        original = parent[name]
        parent[name] = Probe(original, seen)
        undo.append(lambda: parent.__setitem__(name, original))

    for i in layers:
        layer = inner.layers[i]
        for path, key_in, key_out in LAYER_PROBES:
            *parents, name = path.split(".")
            parent = layer
            for p in parents:
                parent = parent.get(p) if isinstance(parent, dict) else None
            if isinstance(parent, dict) and callable(parent.get(name)):
                wrap(parent, name, key_in, key_out, i)
        if whole:
            wrap(inner.layers, i, None, "out", i)
    if whole:
        wrap(inner, "norm", None, "final norm", "model")
    try:
        yield
    finally:
        for u in reversed(undo):
            u()


class OneRowSteps:
    """mlx-lm's model as ``generate_step`` calls it, keeping each one-row call's
    pieces (``chunks``: each prompt chunk's too, less its logits) and the
    mask its model makes, by the position the call starts at."""

    def __init__(self, model: nn.Module, chunks: bool = False):
        self.model = model
        self.chunks = chunks
        self.steps: dict[int, Pieces] = {}  # position -> pieces
        self.masks: dict[int, str] = {}  # position -> the first layer's mask (``mask_kind``)
        self.current: Pieces | None = None

    def record(self, key: tuple, value: mx.array) -> None:
        if self.current is not None:
            self.current[key] = value

    def __call__(self, inputs: mx.array, cache=None, **kwargs):
        from mlx_lm.models.base import create_attention_mask

        one_row = inputs.shape[1] == 1
        self.current = {} if one_row or self.chunks else None
        if self.current is not None:
            at = cache[0].offset
            self.steps[at] = self.current
            # (what qwen3/llama's model makes from its first cache before the call)
            self.masks[at] = mask_kind(create_attention_mask(mx.zeros((1, inputs.shape[1], 1)), cache[0]))
        out = self.model(inputs, cache=cache, **kwargs)
        if one_row:  # (a chunk's logits, every row's, are not ours to compare: ours are its last row's)
            self.record(("model", "logits"), out)
        self.current = None
        return out


def mask_kind(mask) -> str:
    """How an attention mask reads: none, causal, or an array (all visible or not)."""
    if mask is None or isinstance(mask, str):
        return mask or "none"
    seen = "all visible" if mask.dtype == mx.bool_ and mask.all().item() else "some hidden"
    return f"array {'x'.join(map(str, mask.shape))} ({seen})"


@dataclass
class Steps:
    tokens: list[int]  # mlx-lm's greedy tokens after the prompt
    calls: dict[int, Pieces]  # the recorded calls' pieces, by the position each starts at
    masks: dict[int, str]  # their first layer's masks
    cache: list  # mlx-lm's caches after the run


def mlx_lm_steps(model: nn.Module, prompt: list[int], max_tokens: int, *, step: int = 2048, chunks: bool = False):
    """mlx-lm's greedy ``generate_step`` of ``max_tokens`` after ``prompt``,
    read in chunks of ``step`` ids and then its last id alone; its one-row
    calls captured (``chunks``: its chunks too)."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    steps = OneRowSteps(model, chunks)
    layers = list(range(len(getattr(model, "language_model", model).model.layers)))
    with probed(model, layers, steps.record):
        run = generate_step(
            mx.array(prompt), steps, prompt_cache=cache, max_tokens=max_tokens, sampler=greedy, prefill_step_size=step
        )
        tokens = [int(t) for t, _ in run]
    return Steps(tokens, steps.steps, steps.masks, cache)


def stacked(calls: list[Pieces]) -> Pieces:
    """The pieces every one of ``calls`` has, their rows stacked in order."""
    return {key: mx.concatenate([as_rows(c[key]) for c in calls]) for key in calls[0] if all(key in c for c in calls)}


def before(cache: list, n: int) -> list[tuple[mx.array, mx.array]]:
    """Each layer's cached keys and values at the positions below ``n``."""
    return [(c.keys[..., :n, :], c.values[..., :n, :]) for c in cache]


@dataclass
class Reference:
    tokens: list[int]  # mlx-lm's greedy tokens after the prompt
    pieces: Pieces  # the R compared steps' pieces, rows stacked
    history: list[tuple[mx.array, mx.array]]  # each layer's keys and values before them


def one_row_reference(model: nn.Module, prompt: list[int], committed: int, rows: int) -> Reference:
    """mlx-lm's greedy ``generate_step``: the steps at positions P+C .. P+C+R-1, captured."""
    steps = mlx_lm_steps(model, prompt, committed + rows + 1)
    start = len(prompt) + committed
    pieces = stacked([steps.calls[p] for p in range(start, start + rows)])
    history = before(steps.cache, start)
    mx.eval(pieces, history)
    return Reference(steps.tokens, pieces, history)


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


# ---- our verify ---------------------------------------------------------------


def copied(cache):
    """A cache like ``cache`` (before a write), holding its own buffers."""
    from dflash_mlx.kv.buffer import BufferKVCache

    kept = BufferKVCache()
    for name in ("offset", "bound", "read", "shared", "floor", "tree"):
        setattr(kept, name, getattr(cache, name))
    if cache.keys is not None:
        kept.keys, kept.values = mx.array(cache.keys), mx.array(cache.values)
    return kept


def seeded_cache(target, history: list[tuple[mx.array, mx.array]]) -> list:
    """Our buffers holding mlx-lm's keys and values."""
    cache = target.make_cache()
    for c, (k, v) in zip(cache, history):
        c.update_and_fetch(k, v)
    return cache


@dataclass
class LayerCall:
    h: mx.array
    mask: object
    cache: object  # a copy of the layer's cache before the verify wrote
    out: mx.array


def replay_dense(target, i: int, call: LayerCall, given: Callable[[str, mx.array], mx.array] | None = None) -> Pieces:
    """A qwen3/llama layer's verify, step by step as layers/blocks.py's
    ``dense_block`` (fused projections, or the layer's own) takes it.
    ``given(piece, ours)``: what the next step takes in place of our piece
    (mlx-lm's, to see each piece's own rounding); by default ours."""
    from mlx_lm.models.activations import swiglu

    from dflash_mlx.kernels.norm_rope import norm_rope, rotate
    from dflash_mlx.layers.blocks import attend_output, own_projections, rope_positions
    from dflash_mlx.layers.fused import fused_rows, projections
    from dflash_mlx.layers.linear import apply_linear, apply_linear_output, apply_linear_swiglu

    given = given or (lambda piece, ours: ours)
    layer = target.inner.layers[i]
    window = target.windows()[i]
    fused = projections(layer) if target.fuse_projections else None
    attn, mlp = layer.self_attn, layer.mlp
    norm, post = layer.input_layernorm, layer.post_attention_layernorm
    h, mask, cache = given("in", call.h), call.mask, copied(call.cache)
    B, L, _ = h.shape
    got = {"input norm": norm(h)}
    q, k, v = fused.qkv(h, norm) if fused is not None else own_projections(attn)(h, norm)
    got.update({"q": q, "k": k, "v": v})
    q, k, v = given("q", q), given("k", k), given("v", v)
    q = q.reshape(B, L, attn.n_heads, -1)
    k = k.reshape(B, L, attn.n_kv_heads, -1)
    v = v.reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    q_norm = getattr(attn, "q_norm", None)
    if q_norm is not None:
        q, k = norm_rope(q, k, q_norm, attn.k_norm, attn.rope, rope_positions(cache))
    else:  # (as attend_output rotates them)
        at = rope_positions(cache)
        q, k = rotate(attn.rope, q.transpose(0, 2, 1, 3), at), rotate(attn.rope, k.transpose(0, 2, 1, 3), at)
    got["q rope"], got["k rope"] = q, k
    q, k = given("q rope", q), given("k rope", k)
    out, as_rows_ = attend_output(None, q, k, v, cache=cache, scale=attn.scale, mask=mask, window=window)
    got["attention"] = out if as_rows_ else out.transpose(0, 2, 1, 3).reshape(B, L, -1)
    out = given("attention", out)
    got["o_proj"] = apply_linear_output(attn.o_proj, out, as_rows_)
    h = got["h+attn"] = apply_linear_output(attn.o_proj, out, as_rows_, residual=h)
    h = given("h+attn", h)
    got["post norm"] = post(h)
    if fused is not None and fused_rows(h):
        got["gate"], got["up"] = mx.split(apply_linear(fused.gate_up, h, norm=post), 2, axis=-1)
        got["swiglu"] = apply_linear_swiglu(fused.gate_up, h, post)
        down = lambda x, residual=None: apply_linear(mlp.down_proj, x, residual)  # noqa: E731
    else:
        x = post(h)
        got["gate"], got["up"] = mlp.gate_proj(x), mlp.up_proj(x)
        got["swiglu"] = swiglu(got["gate"], got["up"])
        down = lambda x, residual=None: mlp.down_proj(x) if residual is None else residual + mlp.down_proj(x)  # noqa: E731
    sw = given("swiglu", got["swiglu"])
    got["down"] = down(sw)
    got["out"] = down(sw, h)
    return {(i, name): value for name, value in got.items()}


def like(rows: mx.array, ours: mx.array) -> mx.array:
    """Rows [L, width] laid out as ``ours`` ([1, L, width] or [1, heads, L, D])."""
    if ours.ndim == 4:  # (contiguous, as the rotated rows and attention outputs are)
        B, H, L, D = ours.shape
        return mx.contiguous(rows.reshape(B, L, H, D).transpose(0, 2, 1, 3))
    return rows.reshape(ours.shape)


def isolated(target, calls: dict, reference: Pieces) -> Pieces:
    """Each piece of ours computed from mlx-lm's inputs to it: its own rounding,
    not what it inherits (qwen3/llama layers, and the head)."""
    pieces = {}
    for i, call in calls.items():

        def given(piece, ours, i=i):
            return like(reference[(i, piece)], ours) if (i, piece) in reference else ours

        pieces.update({key: as_rows(value) for key, value in replay_dense(target, i, call, given).items()})
    last = like(reference[(target.here[-1], "out")], calls[target.here[-1]].out)
    pieces[("model", "final norm")] = as_rows(target.inner.norm(last))
    pieces[("model", "logits")] = as_rows(target.logits(last, target.inner.norm))
    return pieces


@dataclass
class Verified:
    pieces: Pieces
    replay_exact: list[int]  # layers whose replayed output equals the verify's
    replayed: list[int]  # layers replayed at all
    isolated: Pieces | None = None  # each piece from mlx-lm's inputs (``isolated``)
    mask: str = ""  # the first layer's mask (``mask_kind``), where seen


def our_verify(
    target, cache: list, tokens: list[int], start: int, read: str, *, plant=None, reference: Pieces | None = None
) -> Verified:
    """Our adapter's verify of ``tokens`` at ``start`` over ``cache``, eager,
    its pieces captured (and, given mlx-lm's ``reference``, ``isolated``'s)."""
    from dflash_mlx.device import device_scalar

    def at(cache):  # (a cycle's length: on the device)
        target.set_length(cache, device_scalar(mx.array(start, mx.int32)), start, read)

    return our_forward(target, cache, tokens, start, length=at, plant=plant, reference=reference)


def our_forward(
    target,
    cache: list,
    tokens: list[int],
    start: int,
    *,
    length: Callable[[list], None] | None = None,
    last_only: bool = False,
    plant=None,
    reference: Pieces | None = None,
) -> Verified:
    """Our adapter's forward of ``tokens`` written at ``start`` over ``cache``,
    eager, its pieces captured (and, given mlx-lm's ``reference``,
    ``isolated``'s). ``length(cache)`` sets the cache's length first, as the
    caller's path does (None: as the cache stands, as a prefill reads it)."""
    from mlx_lm.generate import generation_stream

    from dflash_mlx.layers.fused import FUSABLE_BLOCKS

    layers = target.inner.layers
    calls: dict[int, LayerCall] = {}
    seen: Pieces = {}

    def watched(i, block):
        def forward(h, mask, c):
            before = copied(c)
            out = block(h, mask, c)
            calls[i] = LayerCall(h, mask, before, out)
            return out

        return forward

    plain = [i for i, b in zip(target.here, target.blocks) if b is layers[i]]  # mlx-lm's own layers
    saved = target.blocks
    target.blocks = [watched(i, b) for i, b in zip(target.here, saved)]
    try:
        with (
            planted(plant, target),
            mx.stream(generation_stream),
            probed(target.model, plain, lambda key, value: seen.__setitem__(key, value), whole=False),
        ):
            if length is not None:
                length(cache)
            logits, _ = target(mx.array(tokens)[None], cache, [target.here[0]], last_only=last_only)
            pieces: Pieces = {key: as_rows(value) for key, value in seen.items() if key[0] != "model"}
            replayed, exact = [], []
            for n, i in enumerate(target.here):
                call = calls[i]
                if i not in plain and type(layers[i]) in FUSABLE_BLOCKS:
                    got = replay_dense(target, i, call)
                    replayed.append(i)
                    if mx.array_equal(got[(i, "out")], call.out).item():
                        exact.append(i)
                    pieces.update({key: as_rows(value) for key, value in got.items()})
                pieces[(i, "out")] = as_rows(call.out)
                pieces.update(written(cache[n], i, start, len(tokens)))
            last = calls[target.here[-1]].out
            pieces[("model", "final norm")] = as_rows(target.inner.norm(last))
            pieces[("model", "logits")] = as_rows(logits)
            mx.eval(pieces)
            alone = None
            if reference is not None and replayed == list(target.here):
                alone = isolated(target, calls, reference)
                mx.eval(alone)
            mask = mask_kind(calls[target.here[0]].mask)
    finally:
        target.blocks = saved
    return Verified(pieces, exact, replayed, alone, mask)


def written(cache, i: int, start: int, n: int) -> Pieces:
    """The keys (normed and rotated) and values a verify wrote at ``start``."""
    k, v = cache.keys[..., start : start + n, :], cache.values[..., start : start + n, :]
    return {(i, "k rope"): as_rows(k), (i, "v"): as_rows(v)}


@contextlib.contextmanager
def planted(plant, target):
    """``plant(target)``, a context manager changing the verify alone (a test's), or nothing."""
    with plant(target) if plant is not None else contextlib.nullcontext():
        yield


def compiled_verify(target, cache: list, tokens: list[int], start: int, *, plant=None) -> Verified:
    """The verify through mx.compile at the buffers' fixed width, as a cycle
    runs on a GPU: every layer's output (as tapped states), the keys and
    values written, the logits."""
    from mlx_lm.generate import generation_stream

    from dflash_mlx.device import device_scalar

    n, taps = len(tokens), list(target.here)
    for c in cache:
        c.reserve(start + n)  # (grown outside: shapes are fixed inside)

    def step(ids, length, *buffers):
        for c, k, v in zip(cache, buffers[0::2], buffers[1::2]):
            c.keys, c.values = k, v
        target.set_length(cache, device_scalar(length), start, "fixed")
        logits, hidden = target(ids[None], cache, taps)
        return (logits, hidden, *[a for c in cache for a in (c.keys, c.values)])

    with planted(plant, target), mx.stream(generation_stream):
        buffers = [a for c in cache for a in (c.keys, c.values)]
        logits, hidden, *buffers = mx.compile(step)(mx.array(tokens), mx.array(start, mx.int32), *buffers)
        H = target.hidden_size
        pieces = {("model", "logits"): as_rows(logits)}
        for j, i in enumerate(taps):
            pieces[(i, "out")] = as_rows(hidden[..., j * H : (j + 1) * H])
            k, v = buffers[2 * j][..., start : start + n, :], buffers[2 * j + 1][..., start : start + n, :]
            pieces[(i, "k rope")], pieces[(i, "v")] = as_rows(k), as_rows(v)
        pieces[("model", "final norm")] = as_rows(target.inner.norm(hidden[..., -H:]))
        mx.eval(pieces)
    return Verified(pieces, [], [])


def prompt_reads(prompt: list[int], step: int) -> list[list[int]]:
    """The forwards decode/loop.py's ``prefill`` reads ``prompt`` in from an
    empty cache: PromptCache.chunks' own rule (chunks of ``step``, the last id alone)."""
    from types import SimpleNamespace

    from dflash_mlx.cache.prompt import PromptCache

    empty = SimpleNamespace(tokens=[], target=[], reply_next=False, reply_from=None)  # (a fresh cache: nothing read)
    return PromptCache.chunks(empty, prompt, step)


def read_plainly(target, cache: list, ids: list[int]) -> None:
    """One of the prefill's forwards, as decode/loop.py's ``prefill`` runs it."""
    from mlx_lm.generate import generation_stream

    from dflash_mlx.layers.linear import prompt_products

    with mx.stream(generation_stream), prompt_products():
        logits, hidden = target(mx.array(ids)[None], cache, [target.here[0]], last_only=True)
        mx.eval(logits, hidden, [a for c in cache for a in c.state if a is not None])


def own_history(target, prompt: list[int], block: list[int], committed: int, read: str, step: int = 2048) -> list:
    """Our cache as DFlash leaves it: the prompt prefilled as decode/loop.py's
    ``prefill`` reads it, then a verify of ``block`` of which ``committed`` rows are kept."""
    from mlx_lm.generate import generation_stream

    from dflash_mlx.device import device_scalar

    cache, taps = target.make_cache(), [target.here[0]]
    for ids in prompt_reads(prompt, step):
        read_plainly(target, cache, ids)
    with mx.stream(generation_stream):
        if committed:
            start = len(prompt)
            target.set_length(cache, device_scalar(mx.array(start, mx.int32)), start, read)
            mx.eval(target(mx.array(block)[None], cache, taps))
            target.set_length(cache, start + committed)
    return cache


@dataclass
class OwnPrefill:
    cache: list  # ours after the prompt
    last: Verified  # the prompt's last id's forward, alone
    chunks: Verified | None  # the chunks' rows, stacked (with ``chunks``)
    starts: list[int]  # where each chunk starts


def own_prefill(target, prompt: list[int], step: int, *, chunks: bool = False, plant=None) -> OwnPrefill:
    """Our prefill of ``prompt`` as decode/loop.py's reads it, the last id's
    forward captured (``chunks``: each chunk's too)."""
    from dflash_mlx.layers.linear import prompt_products

    cache = target.make_cache()
    *body, lone = prompt_reads(prompt, step)
    at, seen, starts = 0, [], []
    for ids in body:
        starts.append(at)
        if chunks:
            with prompt_products():
                seen.append(our_forward(target, cache, ids, at, last_only=True, plant=plant))
        else:
            with planted(plant, target):
                read_plainly(target, cache, ids)
        at += len(ids)
    with prompt_products():
        last = our_forward(target, cache, lone, at, last_only=True, plant=plant)
    rows = None
    if seen:
        replayed = [i for i in seen[0].replayed if all(i in v.replayed for v in seen)]
        exact = [i for i in replayed if all(i in v.replay_exact for v in seen)]
        rows = Verified(stacked([v.pieces for v in seen]), exact, replayed, mask=seen[0].mask)
    return OwnPrefill(cache, last, rows, starts)


def history_difference(target, ours: list, theirs: list[tuple[mx.array, mx.array]]) -> dict[tuple, Difference]:
    """Per layer, the positions whose cached keys or values differ from mlx-lm's."""
    diffs = {}
    for c, i, (k, v) in zip(ours, target.here, theirs):
        n = k.shape[2]
        diffs[(i, "k")] = difference(as_rows(c.keys[..., :n, :]), as_rows(k))
        diffs[(i, "v")] = difference(as_rows(c.values[..., :n, :]), as_rows(v))
    return diffs


# ---- what serves, and switching it off -----------------------------------------


def block_products():
    """The CUDA block-product kernel's module where it can run, else None."""
    from dflash_mlx.device import backend

    if backend() != "cuda":
        return None
    from dflash_mlx.kernels.cuda import products

    return products


def product_path(module: nn.Module, rows: int, dtype) -> str:
    """Which product a verify's ``rows`` take through ``module``."""
    from dflash_mlx.kernels import exact_products, quantized

    if rows < 2:  # (a lone row: apply_linear runs MLX's own product)
        return "MLX quantized" if type(module) is nn.QuantizedLinear else "MLX"
    k = module["weight"].shape[1]
    if exact_products.serves(module, rows, k, dtype):
        return "exact"
    if type(module) is nn.QuantizedLinear:
        variant = quantized.variant_of(module, dtype)
        n = module["weight"].shape[0]
        serves = variant is not None and quantized.use_quantized_kernel(quantized.backend(), variant, n, rows)
        return "quantized kernel" if serves else "MLX quantized"
    products = block_products()
    bias = module["bias"] if "bias" in module else None
    if (
        products is not None
        and products.passed(dtype) is not None
        and products.fits((1, rows), k, dtype, module.weight, bias, None)
    ):
        return "block product"
    return "MLX"


def served(target, rows: int, keys: int) -> dict[str, str]:
    """What the verify's first layer and the head run on this machine over
    ``keys`` buffer positions (each kernel module asked of its own backend)."""
    from dflash_mlx.kernels import dispatch, exact_attention, norm_rope
    from dflash_mlx.layers.fused import FUSABLE_BLOCKS, projections
    from dflash_mlx.layers.linear import linear_head, quantized_head

    i = target.here[0]
    layer, dtype, d = target.inner.layers[i], target.dtype, target.head_dim
    head = head_path(target, rows, linear_head, quantized_head)
    if target.blocks[0] is layer:
        return {"layers": "mlx-lm's own", "head": head}
    if type(layer) not in FUSABLE_BLOCKS:
        return {"layers": f"the {target.family} adapter's", "head": head}
    attn, mlp = layer.self_attn, layer.mlp
    fused = projections(layer) if target.fuse_projections else None
    found = {
        "q/k/v": ("fused " if fused else "") + product_path(fused.kvq if fused else attn.q_proj, rows, dtype),
        "norm+rope": "MLX ops",
        "attention": "MLX",
        "o_proj": product_path(attn.o_proj, rows, dtype),
        "gate/up": ("fused " if fused else "") + product_path(fused.gate_up if fused else mlp.gate_proj, rows, dtype),
        "down": product_path(mlp.down_proj, rows, dtype),
        "head": head,
    }
    if getattr(attn, "q_norm", None) is not None and norm_rope.plain_rope(attn.rope, d):
        found["norm+rope"] = "kernel" if norm_rope.passed(dtype, d) is not None else "MLX ops"
    window = target.windows()[i]
    group = attn.n_heads // attn.n_kv_heads * rows
    kernel = dispatch.serving_kernel(dispatch.backend(), dtype, d, window is not None, rows=group, keys=keys)
    found["attention"] = "kernel" if kernel is not None else "MLX"
    # (shapes alone: never evaluated)
    q, k = mx.zeros((1, attn.n_heads, rows, d), dtype), mx.zeros((1, attn.n_kv_heads, keys, d), dtype)
    if window is None and exact_attention.serves(exact_attention.backend(), q, k):
        found["attention"] = "exact kernel"
    return found


def head_path(target, rows: int, linear_head, quantized_head) -> str:
    if not target.tied:
        return product_path(target.text.lm_head, rows, target.dtype)
    embedding = target.inner.embed_tokens
    as_linear = quantized_head if type(embedding) is nn.QuantizedEmbedding else linear_head
    return product_path(as_linear(embedding), rows, target.dtype)


def switches(target, uses: dict[str, str]) -> list[tuple[str, Callable[[], None]]]:
    """(name, switch it off) for each of our kernels and fusions serving here,
    then all of them together; ``restore`` switches them back."""
    from dflash_mlx.kernels import dispatch, exact_attention, exact_products, norm_rope, quantized

    paths = " ".join(uses.values())
    found = []
    if target.fuse_projections:
        found.append(("mlx-lm's layers", lambda: unfuse(target)))
    if uses.get("norm+rope") == "kernel":
        found.append(("norm+rope kernel off", norm_rope.reset))
    if uses.get("attention") == "exact kernel":
        found.append(("exact attention off", exact_attention.reset))
    if any_attention_kernel(target):
        found.append(("attention kernel off", dispatch.reset))
    if "exact" in paths:
        found.append(("exact products off", exact_products.reset))
    if "quantized kernel" in paths:
        found.append(("quantized kernel off", quantized.reset))
    if "block product" in paths:
        found.append(("block products off", block_products().reset))
    if found:
        offs = [off for _, off in found]
        found.append(("all of ours off", lambda: [off() for off in offs]))
    return found


def any_attention_kernel(target) -> bool:
    from dflash_mlx.kernels import dispatch

    where, windows = dispatch.backend(), {w is not None for w in target.windows()}
    return any(dispatch.passed_kernel(where, target.dtype, target.head_dim, w) is not None for w in windows)


def unfuse(target) -> None:
    target.fuse_projections = False
    target.make_blocks()


def restore(target, fuse: bool) -> None:
    """Fusions and kernels back as the adapter made them (each kernel checked again)."""
    from dflash_mlx.layers.fused import projections
    from dflash_mlx.layers.linear import prepare_products

    target.fuse_projections = fuse
    target.make_blocks()
    prepare_products(target.text, target.dtype)
    if fuse:
        for i in target.here:
            made = projections(target.inner.layers[i])
            if made is not None:
                prepare_products(made.kvq, target.dtype)
                prepare_products(made.gate_up, target.dtype)


# ---- the probe -------------------------------------------------------------------


def cycle_read(target) -> str:
    """How a cycle's verify spans the buffers here: at their fixed width where
    the cycle is compiled (decode/cycle.py's rule), else up to the bound."""
    from dflash_mlx import compute_dtype

    gpu = mx.default_device().type == mx.DeviceType.gpu
    compiled = gpu or (compute_dtype.on_fast_blas(target.dtype) and shutil.which("g++") is not None)
    return "fixed" if compiled else "bound"


def read_width(read: str, length: int) -> int:
    """The keys a verify's attention spans once ``length`` positions are written."""
    from dflash_mlx.kv.buffer import BufferKVCache

    return BufferKVCache().room(length) if read == "fixed" else length


@dataclass
class Run:
    name: str
    diffs: dict[tuple, Difference]
    argmax_equal: int | None  # None: no logits to compare (a prompt chunk's)
    replay: str = ""
    rows: int = 0  # the rows compared
    mask: str = ""  # the first layer's mask in ours, where seen

    @property
    def first(self) -> tuple | None:
        return first_difference(self.diffs)


def run_of(name: str, got: Verified, against: Pieces, layers: range) -> Run:
    """``got`` compared with ``against`` (the one-row steps' pieces, or another run's)."""
    diffs = compare(got.pieces, against, layers)
    key = ("model", "logits")
    agree = None
    if key in diffs:
        ours, theirs = got.pieces[key], against[key]
        agree = int((greedy_token(ours) == greedy_token(theirs)).sum().item())
    replay = f"{len(got.replay_exact)}/{len(got.replayed)}" if got.replayed else ""
    rows = against[next(iter(diffs))].shape[0] if diffs else 0
    return Run(name, diffs, agree, replay, rows, got.mask)


def check_sizes(prompt_tokens: int, committed: int, rows: int) -> None:
    if prompt_tokens < 1 or committed < 0 or rows < 2:
        raise ValueError("pass --prompt-tokens of at least 1, --committed of 0 or more and --rows of at least 2.")


def dense_target(model: nn.Module):
    """Our adapter of ``model``, if the probe can read it: dense attention
    over plain buffers on our side, mlx-lm's plain KV caches on its."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    from dflash_mlx.kv.buffer import BufferKVCache
    from dflash_mlx.targets import DenseTarget, adapt

    target = adapt(model)  # (fuses projections, as load does before any decoding)
    if type(target).__call__ is not DenseTarget.__call__ or any(
        type(c) is not BufferKVCache for c in target.make_cache()
    ):
        raise ValueError(
            f"the probe reads dense-attention targets over plain buffers (qwen3, llama); {target.family} is not one."
        )
    if any(type(c) is not KVCache for c in make_prompt_cache(model)):
        raise ValueError(
            "the probe compares with mlx-lm's plain KV caches; this target's keeps rotating or other caches."
        )
    return target


def probe(
    model: nn.Module, prompt: list[int], *, committed: int = 3, rows: int = 16, variants: bool = True, plant=None
):
    """Compare our verify of ``rows`` tokens with mlx-lm's one-row steps after
    ``prompt`` and ``committed`` tokens. ``plant``: a context manager factory
    ``plant(target)`` active around each of our compared verifies (a test's
    planted difference). Returns the report (``report_json``'s input)."""
    from dflash_mlx.kernels import decisions

    check_sizes(len(prompt), committed, rows)
    target = dense_target(model)
    reference = one_row_reference(model, prompt, committed, rows)
    start = len(prompt) + committed
    tokens = reference.tokens[committed : committed + rows]
    read, layers = cycle_read(target), target.here
    report = {
        "policy": decisions.current().policy,
        "read": read,
        "start": start,
        "tokens": tokens,
        "served": served(target, rows, read_width(read, start + rows)),
    }

    def seeded():
        return seeded_cache(target, reference.history)

    first = our_verify(target, seeded(), tokens, start, read, plant=plant, reference=reference.pieces)
    runs = [run_of("verify", first, reference.pieces, layers)]
    if first.isolated is not None:
        runs.append(run_of(ISOLATED, Verified(first.isolated, [], []), reference.pieces, layers))
    # (a verify that is not deterministic cannot equal anything bit for bit)
    runs.append(
        run_of(
            "verify again, vs verify",
            our_verify(target, seeded(), tokens, start, read, plant=plant),
            first.pieces,
            layers,
        )
    )
    block = reference.tokens[: max(rows, committed)]
    own = own_history(target, prompt, block, committed, read)
    report["history"] = history_difference(target, own, reference.history)
    runs.append(
        run_of("own history", our_verify(target, own, tokens, start, read, plant=plant), reference.pieces, layers)
    )
    compiled = compiled_verify(target, seeded(), tokens, start, plant=plant)
    runs.append(run_of("compiled", compiled, reference.pieces, layers))
    if variants:
        fuse = target.fuse_projections
        for name, off in switches(target, report["served"]):
            off()
            try:
                got = our_verify(target, seeded(), tokens, start, read, plant=plant)
                runs.append(run_of(name, got, reference.pieces, layers))
            finally:
                restore(target, fuse)
    report["runs"] = runs
    return report


LAST_ID = "last id"
PLAIN = "plain step"
PLAIN_ISOLATED = "plain step, each alone"
CHUNKS = "chunks' rows"
EXACT_READ = "last id, read as a plain step"


def check_prefill_sizes(prompt_tokens: int, committed: int) -> None:
    if prompt_tokens < 2 or committed < 0:
        raise ValueError("pass --prompt-tokens of at least 2 and --committed of 0 or more with --prefill.")


def probe_prefill(
    model: nn.Module,
    prompt: list[int],
    *,
    committed: int = 3,
    step: int = 2048,
    chunks: bool = False,
    variants: bool = True,
    plant=None,
):
    """Compare our prefill of ``prompt`` (decode/loop.py's ``prefill``: chunks
    of ``step`` ids, then the last id alone) with mlx-lm's ``generate_step``
    reading it, piece by piece at the last id (``chunks``: at the chunks' rows
    too), and a plain step (a block of 1) at P+C with mlx-lm's step there.
    ``plant`` as ``probe``'s, around each of our forwards. Returns the report."""
    from dflash_mlx.kernels import decisions

    check_prefill_sizes(len(prompt), committed)
    target = dense_target(model)
    steps = mlx_lm_steps(model, prompt, committed + 2, step=step, chunks=chunks)
    last, at = len(prompt) - 1, len(prompt) + committed
    lone, step_pieces = stacked([steps.calls[last]]), stacked([steps.calls[at]])
    history, step_history = before(steps.cache, last), before(steps.cache, at)
    mx.eval(lone, step_pieces, history, step_history)
    token = steps.tokens[committed]  # (the plain step's input: the token at P+C)
    read, layers = cycle_read(target), target.here
    report = {
        "mode": "prefill",
        "policy": decisions.current().policy,
        "read": read,
        "last": last,
        "step_at": at,
        "token": token,
    }

    def over(history):
        """Our buffers holding mlx-lm's keys and values, at a host length (as a prefill leaves them)."""
        return seeded_cache(target, history)

    def lone_row(cache, reference=None, length=None):
        return our_forward(
            target, cache, prompt[-1:], last, length=length, last_only=True, plant=plant, reference=reference
        )

    def exact_length(n):  # (a plain step's after a plain step, decode/cycle.py's: no mask where it reads every key)
        return lambda cache: target.set_length(cache, n, n, "exact")

    first = lone_row(over(history), lone)
    report["served"] = lone_row_served(target, last + 1, first.mask)
    runs = [run_of(LAST_ID, first, lone, layers)]
    if first.isolated is not None:
        runs.append(run_of(ISOLATED, Verified(first.isolated, [], []), lone, layers))
    runs.append(run_of("last id again, vs last id", lone_row(over(history)), first.pieces, layers))
    # the last id read as a plain step reads its row: where this run agrees and the first does not, the mask parts them
    exact_read = lone_row(over(history), length=exact_length(last))
    runs.append(run_of(EXACT_READ, exact_read, lone, layers))
    own = own_prefill(target, prompt, step, chunks=chunks, plant=plant)
    report["history"] = history_difference(target, own.cache, history)
    runs.append(run_of("own chunks, last id", own.last, lone, layers))
    if own.chunks is not None:
        theirs = stacked([steps.calls[s] for s in own.starts])
        runs.append(run_of(CHUNKS, own.chunks, theirs, layers))

    plain = our_forward(
        target, over(step_history), [token], at, length=exact_length(at), plant=plant, reference=step_pieces
    )
    runs.append(run_of(PLAIN, plain, step_pieces, layers))
    if plain.isolated is not None:
        runs.append(run_of(PLAIN_ISOLATED, Verified(plain.isolated, [], []), step_pieces, layers))
    # a plain step after a block: its length on the device, eager here, compiled where the cycle is
    after_block = our_verify(target, over(step_history), [token], at, read, plant=plant)
    runs.append(run_of("plain step, device length", after_block, step_pieces, layers))
    compiled = compiled_verify(target, over(step_history), [token], at, plant=plant)
    runs.append(run_of("plain step, compiled", compiled, step_pieces, layers))
    if variants:
        fuse = target.fuse_projections
        for name, off in switches(target, report["served"]):
            off()
            try:
                runs.append(run_of(f"last id, {name}", lone_row(over(history)), lone, layers))
            finally:
                restore(target, fuse)
    report["masks"] = {
        LAST_ID: {"ours": first.mask, "mlx-lm": steps.masks[last]},
        EXACT_READ: {"ours": exact_read.mask, "mlx-lm": steps.masks[last]},
        PLAIN: {"ours": plain.mask, "mlx-lm": steps.masks[at]},
    }
    report["runs"] = runs
    return report


def lone_row_served(target, keys: int, mask: str) -> dict[str, str]:
    """``served`` for one row at a host length over ``keys`` positions behind
    ``mask`` (``mask_kind``'s): a target's lone row takes the layer's own
    projections where exactness comes first (layers/fused.py's ``fused_rows``),
    and its attention follows layers/attention.py's rule for rows at a host offset."""
    from dflash_mlx.kernels import decisions, dispatch
    from dflash_mlx.layers.attention import one_row_step
    from dflash_mlx.layers.fused import fused_rows

    found = served(target, 1, keys)
    layer = target.inner.layers[target.here[0]]
    one_row = mx.zeros((1, 1, target.hidden_size), target.dtype)  # (only shapes are read)
    if found.get("q/k/v", "").startswith("fused ") and not fused_rows(one_row):
        found["q/k/v"] = "own " + product_path(layer.self_attn.q_proj, 1, target.dtype)
        found["gate/up"] = "own " + product_path(layer.mlp.gate_proj, 1, target.dtype)
    if "attention" in found:
        attn, where = layer.self_attn, dispatch.backend()
        q = mx.zeros((1, attn.n_heads, 1, target.head_dim), target.dtype)
        kernel = None
        if not decisions.current().exact_first(where) and not one_row_step(q, None if mask == "none" else mask, where):
            group = attn.n_heads // attn.n_kv_heads
            kernel = dispatch.serving_kernel(where, target.dtype, target.head_dim, False, rows=group, keys=keys)
        found["attention"] = ("kernel" if kernel is not None else "MLX") + f", mask {mask}"
    return found


# ---- output ----------------------------------------------------------------------


def piece_name(key: tuple) -> str:
    return f"{key[0]}/{key[1]}" if key[0] != "model" else key[1]


def report_json(report: dict) -> dict:
    """The report with its tables as plain JSON."""

    def table(diffs):
        return {piece_name(k): {"rows": d.rows, "max_abs": d.worst} for k, d in diffs.items()}

    out = {k: v for k, v in report.items() if k not in ("history", "runs")}
    out["history"] = table(report["history"])
    out["runs"] = [
        {
            "name": r.name,
            "first_difference": None if r.first is None else list(r.first),
            "rows": r.rows,
            "argmax_equal": r.argmax_equal,
            "replay_exact": r.replay,
            "mask": r.mask,
            "pieces": table(r.diffs),
        }
        for r in report["runs"]
    ]
    return out


def print_report(report: dict, rows: int) -> None:
    print("served (layer 0): " + ", ".join(f"{k} {v}" for k, v in report["served"].items()))
    print_history(report["history"], "our prefill and committed block", report["start"])
    main = report["runs"][0]
    print_table(main, f"verify over mlx-lm's cache: rows (of {rows}) differing from the one-row step / max |diff|")
    print_first(main)
    alone = next((r for r in report["runs"] if r.name == ISOLATED), None)
    if alone is not None:
        print_table(alone, "each piece of ours from mlx-lm's inputs to it: its own rounding, not what it inherits")
    print_runs(report["runs"])


def print_prefill_report(report: dict) -> None:
    """The prompt's last id (then a plain step, and the chunks' rows if read) against mlx-lm's."""
    last, at = report["last"], report["step_at"]
    print("served (layer 0, the last id): " + ", ".join(f"{k} {v}" for k, v in report["served"].items()))
    masks = report["masks"]
    print(
        "masks (layer 0): "
        + "; ".join(f"{name}: ours {m['ours']}, mlx-lm's {m['mlx-lm']}" for name, m in masks.items())
    )
    print_history(report["history"], "our prompt chunks", last)
    runs = {r.name: r for r in report["runs"]}
    print_table(
        runs[LAST_ID],
        f"the prompt's last id (position {last}) read alone over mlx-lm's cache, as our prefill reads it: "
        "differing from mlx-lm's one-row step / max |diff|",
    )
    print_first(runs[LAST_ID])
    if ISOLATED in runs:
        print_table(runs[ISOLATED], "each piece of ours from mlx-lm's inputs to it: its own rounding")
    if CHUNKS in runs:
        chunks = runs[CHUNKS]
        print_table(chunks, f"the prompt chunks' rows (of {chunks.rows}), each call over our own cache")
        print_first(chunks)
    print_table(
        runs[PLAIN], f"a plain step (a block of 1, its length on the host) at position {at} over mlx-lm's cache"
    )
    print_first(runs[PLAIN])
    if PLAIN_ISOLATED in runs:
        print_table(runs[PLAIN_ISOLATED], "each piece of ours from mlx-lm's inputs to it: its own rounding")
    print_runs(report["runs"])


def print_history(history: dict[tuple, Difference], what: str, positions: int) -> None:
    parted = sorted({k[0] for k, d in history.items() if d.rows})
    if not parted:
        print(f"history: {what} cache every position as mlx-lm does")
    else:
        cells = "  ".join(f"{i}: k {history[(i, 'k')].cell()} v {history[(i, 'v')].cell()}" for i in parted[:8])
        print(f"history: positions whose cached k/v differ from mlx-lm's (of {positions}), layers {cells}")


def print_first(run: Run) -> None:
    first = "none" if run.first is None else piece_name(run.first)
    replayed = f" (the replay reproduced {run.replay} layers' outputs)" if run.replay else ""
    print(f"first difference: {first}{replayed}")


def print_runs(runs: list[Run]) -> None:
    """A line a run: its first difference, its logits' rows differing, and argmax agreement."""
    w = max(26, *(len(r.name) for r in runs))
    print(
        f"\n{'run':<{w}} {'first difference':<20} {'logit rows':>10} {'max':>8} {'argmax equal':>12} {'replay exact':>12}"
    )
    for r in runs:
        first = "none" if r.first is None else piece_name(r.first)
        logits = r.diffs.get(("model", "logits"))
        rows, worst = ("-", "-") if logits is None else (logits.rows, f"{logits.worst:.1e}")
        agree = "-" if r.argmax_equal is None else f"{r.argmax_equal}/{r.rows}"
        print(f"{r.name:<{w}} {first:<20} {rows:>10} {worst:>8} {agree:>12} {r.replay or '-':>12}")


def print_table(run: Run, title: str) -> None:
    """A run's pieces, a line a layer: rows differing / max |diff| ("." unseen)."""
    layers = sorted({k[0] for k in run.diffs if k[0] != "model"})
    width = {p: max(len(p), 7) for p in LAYER_PIECES}
    print(f"\n{title}")
    print("layer " + " ".join(f"{p:>{width[p]}}" for p in LAYER_PIECES))
    for i in layers:
        cells = [run.diffs.get((i, p)) for p in LAYER_PIECES]
        print(
            f"{i:>5} " + " ".join(f"{'.' if c is None else c.cell():>{width[p]}}" for c, p in zip(cells, LAYER_PIECES))
        )
    print(
        "model " + "  ".join(f"{p} {run.diffs[('model', p)].cell()}" for p in MODEL_PIECES if ("model", p) in run.diffs)
    )


# ---- the command --------------------------------------------------------------------


def load_model(args) -> tuple[nn.Module, str]:
    """The target (an mlx-lm model) and how to name it."""
    if args.model:
        from dflash_mlx.loading import load_target

        model, _ = load_target(args.model)
        name = args.model
    elif args.shape == "builtin":
        from dflash_mlx import builtin
        from dflash_mlx.loading import load_target

        model, _ = load_target(builtin.TARGET)
        name = "built-in target"
    else:
        from cycle import random_target

        mx.random.seed(0)
        model = random_target(args.shape)
        name = f"{args.shape} random weights"
    if args.dtype:
        model.set_dtype(getattr(mx, args.dtype))
    if args.quantize:
        nn.quantize(model, group_size=64, bits=args.quantize)
        name += f" {args.quantize}-bit"
    mx.eval(model.parameters())
    return model, name


def main():
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # (its neighbour cycle.py, run as a script or not)
    from cycle import SHAPES, synthetic_prompt

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a target model directory or Hub repo (default: --shape)")
    ap.add_argument(
        "--shape", default="builtin", choices=["builtin", *SHAPES], help="random weights at a model's shapes"
    )
    ap.add_argument("--quantize", type=int, choices=[4, 8], help="mlx-lm quantization of the target (bits)")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], help="cast the target (default: its own)")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--committed", type=int, default=3, help="tokens committed after the prompt before the verify")
    ap.add_argument("--rows", type=int, default=16, help="the verify's block")
    ap.add_argument("--kernels", choices=["measure", "on", "off"], help="DFLASH_MLX_KERNELS for this run")
    ap.add_argument("--no-variants", action="store_true", help="skip the runs with our kernels switched off")
    ap.add_argument(
        "--prefill",
        action="store_true",
        help="compare our prefill's last id (read alone) and a plain step at P+C with mlx-lm's, not a verify",
    )
    ap.add_argument("--prefill-step", type=int, default=2048, help="the prompt's chunk size, both sides (--prefill)")
    ap.add_argument("--chunks", action="store_true", help="with --prefill, compare the chunks' rows too (memory)")
    ap.add_argument("--json", metavar="PATH", help="also write the report here")
    args = ap.parse_args()
    if args.kernels:
        from dflash_mlx.kernels import decisions

        os.environ["DFLASH_MLX_KERNELS"] = args.kernels
        decisions.reset()
    try:
        if args.prefill:
            check_prefill_sizes(args.prompt_tokens, args.committed)
        else:
            check_sizes(args.prompt_tokens, args.committed, args.rows)
        model, name = load_model(args)
        vocab = int(getattr(model, "language_model", model).args.vocab_size)
        prompt = synthetic_prompt(vocab, args.prompt_tokens)
        if args.prefill:
            report = probe_prefill(
                model,
                prompt,
                committed=args.committed,
                step=args.prefill_step,
                chunks=args.chunks,
                variants=not args.no_variants,
            )
        else:
            report = probe(model, prompt, committed=args.committed, rows=args.rows, variants=not args.no_variants)
    except ValueError as e:
        sys.exit(f"verify_rounding.py: {e}")
    machine = f"{platform.platform()}, mlx {mx.__version__}, device {mx.default_device()}"
    report = {"machine": machine, "target": name, "args": vars(args), **report}
    print(machine)
    if args.prefill:
        print(
            f"{name}: prompt {args.prompt_tokens} tokens in chunks of {args.prefill_step}, the last id alone; "
            f"a plain step after {args.committed} committed; DFLASH_MLX_KERNELS={report['policy']}"
        )
        print_prefill_report(report)
    else:
        print(
            f"{name}: prompt {args.prompt_tokens} tokens, {args.committed} committed, verify of {args.rows} rows; "
            f"DFLASH_MLX_KERNELS={report['policy']}, buffers read {report['read']}"
        )
        print_report(report, args.rows)
    if args.json:
        Path(args.json).write_text(json.dumps(report_json(report), indent=1))


if __name__ == "__main__":
    main()
