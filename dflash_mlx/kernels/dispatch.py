"""Choose the kernel or the fused op per call; check each kernel variant once.

A variant (backend, dtype, head dim, window kind; a block's or a draft
tree's) is used only after it has matched the ops path in this process, or
in an earlier one on this machine (passed_checks.py; a failure sends it to
the ops path for good, with one warning), and for a class
of shapes only where this machine measured it faster than MLX's fused
attention (decisions.py)."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import mlx.core as mx

from ..device import backend
from ..kv.tree import TreeLayout, from_parents
from . import decisions, passed_checks
from .attention import BlockAttentionKernel
from .attention_source import TREE_NODES
from .ops import DTYPES, HEAD_DIMS, check_inputs, ops_attention
from .serving import array_copies, check_once, failure, passed, timed_in_turn

# Where the kernel may serve, by query rows per key-value head: (most rows,
# fewest keys; None: never). The first entry whose rows cover the call
# decides; within it, this machine's measurement does (``serving_kernel``).
KERNEL_WINS = ((128, 0),)
# The classes of shapes measured: a call takes the decision of the smallest
# class that holds its rows per key-value head and its keys (the largest past them).
ROW_CLASSES = (4, 16, 64, 128)
KEY_CLASSES = (1024, 4096, 16384, 65536)
DECISION = "block attention"
TREE_DECISION = "tree attention"

TOLERANCE = {mx.float32: 2e-3, mx.float16: 4e-3, mx.bfloat16: 3e-2}

BUILDERS = {"metal": BlockAttentionKernel, "cuda": BlockAttentionKernel}


@dataclass
class CheckResult:
    backend: str
    dtype: str
    head_dim: int
    window: bool
    ok: bool
    detail: str
    tree: bool = False
    bit_equal: bool = False  # every output equal to the ops path's, bit for bit

    @property
    def case(self) -> str:
        kind = "sliding window" if self.window else "full"
        return f"{self.backend} {self.dtype} head_dim={self.head_dim} {kind}" + (" tree" if self.tree else "")


_kernels: dict[str, object] = {}
_checks: dict[tuple, CheckResult] = {}
_tree_checks: dict[tuple, CheckResult] = {}  # the tree variants', keyed as _checks


def reset() -> None:
    """Forget built kernels and check results (tests, or after changing BUILDERS)."""
    _kernels.clear()
    _checks.clear()
    _tree_checks.clear()


def block_attention(queries, keys, values, *, scale, q_offset, kv_length, causal, window=None, sinks=None):
    """Attention of a block of query rows over a fixed-capacity K/V buffer.

    queries [B, Hq, L, D]; keys, values [B, Hkv, N, D]. Query row i sits at
    q_offset + i, key j at j; keys at j >= kv_length are never attended.
    causal: j <= q_offset + i. window: |q_offset + i - j| < window (the
    future side only when not causal). sinks: per-query-head logits [Hq].
    q_offset and kv_length may be ints or one-element int arrays (never read back).
    """
    check_inputs(queries, keys, values, q_offset, kv_length, window=window, sinks=sinks)
    kw = dict(scale=scale, q_offset=q_offset, kv_length=kv_length, causal=causal, window=window, sinks=sinks)
    where = backend()
    keys_hint = kv_length if isinstance(kv_length, int) else keys.shape[2]
    rows = queries.shape[1] // keys.shape[1] * queries.shape[2]
    if where != "cpu" and kernel_wins(rows, keys_hint, where):
        checked_kernel(where, queries.dtype, queries.shape[3], window is not None)
    kernel = serving_kernel(where, queries.dtype, queries.shape[3], window is not None, rows=rows, keys=keys_hint)
    if kernel is None:
        return ops_attention(queries, keys, values, **kw)
    return kernel(queries, keys, values, **kw)


def tree_attention(queries, keys, values, *, scale, q_offset, kv_length, tree: TreeLayout, window=None, sinks=None):
    """Attention of a draft tree's nodes (kv/tree.py) over a fixed-capacity
    K/V buffer: query row i is node i, its key written at q_offset + i; it sits
    at position q_offset + depth i and sees the keys before q_offset (window:
    measured from its position) and its ancestors' keys. The tree kernel
    where its variant passed its check and measured faster here, else MLX's
    attention with the tree's mask."""
    check_tree_inputs(queries, keys, values, q_offset, kv_length, tree=tree, window=window, sinks=sinks)
    kw = dict(scale=scale, q_offset=q_offset, kv_length=kv_length, window=window, sinks=sinks, tree=tree)
    where = backend()
    keys_hint = kv_length if isinstance(kv_length, int) else keys.shape[2]
    rows = queries.shape[1] // keys.shape[1] * queries.shape[2]
    windowed = window is not None
    if where != "cpu" and kernel_wins(rows, keys_hint, where):
        checked_kernel(where, queries.dtype, queries.shape[3], windowed, tree=True)
    kernel = serving_kernel(where, queries.dtype, queries.shape[3], windowed, rows=rows, keys=keys_hint, tree=True)
    if kernel is None:
        return ops_tree_attention(queries, keys, values, **kw)
    return kernel(queries, keys, values, causal=True, **kw)


