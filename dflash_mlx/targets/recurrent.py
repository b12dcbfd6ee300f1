"""Gated delta-net layers with exact rollback (Qwen3.5 / 3.6, Qwen3-Next).

A delta-net layer keeps a recurrent and a convolution state instead of keys
and values, so each write keeps its recurrence inputs (q, k, v, the gates)
and the state it began from. Keeping the first ``s`` of its ``T`` steps
(``s`` possibly an array the host never reads) is a slice of the convolution
input plus one of two rollbacks:

- ``replay``: the first ``s`` steps re-run from the saved state
  (kernels/gated_delta.py: one launch reading ``s`` on the device where a
  kernel runs, masked steps elsewhere);
- ``per-step``: the verify runs a launch a step and keeps its T+1 states; the
  cut takes one (writes and trees of at most ``per_step_longest`` steps or
  nodes; longer ones replay).

Per cycle and delta-net layer, with S the bytes of a state (float32 [Hv, Dv,
Dk]): replay moves 4 S in 2 launches (the verify and the replay each read and
write a state); per-step moves (4T + 4) S in T + 2 launches (T steps reading
and writing it, T+1 states stacked, the take). So the default (``rollback``
None) is replay wherever it is one exact kernel launch (Metal; CUDA once its
kernel passed its check), and per-step where the recurrence runs as ops (the
CPU), where a replay would run each step's ops again. Where replay is one
launch, a machine measures it against per-step at each layer's shapes once
(``measure_rollback``, when the target is prepared) and keeps per-step where
replay was slower (kernels/decisions.py; a block's and a tree's apart).
Either leaves the state bit for bit as if the rejected tokens were never fed.

A draft tree's verify (``tree`` set, kv/tree.py) runs each node from its
K-1 nearest ancestors' convolution inputs and its parent's state, so node i
sees what a plain run over its root-to-i path would. ``keep_path`` then
makes the write the accepted path's: its inputs gathered, and, per-step,
the rows of its nodes' states; the cut is a block's (replay re-runs the
path's inputs from the saved state, per-step takes the last node's state).

``set_length`` with an int restores an exact state from the last writes or a
few checkpoints; ``restore`` says when none has it, and the adapter re-reads
(hybrid.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gated_delta import compute_g, normalize_qk

from ..device import constant_arange
from ..kernels import decisions
from ..kernels.gated_delta import check_parents, one_launch_replay, recurrence, tree_recurrence
from ..kernels.serving import MEASURED_ROWS
from ..kv.tree import TreeLayout

ROLLBACKS = ("replay", "per-step")
ROLLBACK_DECISION = "rollback by replay"  # in this machine's decisions, against per-step


def _value(n) -> int:
    return n if isinstance(n, int) else int(n.item())


def default_rollback(q, v, g, beta, state, *, use_kernel: bool = True, tree: bool = False) -> str:
    """The rollback that moves the fewest bytes in the fewest launches here
    (the module's doc), unless this machine measured replay slower than
    per-step at these shapes, for a block or a ``tree`` (``measure_rollback``).
    Never measures."""
    if not one_launch_replay(q, v, g, beta, state, use_kernel):
        return "per-step"
    found = decisions.current().measured(ROLLBACK_DECISION, rollback_case(q, v, tree))
    return "per-step" if found is not None and not found.faster else "replay"


def rollback_case(q: mx.array, v: mx.array, tree: bool = False) -> str:
    """A delta-net layer's shapes, as its rollback decision names them."""
    *_, Hk, Dk = q.shape
    *_, Hv, Dv = v.shape
    dtype = str(q.dtype).split(".")[-1]
    verify = f"a tree of {MEASURED_ROWS}" if tree else f"T={MEASURED_ROWS}"
    return f"{dtype} Hk={Hk} Hv={Hv} Dk={Dk} Dv={Dv} {verify}, MLX's own: per-step"


def rollback_inputs(layer: nn.Module, dtype) -> tuple:
    """Recurrence inputs of a verify of MEASURED_ROWS at mlx-lm's delta-net ``layer``'s shapes."""
    Hk, Hv, Dk, Dv = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    kq, kk, kv, ka, kb = mx.random.split(mx.random.key(Dk + Dv), 5)
    T = MEASURED_ROWS
    q = mx.random.normal((1, T, Hk, Dk), key=kq).astype(dtype)
    k = mx.random.normal((1, T, Hk, Dk), key=kk).astype(dtype)
    q, k = normalize_qk(q, k, inv_scale=Dk**-0.5, eps=1e-6)
    v = mx.random.normal((1, T, Hv, Dv), key=kv).astype(dtype)
    g = mx.exp(-mx.exp(mx.random.uniform(-3.0, 0.5, (1, T, Hv), key=ka)))
    beta = mx.sigmoid(mx.random.normal((1, T, Hv), key=kb)).astype(dtype)
    return q, k, v, g, beta, mx.zeros((1, Hv, Dv, Dk), mx.float32)


def measure_rollback(layer: nn.Module, dtype) -> None:
    """Where replay is one exact launch at this delta-net ``layer``'s shapes,
    time a verify of MEASURED_ROWS, a block's and a tree's, and its cut by
    replay against per-step, once a machine (decisions.py). Call outside
    compiled traces."""
    inputs = rollback_inputs(layer, dtype)
    q, _, v, g, beta, state = inputs
    store = decisions.current()
    block, tree = rollback_case(q, v), rollback_case(q, v, tree=True)
    needed = store.needs(ROLLBACK_DECISION, block) or store.needs(ROLLBACK_DECISION, tree)
    if not needed or not one_launch_replay(q, v, g, beta, state):
        return
    s = mx.array([MEASURED_ROWS // 2], mx.int32)

    def replay():
        y, _ = recurrence(*inputs)
        return y, recurrence(*inputs, steps=s)[1]

    def per_step():
        y, states, _ = per_step_update(*inputs)
        return y, mx.take(states, s, axis=0)

    parents = check_parents(MEASURED_ROWS)
    path = [MEASURED_ROWS - 1]  # the deepest node's, from the root
    while path[-1]:
        path.append(parents[path[-1]].item())
    path = mx.array(path[::-1], mx.int32)
    cut = mx.minimum(s, path.shape[0])

    def tree_replay():
        y, _ = tree_recurrence(*inputs, parents=parents, keep_all=False)
        return y, recurrence(*(mx.take(a, path, axis=1) for a in inputs[:5]), state, steps=cut)[1]

    def tree_per_step():
        y, states = tree_recurrence(*inputs, parents=parents)
        return y, mx.take(states, mx.take(path, cut - 1) + 1, axis=0)

    store.decide(ROLLBACK_DECISION, block, replay, per_step)
    store.decide(ROLLBACK_DECISION, tree, tree_replay, tree_per_step)


def per_step_update(q, k, v, g, beta, state, *, use_kernel: bool = True):
    """The recurrence one step a launch: returns the outputs [B, T, Hv, Dv],
    the T+1 states stacked [T+1, B, Hv, Dv, Dk], and the last state on its own
    (the cache's next state must not hold the stack). Each step runs what a
    whole write runs, so the states are those of a plain run."""
    states, ys = [state], []
    for t in range(q.shape[1]):
        one = slice(t, t + 1)
        y, state = recurrence(q[:, one], k[:, one], v[:, one], g[:, one], beta[:, one], state, use_kernel=use_kernel)
        ys.append(y)
        states.append(state)
    return mx.concatenate(ys, axis=1), mx.stack(states), state


def tree_windows(conv_input: mx.array, tree: TreeLayout, width: int) -> mx.array:
    """Each node's convolution input [T, width, C] from ``conv_input`` [1,
    width-1+T, C] (the state before the tree, then the nodes' inputs): its
    width-1 nearest ancestors' inputs, then its own, reaching into the state
    before the tree past the root."""
    keep = width - 1
    up = constant_arange(tree.size)
    columns = [keep + up]  # distance 0: the node itself
    for m in range(1, width):
        up = tree.parents[up]
        columns.append(mx.where(m <= tree.depths, keep + up, keep + tree.depths - m))
    return mx.take(conv_input[0], mx.stack(columns[::-1], axis=1), axis=0)


class PathRows:
    """A tree's accepted path (node indices from the root) as the rows every
    delta-net layer's kept write reads, made once for all of them: of its
    convolution input (the ``keep`` rows before the tree, then the path's)
    and of its stacked states (the state before the tree, then after each
    path node)."""

    def __init__(self, path: mx.array):
        self.path = path.astype(mx.int32)
        self.states = mx.concatenate([constant_arange(1), self.path + 1])
        self._conv: dict[int, mx.array] = {}

    def conv(self, keep: int) -> mx.array:
        if keep not in self._conv:
            self._conv[keep] = mx.concatenate([constant_arange(keep), self.path + keep])
        return self._conv[keep]


@dataclass(kw_only=True)
class Write:
    """One write of T steps starting at ``start`` (an int or an array)."""

    start: int | mx.array
    conv_input: mx.array  # [1, K-1+T, C]: the convolution state before, then the T new inputs
    q: mx.array
    k: mx.array
    v: mx.array
    g: mx.array
    beta: mx.array
    state0: mx.array  # the recurrent state before the write
    state: mx.array | None  # ... and after all T steps (None: a tree's or a path's)
    use_kernel: bool = True
    states: mx.array | None = None  # per-step rollback: the states after 0..T steps, stacked [T+1, ...]
    parents: mx.array | None = None  # a draft tree's nodes until ``kept``: node order, not steps
    rows: mx.array | None = None  # a path kept from a tree: the rows of ``states`` after 0..T steps

    # what the write's cut and restores read, beside the state it began from
    INPUTS = ("conv_input", "q", "k", "v", "g", "beta")

    @property
    def inputs(self) -> tuple[mx.array, ...]:
        return tuple(getattr(self, name) for name in self.INPUTS)

    @property
    def steps(self) -> int:
        return self.q.shape[1]

    @property
    def cuttable(self) -> int:
        """The most steps a cut may keep: a tree's root alone until its path is kept."""
        return 1 if self.parents is not None else self.steps

    def kept(self, rows: PathRows) -> Write:
        """This tree's write as if only the path ``rows`` keeps (node indices
        from the root) was written: each node's inputs were made from its
        ancestors', so the path's, gathered, are a plain run's."""
        q, k, v, g, beta = (mx.take(a, rows.path, axis=1) for a in (self.q, self.k, self.v, self.g, self.beta))
        return Write(
            start=self.start,
            conv_input=mx.take(self.conv_input, rows.conv(self.conv_input.shape[1] - self.steps), axis=1),
            q=q,
            k=k,
            v=v,
            g=g,
            beta=beta,
            state0=self.state0,
            state=None,
            use_kernel=self.use_kernel,
            states=self.states,
            rows=rows.states if self.states is not None else None,
        )

    def _state_row(self, s) -> mx.array:
        """The kept state after ``s`` steps (an int, or an int32 array [1])."""
        row = s if self.rows is None else mx.take(self.rows, s)
        if isinstance(row, int):
            return self.states[row]
        return mx.take(self.states, row, axis=0).reshape(self.state0.shape)

    def after(self, s) -> tuple[mx.array, mx.array]:
        """(convolution state, recurrent state) after the first ``s`` steps
        (an int, or an int32 array of one element the host never reads)."""
        keep = self.conv_input.shape[1] - self.steps
        if isinstance(s, int):
            if s > self.cuttable:
                raise RuntimeError(f"a draft tree's write keeps its root alone until its path is kept, not {s} steps")
            conv = self.conv_input[:, s : s + keep]
            if s == 0:
                return conv, self.state0
            if s == self.steps and self.state is not None:
                return conv, self.state
            if self.states is not None:
                return conv, self._state_row(s)
            inputs = (self.q, self.k, self.v, self.g, self.beta)
            _, state = recurrence(*(a[:, :s] for a in inputs), self.state0, use_kernel=self.use_kernel)
            return conv, state
        if self.parents is not None:
            raise RuntimeError("a draft tree's write is cut after keep_path, which makes it its accepted path's")
        conv = mx.take(self.conv_input, s + constant_arange(keep), axis=1)
        if self.states is not None:
            return conv, self._state_row(s)
        _, state = recurrence(
            self.q, self.k, self.v, self.g, self.beta, self.state0, steps=s, use_kernel=self.use_kernel
        )
        return conv, state


class DeltaCache:
    """A gated delta-net layer's state at ``offset`` positions (``bound`` a
    host-side upper bound), with the last writes and a few checkpoints.

    In a compiled cycle (decode/cycle.py) the state goes in and comes back
    with the cycle's write, which the host keeps after each call (a replay
    runs none of this class's code): ``enter_trace``, ``traced_inputs``,
    ``set_traced``, ``traced_outputs``, ``take_outputs``, ``leave_trace``."""

    keep = 3
    checkpoints = 4
    # Longer writes (prefill chunks) keep only a checkpoint: their inputs cost more than a state.
    longest_write = 64
    rollback: str | None = None  # None: the cheapest exact one here (default_rollback)
    per_step_longest = 16
    tree: TreeLayout | None = None  # a draft tree's layout while a verify of one is built (kv/tree.py)
    traced_returns = 2 + len(Write.INPUTS)  # what a compiled cycle hands back (traced_outputs)
    use_kernel = True  # the last write's: outside training, the recurrence's kernel where there is one

    def __init__(self, rollback: str | None = None):
        if rollback is not None:
            if rollback not in ROLLBACKS:
                raise ValueError(f"unknown rollback {rollback!r}; choose one of: {', '.join(ROLLBACKS)}.")
            self.rollback = rollback
        self.conv: mx.array | None = None  # [1, K-1, C]
        self.ssm: mx.array | None = None  # [1, Hv, Dv, Dk]
        self.offset: int | mx.array = 0
        self.bound = 0
        self.floor = 0
        self.pending: Write | None = None  # the last write, not yet kept or cut
        self.writes: deque[Write] = deque(maxlen=self.keep)
        self.saved: list[tuple[int, mx.array | None, mx.array | None]] = [(0, None, None)]

    def forward(self, layer: nn.Module, x: mx.array) -> mx.array:
        """mlx-lm's GatedDeltaNet ``layer`` over x [1, T, H], run from its parts
        so the recurrence inputs are kept. While ``tree`` is set, x holds its
        nodes: each runs from its ancestors' convolution inputs and its
        parent's state, as a plain run over its root-to-node path would."""
        if self.pending is not None and self.ssm is None:  # (a tree's verify: no state until the cut)
            raise RuntimeError("a draft tree's verify must be kept (keep_path) and cut (set_length) before a write")
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
        tree = self.tree
        if tree is None:
            conv_out = nn.silu(layer.conv1d(conv_input))
        else:
            windows = tree_windows(conv_input, tree, layer.conv_kernel_size)
            conv_out = nn.silu(layer.conv1d(windows)).reshape(B, T, -1)
        q, k, v = [
            t.reshape(B, T, h, d)
            for t, h, d in zip(
                mx.split(conv_out, [layer.key_dim, 2 * layer.key_dim], -1),
                [layer.num_k_heads, layer.num_k_heads, layer.num_v_heads],
                [layer.head_k_dim, layer.head_k_dim, layer.head_v_dim],
            )
        ]
        q, k = normalize_qk(q, k, inv_scale=layer.head_k_dim**-0.5, eps=1e-6)
        beta, g = mx.sigmoid(b), compute_g(layer.A_log, a, layer.dt_bias)
        state0 = self.ssm if self.ssm is not None else mx.zeros((B, *v.shape[-2:], k.shape[-1]), mx.float32)
        use_kernel = self.use_kernel = not layer.training
        rollback = self.rollback or default_rollback(
            q, v, g, beta, state0, use_kernel=use_kernel, tree=tree is not None
        )
        states, state = None, None
        per_step = rollback == "per-step" and T <= self.per_step_longest
        if tree is not None:
            out, states = tree_recurrence(
                q, k, v, g, beta, state0, parents=tree.parents, keep_all=per_step, use_kernel=use_kernel
            )
        elif per_step:
            out, states, state = per_step_update(q, k, v, g, beta, state0, use_kernel=use_kernel)
        else:
            out, state = recurrence(q, k, v, g, beta, state0, use_kernel=use_kernel)
        if T <= self.longest_write or tree is not None:
            self.pending = Write(
                start=self.offset,
                conv_input=conv_input,
                q=q,
                k=k,
                v=v,
                g=g,
                beta=beta,
                state0=state0,
                state=state,
                use_kernel=use_kernel,
                states=states,
                parents=None if tree is None else tree.parents,
            )
        self.offset = self.offset + T
        self.bound += T
        # (a tree's state is its accepted path's: none until keep_path and the cut)
        self.conv, self.ssm = (conv_input[:, T:], state) if tree is None else (None, None)
        out = layer.norm(out, z)
        return layer.out_proj(out.reshape(B, T, -1))

    def keep_path(self, rows: PathRows) -> None:
        """After a tree's verify, make its write the accepted path's (``rows``:
        its [D+1] node indices, the root first), ready for the cut (set_length)."""
        if self.pending is None or self.pending.parents is None:
            raise RuntimeError("keep_path follows a draft tree's verify")
        self.pending = self.pending.kept(rows)

    def _settle_pending(self) -> None:
        """Keep the pending write whole."""
        if self.pending is not None:
            self.pending.states = None  # T states are too many to keep: an older write replays
            self.writes = deque([*self.writes, self.pending], maxlen=self.keep)  # (a new deque: see enter_trace)
            self.pending = None

    def set_length(self, length: int | mx.array, bound: int | None = None) -> None:
        """Keep the first ``length`` positions: an array cuts the pending write
        on the device; an int restores the exact state or raises LookupError."""
        if isinstance(length, int):
            if not self.restore(length):
                raise LookupError(f"no state kept at length {length}")
            return
        if isinstance(self.offset, int) and self.pending is None:
            self._checkpoint(self.offset, self.conv, self.ssm)
        if self.pending is not None:
            w = self.pending
            # A cycle's cut keeps at least its write's first step (the token it read last), so a
            # one-step write (a plain step's) is kept whole: forward left its end state in place.
            if w.steps > 1 or w.state is None:
                # (a [1] array: what the replay kernel reads; 16 bytes, as CUDA's kernels read small arrays best)
                s = mx.clip(mx.broadcast_to(length - w.start, (4,)), 0, w.steps)[:1]
                if s.dtype != mx.int32:
                    s = s.astype(mx.int32)
                self.conv, self.ssm = w.after(s)
            self._settle_pending()
        self.offset, self.bound = length, bound

    def enter_trace(self, length: mx.array, bound: int):
        """Before a compiled cycle at ``length``: the last write cut there (so
        the trace starts from a settled state at a device length, as every
        replay does), and the host state a trace changes, for ``leave_trace``."""
        if self.pending is not None or isinstance(self.offset, int):
            self.set_length(length, bound)
        return self.conv, self.ssm, self.offset, self.bound, self.writes

    def traced_inputs(self) -> list:
        return [self.conv, self.ssm]

    def set_traced(self, given) -> None:
        self.conv, self.ssm = next(given), next(given)

    def leave_trace(self, held) -> None:
        """The host state ``enter_trace`` returned (a trace left tracers here)."""
        self.conv, self.ssm, self.offset, self.bound, self.writes = held
        self.pending = None

    def traced_outputs(self) -> tuple:
        """At a compiled cycle's end: the state, then the cycle's write's
        recurrence inputs (its state before is the cycle's input)."""
        return self.conv, self.ssm, *self.writes[-1].inputs

    def take_outputs(self, outputs, start: mx.array) -> None:
        """After a compiled cycle from ``start`` (``leave_trace`` done): its
        ``traced_outputs`` as the state and the last write."""
        conv, ssm, *inputs = outputs
        inputs = dict(zip(Write.INPUTS, inputs))
        write = Write(start=start, **inputs, state0=self.ssm, state=None, use_kernel=self.use_kernel)
        self.writes = deque([*self.writes, write], maxlen=self.keep)
        self.conv, self.ssm = conv, ssm

    def restore(self, n: int) -> bool:
        """Make the state exactly the one after ``n`` positions; False if none is kept."""
        found = None
        if self.pending is None and _value(self.offset) == n:
            found = self.conv, self.ssm
        else:
            for w in ([self.pending] if self.pending is not None else []) + list(reversed(self.writes)):
                start = _value(w.start)
                if start <= n <= start + w.cuttable:
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
        """The longest length <= n restorable from checkpoints alone."""
        return max(m for m, _, _ in self.saved if m <= n)

    def _checkpoint(self, n: int, conv, state) -> None:
        self.saved = [t for t in self.saved if t[0] != n] + [(n, conv, state)]
        if len(self.saved) > self.checkpoints + 1:  # the empty state stays
            del self.saved[1]

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
