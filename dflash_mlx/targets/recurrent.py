"""Gated delta-net layers with exact rollback (Qwen3.5 / 3.6, Qwen3-Next).

A delta-net layer keeps a recurrent state and a short convolution state
instead of keys and values, so rolling back a verify block is not a move of
a length. Each write (a prefill chunk or a verify block) keeps its inputs to
the recurrence (q, k, v, the gates, the convolution input) and a reference to
the state it started from; MLX arrays are immutable, so keeping a reference
costs nothing. Keeping the first ``s`` of its ``T`` steps is then

- convolution: a slice of the kept convolution input at ``s``;
- recurrence: mlx-lm's ``gated_delta_update`` re-run over the T steps from the
  saved state, steps at or past ``s`` masked (they leave the state as it is),

both with ``s`` an array the host never reads, so a cycle's rollback is
decided on the device. A re-run reads the layer's small recurrence inputs
only, never its weights.

That is the ``replay`` rollback. The other known way, ``per-step`` (the
default), keeps the state after every step of a verify instead: the
recurrence runs one step at a time (the same arithmetic, so the same
states), and keeping ``s`` steps is a take of state ``s`` among them, again
with ``s`` on the device. It trades the re-run for writing T states (a
verify's states are dropped once it is cut: older writes replay). Choose
with ``DeltaCache.rollback`` (or per cache); benchmarks/families.py
``--rollback replay,per-step`` times both at real shapes: on an H200 at
Qwen3.5-9B-like shapes (bf16) per-step's rollback cost 3.8 against 9.3 ms a
cycle at block 4 and 22 against 42 ms at block 16 (BENCHMARKS.md). Only
writes of at most ``per_step_longest`` steps (verify blocks) keep their
states: a prefill chunk's would cost far more memory than its re-run.

``set_length`` with a Python int (the prompt cache settling after an
interrupt, a dropped cycle or a shortened conversation) finds the state at
exactly that length among the current state, the last writes and a few
checkpoints, reading their lengths (a sync, but rare). ``restore`` says when
none of them has it; the adapter then re-reads the missing tokens
(hybrid.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gated_delta import compute_g, gated_delta_kernel, gated_delta_ops, gated_delta_update, normalize_qk

ROLLBACKS = ("replay", "per-step")


def _value(n) -> int:
    return n if isinstance(n, int) else int(n.item())


def per_step_update(q, k, v, a, b, layer: nn.Module, state: mx.array | None):
    """mlx-lm's ``gated_delta_update`` one step at a time: the outputs
    [B, T, Hv, Dv], the T+1 states before and after each step stacked
    [T+1, B, Hv, Dv, Dk] (one buffer: a cut takes from it without another
    copy, and the steps' own arrays are let go once it is computed), and the
    last state on its own (the cache's next state must not hold the stack).

    The gates and, off the Metal kernel, the key heads' repeat for the value
    heads are made once for the block, as ``gated_delta_update`` makes them
    once for its whole input: per step they were about six more kernels per
    step and layer, most of the per-step rollback's cost at block 16."""
    B, _, _, Dk = q.shape
    if state is None:
        state = mx.zeros((B, *v.shape[-2:], Dk), mx.float32)
    beta, g = mx.sigmoid(b), compute_g(layer.A_log, a, layer.dt_bias)
    kernel = _metal_kernel(k, layer)
    if not kernel and (repeat := v.shape[-2] // q.shape[-2]) > 1:
        q, k = mx.repeat(q, repeat, -2), mx.repeat(k, repeat, -2)
    step = gated_delta_kernel if kernel else gated_delta_ops
    states, ys = [state], []
    for t in range(q.shape[1]):
        one = slice(t, t + 1)
        y, state = step(q[:, one], k[:, one], v[:, one], g[:, one], beta[:, one], state)
        ys.append(y)
        states.append(state)
    return mx.concatenate(ys, axis=1), mx.stack(states), state


def _metal_kernel(k: mx.array, layer: nn.Module) -> bool:
    """Whether ``gated_delta_update`` would run its Metal kernel here (its own
    rule in mlx-lm 0.32, which pyproject.toml pins below 0.33: check it again
    on a bump): the same steps must run the same arithmetic."""
    Dk = k.shape[-1]
    return (
        not layer.training and mx.default_device() == mx.gpu and mx.metal.is_available() and Dk >= 32 and Dk % 32 == 0
    )


@dataclass
class Write:
    """One write of T steps starting at ``start`` (an int or an array)."""

    start: int | mx.array
    layer: nn.Module
    conv_input: mx.array  # [1, K-1+T, C]: the convolution state before, then the T new inputs
    q: mx.array
    k: mx.array
    v: mx.array
    a: mx.array
    b: mx.array
    state0: mx.array | None  # the recurrent state before the write
    state: mx.array  # ... and after all T steps
    states: mx.array | None = None  # per-step rollback: the states after 0..T steps, stacked [T+1, ...]

    @property
    def steps(self) -> int:
        return self.q.shape[1]

    def after(self, s) -> tuple[mx.array, mx.array]:
        """(convolution state, recurrent state) after the first ``s`` steps
        (an int or an array)."""
        keep = self.conv_input.shape[1] - self.steps
        if isinstance(s, int):
            conv = self.conv_input[:, s : s + keep]
            if s == self.steps:
                return conv, self.state
            if s == 0 and self.state0 is not None:
                return conv, self.state0
        else:
            conv = mx.take(self.conv_input, s + mx.arange(keep), axis=1)
        if self.states is not None:
            return conv, self.states[s] if isinstance(s, int) else mx.take(self.states, s, axis=0)
        mask = (mx.arange(self.steps) < s)[None]
        layer = self.layer
        _, state = gated_delta_update(
            self.q,
            self.k,
            self.v,
            self.a,
            self.b,
            layer.A_log,
            layer.dt_bias,
            self.state0,
            mask,
            use_kernel=not layer.training,
        )
        return conv, state


class DeltaCache:
    """A gated delta-net layer's state at ``offset`` positions (an int, or an
    array the host does not read; ``bound`` a host-side upper bound), with the
    last ``keep`` writes and up to ``checkpoints`` states at known lengths,
    for exact rollback."""

    keep = 3
    checkpoints = 4
    # Longer writes (prefill chunks) keep no inputs, only a checkpoint before
    # them: their inputs would cost far more memory than their states.
    longest_write = 64
    rollback = "per-step"  # or "replay" (see the module's doc); per cache: DeltaCache(rollback=...)
    per_step_longest = 16  # writes this long or shorter keep their per-step states

    def __init__(self, rollback: str | None = None):
        if rollback is not None:
            if rollback not in ROLLBACKS:
                raise ValueError(f"unknown rollback {rollback!r}; choose one of: {', '.join(ROLLBACKS)}.")
            self.rollback = rollback
        self.conv: mx.array | None = None  # the convolution state [1, K-1, C]
        self.ssm: mx.array | None = None  # the recurrent state [1, Hv, Dv, Dk]
        self.offset: int | mx.array = 0
        self.bound = 0
        self.floor = 0
        self.pending: Write | None = None  # the last write, not yet kept or cut
        self.writes: deque[Write] = deque(maxlen=self.keep)
        self.saved: list[tuple[int, mx.array | None, mx.array | None]] = [(0, None, None)]

    # -- the layer's forward -------------------------------------------------
    def forward(self, layer: nn.Module, x: mx.array) -> mx.array:
        """mlx-lm's gated delta-net (``layer``: its GatedDeltaNet module) over
        x [1, T, H] from this state, run from its parts so the recurrence
        inputs are kept; returns the layer's output."""
        self._settle_pending()
        if isinstance(self.offset, int):
            self._checkpoint(self.offset, self.conv, self.ssm)
        B, T, _ = x.shape
        if hasattr(layer, "in_proj_qkvz"):  # Qwen3-Next: fused projections
            q, k, v, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(x), layer.in_proj_ba(x))
            qkv = mx.concatenate([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], axis=-1)
        else:  # Qwen3.5 / 3.6
            qkv = layer.in_proj_qkv(x)
            z = layer.in_proj_z(x).reshape(B, T, layer.num_v_heads, layer.head_v_dim)
            b, a = layer.in_proj_b(x), layer.in_proj_a(x)
        conv = (
            self.conv if self.conv is not None else mx.zeros((B, layer.conv_kernel_size - 1, layer.conv_dim), x.dtype)
        )
        conv_input = mx.concatenate([conv, qkv], axis=1)
        conv_out = nn.silu(layer.conv1d(conv_input))
        q, k, v = [
            t.reshape(B, T, h, d)
            for t, h, d in zip(
                mx.split(conv_out, [layer.key_dim, 2 * layer.key_dim], -1),
                [layer.num_k_heads, layer.num_k_heads, layer.num_v_heads],
                [layer.head_k_dim, layer.head_k_dim, layer.head_v_dim],
            )
        ]
        q, k = normalize_qk(q, k, inv_scale=layer.head_k_dim**-0.5, eps=1e-6)
        states = None
        if self.rollback == "per-step" and T <= self.per_step_longest:
            out, states, state = per_step_update(q, k, v, a, b, layer, self.ssm)
        else:
            out, state = gated_delta_update(
                q, k, v, a, b, layer.A_log, layer.dt_bias, self.ssm, use_kernel=not layer.training
            )
        if T <= self.longest_write:
            self.pending = Write(self.offset, layer, conv_input, q, k, v, a, b, self.ssm, state, states)
        self.offset = self.offset + T
        self.bound += T
        self.conv, self.ssm = conv_input[:, T:], state
        out = layer.norm(out, z)
        return layer.out_proj(out.reshape(B, T, -1))

    def _settle_pending(self) -> None:
        """Keep the pending write whole (a write followed by another, as
        prefill chunks are)."""
        if self.pending is not None:
            self.pending.states = None  # T states are too many to keep: an older write replays
            self.writes.append(self.pending)
            self.pending = None

    # -- rollback ------------------------------------------------------------
    def set_length(self, length: int | mx.array, bound: int | None = None) -> None:
        """Keep the first ``length`` positions. An array length cuts the
        pending write on the device (a verify's rollback), or else names the
        current length; an int restores the exact state (see ``restore``),
        raising LookupError if none is kept."""
        if isinstance(length, int):
            if not self.restore(length):
                raise LookupError(f"no state kept at length {length}")
            return
        if isinstance(self.offset, int) and self.pending is None:
            self._checkpoint(self.offset, self.conv, self.ssm)
        if self.pending is not None:
            w = self.pending
            s = mx.clip(length - w.start, 0, w.steps)
            self.conv, self.ssm = w.after(s)
            self._settle_pending()
        self.offset, self.bound = length, bound

    def restore(self, n: int) -> bool:
        """Make the state exactly the one after ``n`` positions if it is kept
        (the current one, a recent write's, or a checkpoint); False if not."""
        found = None
        if self.pending is None and _value(self.offset) == n:
            found = self.conv, self.ssm
        else:
            for w in ([self.pending] if self.pending is not None else []) + list(reversed(self.writes)):
                start = _value(w.start)
                if start <= n <= start + w.steps:
                    found = w.after(n - start)
                    break
        if found is None:
            found = next(((c, s) for m, c, s in self.saved if m == n), None)
        if found is None:
            return False
        self.pending = None
        self.writes = deque((w for w in self.writes if _value(w.start) < n), maxlen=self.keep)
        self.saved = [t for t in self.saved if t[0] <= n]
        self.conv, self.ssm = found
        self.offset = self.bound = n
        return True

    def restorable(self, n: int) -> int:
        """The longest length <= n this cache can restore exactly from its
        checkpoints alone."""
        return max(m for m, _, _ in self.saved if m <= n)

    def _checkpoint(self, n: int, conv, state) -> None:
        self.saved = [t for t in self.saved if t[0] != n] + [(n, conv, state)]
        if len(self.saved) > self.checkpoints + 1:  # the empty state stays
            del self.saved[1]

    # -- what the prompt cache reads -----------------------------------------
    @property
    def capacity(self) -> int:
        return self.bound

    def reserve(self, n: int) -> None:
        pass

    @property
    def state(self):
        return self.conv, self.ssm

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.conv, self.ssm) if a is not None)