def check_tree_inputs(queries, keys, values, q_offset, kv_length, *, tree, window, sinks) -> None:
    """Raise ValueError (one sentence) for inputs outside tree_attention's contract."""
    check_inputs(queries, keys, values, q_offset, kv_length, window=window, sinks=sinks)
    if not isinstance(tree, TreeLayout):
        raise ValueError("tree_attention: tree must be a TreeLayout (dflash_mlx.kv.tree).")
    if tree.size != queries.shape[2] or tree.size > TREE_NODES:
        raise ValueError(
            f"tree_attention: a tree of at most {TREE_NODES} nodes needs one query row a node, "
            f"got {tree.size} nodes and {queries.shape[2]} rows."
        )


def ops_tree_attention(queries, keys, values, *, scale, q_offset, kv_length, tree, window=None, sinks=None):
    """mx.fast.scaled_dot_product_attention over the whole buffer with the tree's mask (kv/tree.py)."""
    n = keys.shape[2]
    mask = tree.mask(_scalar(q_offset), n, window) & (mx.arange(n) < _scalar(kv_length))
    if sinks is not None:
        sinks = sinks.astype(queries.dtype)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)


def _scalar(x):
    return x.reshape(()).astype(mx.int32) if isinstance(x, mx.array) else x


def kernel_wins(rows_per_kv_head: int, keys: int, where: str = "cuda") -> bool:
    """Whether KERNEL_WINS lets the kernel serve the call (``where``: kept for callers)."""
    for most_rows, fewest_keys in KERNEL_WINS:
        if rows_per_kv_head <= most_rows:
            return fewest_keys is not None and keys >= fewest_keys
    return False


def shape_class(rows_per_kv_head: int, keys: int) -> tuple[int, int]:
    """The measured class (rows, keys) whose decision a call takes."""
    rows = next((r for r in ROW_CLASSES if rows_per_kv_head <= r), ROW_CLASSES[-1])
    return rows, next((k for k in KEY_CLASSES if keys <= k), KEY_CLASSES[-1])


def decision_case(dtype, head_dim: int, windowed: bool, rows: int, keys: int) -> str:
    kind = "window" if windowed else "full"
    return f"{str(dtype).split('.')[-1]} d{head_dim} {kind} rows<={rows} keys<={keys}"


def serving_kernel(where: str, dtype, head_dim: int, windowed: bool, *, rows: int, keys: int, tree: bool = False):
    """The kernel for a call of ``rows`` per key-value head over ``keys`` (a
    draft tree's, ``tree``): where the table lets it, its variant passed its
    check and this machine measured its shape class faster; else None. Never
    checks or measures (safe in a trace)."""
    if where == "cpu" or not kernel_wins(rows, keys, where):
        return None
    kernel = passed_kernel(where, dtype, head_dim, windowed, tree=tree)
    if kernel is None or not decisions.current().uses(
        TREE_DECISION if tree else DECISION, decision_case(dtype, head_dim, windowed, *shape_class(rows, keys))
    ):
        return None
    return kernel


def measure(where: str, dtype, head_dim: int, window: int | None, tree: bool = False) -> list[decisions.Decision]:
    """Decide every shape class the table admits for a checked variant (a
    draft tree's, ``tree``), measuring those this machine has not (outside
    compiled traces); the decisions made."""
    kernel = checked_kernel(where, dtype, head_dim, window is not None, tree=tree)
    if kernel is None:
        return []
    store, made, name = decisions.current(), [], TREE_DECISION if tree else DECISION
    for rows in ROW_CLASSES:
        for keys in KEY_CLASSES:
            if not kernel_wins(rows, keys, where):
                continue
            case = decision_case(dtype, head_dim, window is not None, rows, keys)
            if store.needs(name, case):  # (the pair's buffers are made only to be timed)
                timed = _timed_tree_pair if tree else _timed_pair
                store.decide(name, case, *timed(kernel, dtype, head_dim, window, rows=rows, keys=keys))
                mx.clear_cache()  # (the copies' memory back, not kept in MLX's buffer cache)
            made.append(store.known.get((name, case)))
    return [d for d in made if d is not None]


def _timed_inputs(dtype, head_dim: int, *, rows: int, keys: int):
    """A verify's queries, keys and values at a class's shape: 8 key-value
    heads at GQA 4, the rows' queries at the end of ``keys`` valid keys."""
    kv_heads, gqa = 8, 4
    length = max(1, rows // gqa)
    q = mx.random.normal((1, kv_heads * gqa, length, head_dim)).astype(dtype)
    k = mx.random.normal((1, kv_heads, keys, head_dim)).astype(dtype)
    v = mx.random.normal((1, kv_heads, keys, head_dim)).astype(dtype)
    return q, k, v, length


def _timed_pair(kernel, dtype, head_dim: int, window: int | None, *, rows: int, keys: int):
    """(ours, MLX's) at a verify's shape of the class (``_timed_inputs``)."""
    q, k, v, length = _timed_inputs(dtype, head_dim, rows=rows, keys=keys)
    scale = head_dim**-0.5
    position = mx.arange(keys - length, keys)[:, None]
    seen = mx.arange(keys)[None] <= position
    if window is not None:
        seen = seen & (position - mx.arange(keys)[None] < window)
    mx.eval(q, k, v, seen)
    kw = dict(scale=scale, q_offset=mx.array(keys - length), kv_length=mx.array(keys), causal=True, window=window)
    return timed_in_turn(
        lambda kv: kernel(q, *kv, **kw),
        lambda kv: mx.fast.scaled_dot_product_attention(q, *kv, scale=scale, mask=seen),
        array_copies(k, v),
    )


def _timed_tree_pair(kernel, dtype, head_dim: int, window: int | None, *, rows: int, keys: int):
    """(ours, MLX's with the tree's mask) for a binary tree of the class's
    rows at a verify's shape (``_timed_inputs``)."""
    q, k, v, nodes = _timed_inputs(dtype, head_dim, rows=rows, keys=keys)
    tree = from_parents(mx.maximum(mx.arange(nodes) - 1, 0) // 2, max_depth=nodes)
    start = keys - nodes
    scale = head_dim**-0.5
    seen = tree.mask(start, keys, window)
    mx.eval(q, k, v, seen, tree.ancestors, tree.depths)
    kw = dict(scale=scale, q_offset=mx.array(start), kv_length=mx.array(keys), causal=True, window=window, tree=tree)
    return timed_in_turn(
        lambda kv: kernel(q, *kv, **kw),
        lambda kv: mx.fast.scaled_dot_product_attention(q, *kv, scale=scale, mask=seen),
        array_copies(k, v),
    )


def passed_kernel(where: str, dtype, head_dim: int, windowed: bool, tree: bool = False):
    """The kernel if this variant already passed its check, else None; never checks."""
    checks = _tree_checks if tree else _checks
    return _kernels.get(where) if passed(checks, (where, dtype, head_dim, windowed)) else None


def checked_kernel(where: str, dtype, head_dim: int, windowed: bool, tree: bool = False):
    """The backend's kernel if this variant (a draft tree's, ``tree``) passed its self-check, else None."""
    result = check_once(
        _tree_checks if tree else _checks,
        (where, dtype, head_dim, windowed),
        lambda: self_check(where, dtype, head_dim, windowed, tree=tree),
        lambda r: (
            f"dflash_mlx: the {r.case} block-attention kernel failed its self-check ({r.detail}); "
            "using mx.fast.scaled_dot_product_attention for it instead."
        ),
        kernel=TREE_DECISION if tree else DECISION,
    )
    return _kernels.get(where) if result.ok else None


def self_check(where: str, dtype, head_dim: int, windowed: bool, tree: bool = False) -> CheckResult:
    """Run the kernel on small random cases against the ops path (with a draft tree's mask, ``tree``)."""

    def outputs(kernel):
        for q, k, v, kw in _check_cases(dtype, head_dim, windowed):
            yield kernel(q, k, v, **kw), ops_attention(q, k, v, **kw)

    def tree_outputs(kernel):
        for q, k, v, kw in _tree_check_cases(dtype, head_dim, windowed):
            yield kernel(q, k, v, causal=True, **kw), ops_tree_attention(q, k, v, **kw)

    result = compare_with_ops(
        where,
        dtype,
        head_dim,
        windowed,
        kernels=_kernels,
        builders=BUILDERS,
        outputs=tree_outputs if tree else outputs,
    )
    return replace(result, tree=tree)


def compare_with_ops(
    where: str, dtype, head_dim: int, windowed: bool, *, kernels: dict, builders: dict, outputs
) -> CheckResult:
    """Self-check: every (kernel, ops) pair from ``outputs(kernel)`` agrees within
    TOLERANCE of the largest element; a build or launch error fails it, named.
    Inside serving.check_once a pass remembered on this machine stands for it."""
    name = str(dtype).split(".")[-1]

    def check() -> CheckResult:
        try:
            kernel = kernels.get(where)
            if kernel is None:
                kernel = kernels[where] = builders[where](where)
            worst, bit_equal = 0.0, True
            for got, want in outputs(kernel):
                got, want = got.astype(mx.float32), want.astype(mx.float32)
                if got.shape != want.shape:
                    return CheckResult(
                        where, name, head_dim, windowed, False, f"output shape {got.shape} != {want.shape}"
                    )
                bit_equal = bit_equal and mx.array_equal(got, want).item()
                err = (mx.abs(got - want).max() / (mx.abs(want).max() + 1e-6)).item()
                if not err == err:  # NaN
                    err = float("inf")
                worst = max(worst, err)
            ok = worst <= TOLERANCE[dtype]
            detail = f"max relative error {worst:.1e}" + ("" if ok else f" > {TOLERANCE[dtype]:.0e}")
            return CheckResult(where, name, head_dim, windowed, ok, detail, bit_equal=ok and bit_equal)
        except Exception as e:  # a build or launch error: the kernel is not used
            return CheckResult(where, name, head_dim, windowed, False, failure(e))

    def restore(fields: dict) -> CheckResult | None:
        return remembered_pass(fields, where, name, head_dim, windowed)

    return passed_checks.checked(where, (kernels, builders), check, passed_checks.fields_of, restore)


def remembered_pass(fields: dict, where: str, dtype: str, head_dim: int, windowed: bool) -> CheckResult | None:
    """The CheckResult of a pass kept as ``fields``, if it is one of this variant's."""
    result = passed_checks.rebuilt(CheckResult, fields)
    variant = (where, dtype, head_dim, windowed)
    fits = result is not None and (result.backend, result.dtype, result.head_dim, result.window) == variant
    return result if fits and result.ok else None


def _check_cases(dtype, head_dim: int, windowed: bool):
    """Verify-like and drafter-like cases over a partly filled buffer, then more rows, then one key chunk."""
    key = mx.random.key(head_dim)
    kq, kk, kv, ks = mx.random.split(key, 4)
    n, lq = 640, 7
    q = mx.random.normal((1, lq, 4, head_dim), key=kq).astype(dtype).transpose(0, 2, 1, 3)
    k = mx.random.normal((1, 2, n, head_dim), key=kk).astype(dtype)
    v = mx.random.normal((1, 2, n, head_dim), key=kv).astype(dtype)
    sinks = mx.random.normal((4,), key=ks)
    window = 45 if windowed else None
    scale = head_dim**-0.5
    yield q, k, v, dict(scale=scale, q_offset=mx.array(500), kv_length=mx.array(500 + lq), causal=True, window=window)
    yield (
        mx.contiguous(q),
        k,
        v,
        dict(scale=scale, q_offset=300, kv_length=300 + lq, causal=False, window=window, sinks=sinks),
    )
    yield (
        q,
        k,
        v,
        dict(
            scale=scale, q_offset=mx.array(200), kv_length=mx.array(200 + lq), causal=True, window=window, sinks=sinks
        ),
    )
    # 24 and 40 rows per kv head: the matrix-unit pass's two- and four-warp threadgroups
    for rows in (12, 20):
        qr = mx.random.normal((1, 4, rows, head_dim), key=kq).astype(dtype)
        yield (
            qr,
            k,
            v,
            dict(scale=scale, q_offset=mx.array(600), kv_length=mx.array(600 + rows), causal=True, window=window),
        )
    # one key chunk: on CUDA the matrix-unit pass writes the output itself, with no merge
    one = k[:, :, :256], v[:, :, :256]
    yield q, *one, dict(scale=scale, q_offset=mx.array(180), kv_length=mx.array(180 + lq), causal=True, window=window)
    yield mx.contiguous(q), *one, dict(scale=scale, q_offset=200, kv_length=200 + lq, causal=False, window=window)


def check_tree(nodes: int, seed: int) -> TreeLayout:
    """A random tree of ``nodes``: a chain through three quarters of them (deep
    enough to outreach a check's window), the rest branching off anywhere."""
    rng = random.Random(seed)
    trunk = nodes * 3 // 4 + 1
    parents = [max(i - 1, 0) if i < trunk else rng.randrange(i) for i in range(nodes)]
    return from_parents(mx.array(parents, dtype=mx.int32), max_depth=nodes)


def _tree_check_cases(dtype, head_dim: int, windowed: bool):
    """Trees over a partly filled buffer: 7 nodes, 60 (two words of ancestors a
    row, rows in two threadgroups of the matrix-unit pass), with sinks, and
    over one key chunk; keywords for the kernel but ``causal``."""
    key = mx.random.key(head_dim + 1)
    kq, kk, kv, ks = mx.random.split(key, 4)
    k = mx.random.normal((1, 2, 640, head_dim), key=kk).astype(dtype)
    v = mx.random.normal((1, 2, 640, head_dim), key=kv).astype(dtype)
    sinks = mx.random.normal((4,), key=ks)
    window = 45 if windowed else None
    scale = head_dim**-0.5
    for nodes, start, keys, sink in (
        (7, 500, 640, None),
        (60, 520, 640, None),
        (60, 400, 640, sinks),
        (7, 180, 256, None),
    ):
        q = mx.random.normal((1, nodes, 4, head_dim), key=kq).astype(dtype).transpose(0, 2, 1, 3)
        kw = dict(scale=scale, q_offset=mx.array(start), kv_length=mx.array(start + nodes), window=window, sinks=sink)
        yield q, k[:, :, :keys], v[:, :, :keys], dict(kw, tree=check_tree(nodes, seed=nodes + start))


def self_check_all(dtypes=DTYPES, head_dims=HEAD_DIMS, report=None) -> list[CheckResult]:
    """Check every variant on this backend (for `dflash-mlx doctor`); [] on the CPU."""
    where = backend()
    if where == "cpu":
        return []
    for dtype in dtypes:
        for d in head_dims:
            for windowed in (False, True):
                checked_kernel(where, dtype, d, windowed)
                if report is not None:
                    report(_checks[(where, dtype, d, windowed)])
    return [r for (w, *_), r in _checks.items() if w == where]
