"""A verify's exact attention: 2-16 causal query rows over a cache's keys, each
row bit for bit what MLX's one-row attention computes for it alone (Metal, CUDA).

A plain step attends one row over the filled keys with
``mx.fast.scaled_dot_product_attention``, which runs MLX's one-row kernels
(Metal's ``sdpa_vector`` or ``sdpa_vector_2pass``, CUDA's ``sdpav``); a
verify's rows take another kernel and another summation order, so at a
near-tie a greedy verify could pick another token than the plain step. This
kernel (exact_attention_source.py, which names the orders it follows) computes
each row as that one-row call over keys 0..its position does, the rows of a
KV head reading each key together.

Which (dtype, head dim) a machine serves with it is decided once, outside
compiled traces (``prepare``): the rows must equal MLX's one-row attention of
each row alone, bit for bit, on random cases either side of MLX's one-pass /
two-pass switch; a failure keeps MLX's attention, with one warning. A checked
variant serves on Metal wherever it passed, exactness first, and elsewhere only
where this machine measured it faster than MLX's attention of the block
(decisions.serves_exact). Not served: sinks, windows, and keys where MLX's
one-row call takes a kernel whose order is not followed (on CUDA the 2-pass
kernel past 1024 keys and cuDNN from 256 keys of a cache's buffer, there the
check fails). The CPU never runs it.

A draft tree's verify (kv/tree.py) takes the tree variants (``tree_attention``):
a node at depth d is computed as the one-row call of the plain step that
would produce its token, over the context and then its ancestors at depths
0..d in order (written at scattered rows of the buffer, read through a table
of their node indices); checked and decided apart from the block's.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..device import backend, device_info
from ..kv.tree import TreeLayout, from_parents
from . import decisions
from .attention import make_factory
from .exact_attention_source import (
    ARCH,
    GQA_INPUTS,
    GQA_OUTPUTS,
    MERGE_INPUTS,
    MERGE_OUTPUTS,
    ONE_PASS_INPUTS,
    ONE_PASS_OUTPUTS,
    PARTIAL_INPUTS,
    PARTIAL_OUTPUTS,
    TREE_INPUTS,
    VERSION,
    gqa_source,
    merge_source,
    one_pass_source,
    partial_source,
)
from .exact_attention_source import HEADER as HEADERS
from .launch_source import compacting
from .serving import array_copies, check_once, checked_here, first_exact, passed, timed_in_turn

DTYPES = (mx.bfloat16, mx.float16, mx.float32)
HEAD_DIMS = {"metal": (64, 128, 256), "cuda": (64, 128)}
FEWEST_ROWS, MOST_ROWS = 2, 16
MOST_TREE_NODES = 64
# Simdgroups a two-pass partial threadgroup holds (one a row; a KV head's rows in tiles of the least that fits).
ROW_TILES = (4, 8, 16, 32)
MERGE_WARPS = 4
# Rows a one-pass threadgroup of 1024 threads (MLX's 32 streams) takes at once, by
# backend and head dim: a lane keeps each row's query and output (2 x D/32 floats)
# in registers, and 1024 threads leave a CUDA thread 64 registers (MLX's kernel: one row).
ONE_PASS_ROWS = {"metal": {64: 4, 128: 2, 256: 1}, "cuda": {64: 1, 128: 1}}
# The multiply-add forms a backend's check tries, in order (exact_attention_source: FORM).
FORMS = {"metal": (0, 1, 2), "cuda": (0, 2)}
# Keys past which MLX's one-row call leaves the order followed here.
# CUDA: MLX's one-pass kernel; from 256 keys of a cache's buffer (steps of 256) a one-row call
# takes cuDNN, past 1024 MLX's 2-pass kernel.
CUDA_MOST_KEYS = 255
GQA_TWO_PASS_KEYS = 4096  # Metal: under GQA, two passes from this many keys on any device
GQA_KERNEL_KEYS = 8192  # Metal's sdpa_vector_2pass_1_gqa, from this many keys
# (GQA factor, head dim) -> heads a simdgroup of sdpa_vector_2pass_1_gqa takes (MLX's instantiations).
GQA_HEADS = {(8, 64): 8, (8, 128): 4, (12, 128): 4, (16, 128): 2}
DECISION = "exact verify attention"
TREE_DECISION = "exact tree verify attention"
decisions.EXACT_KERNELS.update((DECISION, TREE_DECISION))
KEY_CLASSES = (1024, 4096, 16384, 65536)
MEASURED_ROWS, MEASURED_KV_HEADS, MEASURED_GQA = 16, 8, 4


@functools.cache
def arch_code(backend_name: str) -> int:
    """The Metal architecture's code for the kernels (its name's last letter, MLX's
    ``devc``: 's' 1, 'd' 2, any other 0); 0 on CUDA."""
    if backend_name != "metal":
        return 0
    return ARCH.get(str(device_info().get("architecture", ""))[-1:], 0)


def blocks(backend_name: str, arch: int, n: int, g: int) -> int:
    """The 2-pass block count of MLX's one-row call over ``n`` keys at GQA ``g``,
    or 0 where it takes the one-pass kernel (exact_attention_source: RULES)."""
    if backend_name != "metal" or not ((arch in (1, 2) and n >= 1024) or (g > 1 and n >= GQA_TWO_PASS_KEYS)):
        return 0
    if arch == 1:
        if n > 1024 and g > 4:
            return 128 if n <= 8192 else 256 if n <= 32768 else 512 if n <= 65536 else 1024
        return 64
    if arch == 2:
        if g <= 2 and n > 8192:
            return 256
        if g >= 6:
            return 1024 if n >= 65536 else 512 if n >= 16384 else 128
        return 128
    return 64 if g >= 4 else 32


def most_keys(backend_name: str) -> int | None:
    """The most keys a row may read and keep MLX's one-row order here (None: any)."""
    return CUDA_MOST_KEYS if backend_name == "cuda" else None


def gqa_kernel(backend_name: str, n: int, g: int, d: int) -> bool:
    """Whether MLX's one-row call over ``n`` keys takes Metal's ``sdpa_vector_2pass_1_gqa``."""
    return backend_name == "metal" and n >= GQA_KERNEL_KEYS and (g, d) in GQA_HEADS


def q_scale(backend_name: str, scale: float) -> float:
    """What q is multiplied by: Metal's ``float(scale)``; CUDA's ``scale * M_LOG2E``
    (a double product, then float)."""
    if backend_name == "cuda":
        return float(np.float32(np.float64(np.float32(scale)) * np.float64(1.4426950408889634074)))
    return float(np.float32(scale))


def row_tile(rows: int) -> int:
    return next((t for t in ROW_TILES if rows <= t), ROW_TILES[-1])


def ancestor_table(tree: TreeLayout) -> tuple[mx.array, mx.array]:
    """A tree's (depths [N], ancestors [N, N]) as the tree variants read them:
    ancestors[i, j] the node index of node i's ancestor at depth j (j = its
    depth: node i itself; past it: 0, never read). Device ops, no host sync."""
    n = tree.size
    nodes = mx.arange(n, dtype=mx.int32)
    at_depth = tree.ancestors[:, None, :] & (tree.depths[None, None, :] == nodes[None, :, None])  # [i, j, node]
    # (at most one node a depth: the sum is its index; plain integer ops every backend has)
    return tree.depths.astype(mx.int32), (at_depth * nodes).sum(axis=-1).astype(mx.int32)


class ExactAttentionKernel:
    """The one-pass kernel and the two-pass kernels (MLX's GQA one too) for one
    backend, a block's and a draft tree's, compiled by MLX per (T, D, FORM, tile)."""

    def __init__(self, backend_name: str, factory=None):
        self.backend = backend_name
        factory = compacting(factory or make_factory(backend_name), backend_name)
        self.launches = {tree: self._kernels(factory, tree) for tree in (False, True)}
        self._constants: dict[tuple, tuple[mx.array, mx.array]] = {}  # (L, G, S, arch, scale, W) -> (dims, params)
        self._table: tuple[TreeLayout, tuple[mx.array, mx.array]] | None = None

    def _kernels(self, factory, tree: bool) -> dict:
        header, name = HEADERS[self.backend], "tree_" if tree else ""
        extra = TREE_INPUTS if tree else []

        def make(kind, inputs, outputs, source, **kw):
            # (the version in the name: MLX caches built kernels on disk by name, not by source)
            return factory(
                name=f"dflash_exact_attn_{name}{kind}_v{VERSION}",
                input_names=inputs,
                output_names=outputs,
                source=source(self.backend, tree),
                header=header,
                **kw,
            )

        return {
            "one_pass": make(
                "one_pass", ONE_PASS_INPUTS + extra, ONE_PASS_OUTPUTS, one_pass_source, ensure_row_contiguous=False
            ),
            "gqa": make("gqa", GQA_INPUTS + extra, GQA_OUTPUTS, gqa_source, ensure_row_contiguous=False),
            "partial": make(
                "partial", PARTIAL_INPUTS + extra, PARTIAL_OUTPUTS, partial_source, ensure_row_contiguous=False
            ),
            "merge": make("merge", MERGE_INPUTS + extra[:1], MERGE_OUTPUTS, merge_source),
        }

    def constants(self, rows: int, g: int, streams: int, arch: int, scale: float, width: int = 0):
        """The launch's dims and q scale, made once per shape (a verify's layers share them)."""
        key = (rows, g, streams, arch, scale, width)
        if key not in self._constants:
            dims = mx.array([rows, g, streams, arch] + ([width] if width else []), dtype=mx.int32)
            params = mx.array([q_scale(self.backend, scale)], dtype=mx.float32)
            self._constants[key] = dims, params
        return self._constants[key]

    def tree_inputs(self, tree: TreeLayout) -> tuple[mx.array, mx.array]:
        """``ancestor_table(tree)``, made once for a verify's layers (the same TreeLayout)."""
        if self._table is None or self._table[0] is not tree:
            self._table = tree, ancestor_table(tree)
        return self._table[1]

    def __call__(
        self, queries, keys, values, *, scale: float, q_offset, arch: int = 0, form: int = 0, tree=None
    ) -> mx.array:
        """queries [B, HQ, L, D] at positions q_offset .. q_offset + L - 1 over
        keys, values [B, HKV, N, D] holding at least q_offset + L keys: [B, HQ, L, D].
        ``tree``: the rows are a draft tree's L nodes written there, as
        ``(depths, ancestors)`` (ancestor_table). The rows MLX's one-pass kernel
        takes run in one launch; where a row of N keys could take its two-pass
        kernels, two more launches run those (three where it could take the GQA one)."""
        B, HQ, L, D = queries.shape
        HKV = keys.shape[1]
        g = HQ // HKV
        streams = blocks(self.backend, arch, keys.shape[2], g)  # (the most any row takes)
        rows = g * L
        offset = q_offset if isinstance(q_offset, mx.array) else mx.array(q_offset)
        offset = offset.reshape((1,)).astype(mx.int32)
        width = 0 if tree is None else tree[1].shape[1]
        dims, params = self.constants(L, g, streams, arch, scale, width)
        extra = [] if tree is None else list(tree)
        inputs = [queries, keys, values, offset, params, dims, *extra]
        kernels = self.launches[tree is not None]
        tile = ONE_PASS_ROWS[self.backend][D]
        (first,) = kernels["one_pass"](
            inputs=inputs,
            template=[("T", queries.dtype), ("D", D), ("FORM", form), ("RT", tile)],
            grid=(-(-rows // tile) * 1024, B * HKV, 1),
            threadgroup=(1024, 1, 1),
            output_shapes=[(B * HQ * L, D)],
            output_dtypes=[queries.dtype],
        )
        if streams == 0:
            return first.reshape(B, HQ, L, D)
        tile = row_tile(rows)
        tiles = -(-rows // tile)
        part_shapes = [(B * HQ * L, streams, D), (B * HQ * L, streams), (B * HQ * L, streams)]
        parts = kernels["partial"](
            inputs=inputs,
            template=[("T", queries.dtype), ("D", D), ("FORM", form), ("NW", tile)],
            grid=(streams * tiles * tile * 32, B * HKV, 1),
            threadgroup=(tile * 32, 1, 1),
            output_shapes=part_shapes,
            output_dtypes=[queries.dtype, mx.float32, mx.float32],
        )
        gqa_parts = parts  # (read only for rows the GQA kernel takes)
        if gqa_kernel(self.backend, keys.shape[2], g, D):
            gqa_parts = kernels["gqa"](
                inputs=inputs,
                template=[("T", queries.dtype), ("D", D), ("FORM", form), ("GQ", g), ("HPT", GQA_HEADS[(g, D)])],
                grid=(streams * L * g * 32, B * HKV, 1),
                threadgroup=(g * 32, 1, 1),
                output_shapes=part_shapes,
                output_dtypes=[queries.dtype, mx.float32, mx.float32],
            )
        (out,) = kernels["merge"](
            inputs=[*parts, *gqa_parts, offset, dims, first, *extra[:1]],
            template=[("T", queries.dtype), ("D", D), ("FORM", form), ("MW", MERGE_WARPS)],
            grid=(B * HQ * L * MERGE_WARPS * 32, 1, 1),
            threadgroup=(MERGE_WARPS * 32, 1, 1),
            output_shapes=[(B * HQ * L, D)],
            output_dtypes=[queries.dtype],
        )
        return out.reshape(B, HQ, L, D)


@dataclass
class ExactAttentionCheck:
    backend: str
    dtype: str
    head_dim: int
    ok: bool
    detail: str
    form: int = 0
    tree: bool = False

    @property
    def case(self) -> str:
        return f"{self.backend} {self.dtype} head_dim={self.head_dim}" + (" tree" if self.tree else "")


BUILDERS = {"metal": ExactAttentionKernel, "cuda": ExactAttentionKernel}
_kernels: dict[str, ExactAttentionKernel] = {}
_checks: dict[tuple, ExactAttentionCheck] = {}


def reset() -> None:
    _kernels.clear()
    _checks.clear()


def checked(where: str, dtype, head_dim: int, tree: bool = False) -> ExactAttentionCheck:
    """The variant's self-check on backend ``where`` (``tree``: the draft tree
    variant), run once (warning once where it fails)."""
    return check_once(
        _checks,
        (where, dtype, head_dim, tree),
        lambda: self_check(where, dtype, head_dim, tree),
        lambda r: (
            f"dflash_mlx: the {r.case} exact verify attention failed its self-check ({r.detail}); "
            "using MLX's attention for it instead."
        ),
        kernel=TREE_DECISION if tree else DECISION,
    )


def decision_case(dtype, head_dim: int, keys: int) -> str:
    width = next((k for k in KEY_CLASSES if keys <= k), KEY_CLASSES[-1])
    return f"{str(dtype).split('.')[-1]} d{head_dim} rows={MEASURED_ROWS} keys<={width}"


def prepare(dtype, head_dim: int, trees: bool = False) -> None:
    """Check the (dtype, head dim) variant once (``trees``: the draft tree
    variant too) and time each key class it may serve against MLX's attention
    of a verify block (a tree: with its mask) once a machine; call it outside
    compiled traces."""
    where = backend()
    if where not in BUILDERS or dtype not in DTYPES or head_dim not in HEAD_DIMS[where]:
        return
    store = decisions.current()
    limit = most_keys(where)
    for tree in (False, True) if trees else (False,):
        if not checked(where, dtype, head_dim, tree).ok:
            continue
        for keys in KEY_CLASSES:
            if limit is not None and keys > limit + 1:
                break
            case, name = decision_case(dtype, head_dim, keys), TREE_DECISION if tree else DECISION
            if store.needs(name, case):
                store.decide(name, case, *_timed_pair(where, dtype, head_dim, keys, tree))
                mx.clear_cache()  # (the copies' memory back, not kept in MLX's buffer cache)


def _timed_pair(where: str, dtype, head_dim: int, keys: int, tree: bool):
    """(ours, MLX's attention of the block with its causal mask, or of a random
    tree with the tree's mask) at a verify's shape."""
    heads = MEASURED_KV_HEADS * MEASURED_GQA
    q = mx.random.normal((1, heads, MEASURED_ROWS, head_dim)).astype(dtype)
    k = mx.random.normal((1, MEASURED_KV_HEADS, keys, head_dim)).astype(dtype)
    v = mx.random.normal((1, MEASURED_KV_HEADS, keys, head_dim)).astype(dtype)
    start = keys - MEASURED_ROWS
    layout = random_tree(MEASURED_ROWS, seed=keys) if tree else None
    seen = layout.mask(start, keys) if tree else mx.arange(keys)[None] <= mx.arange(start, keys)[:, None]
    offset = mx.array(start)
    scale = head_dim**-0.5
    mx.eval(q, k, v, seen, offset)
    kernel, arch, form = _kernels[where], arch_code(where), _checks[(where, dtype, head_dim, tree)].form
    table = kernel.tree_inputs(layout) if tree else None
    return timed_in_turn(
        lambda kv: kernel(q, *kv, scale=scale, q_offset=offset, arch=arch, form=form, tree=table),
        lambda kv: mx.fast.scaled_dot_product_attention(q, *kv, scale=scale, mask=seen),
        array_copies(k, v),
    )


def serves(where: str, queries, keys, tree: bool = False, filled: int | None = None) -> bool:
    """Whether the kernel takes this verify's attention here: one sequence (a
    plain step's is one), a checked variant, 2-16 rows (a tree: 2-64 nodes),
    keys within the order followed (``filled``: a host bound on the keys any
    row reads, where the buffer is wider), and a key class measured faster;
    never checks or measures (safe in a trace)."""
    B, HQ, L, D = queries.shape
    most = MOST_TREE_NODES if tree else MOST_ROWS
    if where not in BUILDERS or B != 1 or not FEWEST_ROWS <= L <= most or HQ % keys.shape[1]:
        return False
    if queries.dtype != keys.dtype or not passed(_checks, (where, queries.dtype, D, tree)):
        return False
    limit = most_keys(where)
    if limit is not None and min(keys.shape[2], filled or keys.shape[2]) > limit:
        return False
    case = decision_case(queries.dtype, D, keys.shape[2])
    return decisions.current().serves_exact(TREE_DECISION if tree else DECISION, case, where)


def attention(queries, keys, values, *, scale: float, q_offset, filled: int | None = None) -> mx.array | None:
    """The causal attention of a verify's rows written at ``q_offset`` over the
    cache's buffers (``keys`` holding at least q_offset + L; ``filled``: a host
    bound on q_offset + L): [B, HQ, L, D] through the kernel where it serves
    here, else None (MLX's attention runs)."""
    where = backend()
    if not serves(where, queries, keys, filled=filled):
        return None
    form = _checks[(where, queries.dtype, queries.shape[3], False)].form
    return _kernels[where](queries, keys, values, scale=scale, q_offset=q_offset, arch=arch_code(where), form=form)


def tree_attention(
    queries, keys, values, *, scale: float, q_offset, tree: TreeLayout, filled: int | None = None
) -> mx.array | None:
    """The attention of a draft tree's nodes (its L nodes written at
    ``q_offset``, in node order) over the cache's buffers, each node as the
    plain step producing its token computes its row: [B, HQ, L, D] through the
    kernel where it serves here, else None (MLX's attention runs)."""
    where = backend()
    if tree.size != queries.shape[2] or not serves(where, queries, keys, tree=True, filled=filled):
        return None
    kernel = _kernels[where]
    form = _checks[(where, queries.dtype, queries.shape[3], True)].form
    table = kernel.tree_inputs(tree)
    return kernel(queries, keys, values, scale=scale, q_offset=q_offset, arch=arch_code(where), form=form, tree=table)


def one_row_attention(queries, keys, values, *, scale: float, q_offset: int) -> mx.array:
    """Each row through MLX's one-row attention alone over keys 0..its position,
    as a plain step calls it (the buffer's slice, no mask): [B, HQ, L, D]."""
    rows = []
    for i in range(queries.shape[2]):
        n = q_offset + i + 1
        rows.append(
            mx.fast.scaled_dot_product_attention(
                queries[:, :, i : i + 1], keys[..., :n, :], values[..., :n, :], scale=scale, mask=None
            )
        )
    return mx.concatenate(rows, axis=2)


def tree_paths(parents) -> list[list[int]]:
    """Each node's path from the root (the root first, the node last), from its
    parents (host values; the root its own parent)."""
    paths: list[list[int]] = []
    for i, p in enumerate(int(x) for x in parents):
        paths.append([i] if p == i else paths[p] + [i])
    return paths


def one_row_tree_attention(queries, keys, values, *, scale: float, q_offset: int, parents) -> mx.array:
    """Each node through MLX's one-row attention alone over the keys the plain
    step producing its token reads: the context, then its path's keys gathered
    from ``q_offset`` + their node index, in depth order: [B, HQ, L, D]."""
    rows = []
    for i, path in enumerate(tree_paths(parents)):
        at = mx.concatenate([mx.arange(q_offset), q_offset + mx.array(path)])
        k, v = mx.take(keys, at, axis=2), mx.take(values, at, axis=2)
        rows.append(mx.fast.scaled_dot_product_attention(queries[:, :, i : i + 1], k, v, scale=scale, mask=None))
    return mx.concatenate(rows, axis=2)


def random_parents(nodes: int, seed: int) -> np.ndarray:
    """A random tree's parents, each node's before it: nodes 1 and 2 siblings
    (so that no tree is a block's chain), the rest deep and bushy alike."""
    rng = np.random.default_rng(seed)
    parents = [0, 0, 0] + [int(rng.integers(max(0, i - 1 - int(rng.integers(0, 3))), i)) for i in range(3, nodes)]
    return np.array(parents[:nodes], np.int32)


def random_tree(nodes: int, seed: int) -> TreeLayout:
    return from_parents(mx.array(random_parents(nodes, seed)), nodes)


# (G, rows, q_offset, key buffer): one pass at a few keys and GQA 1; across MLX's
# switch to two passes on 's' and 'd' devices (1024 keys), across its switch under
# GQA (4096 keys), two passes with more blocks (GQA 6 past 16384 keys, GQA 2
# past 8192), and across the GQA kernel's 8192 keys at GQA 8. Buffers are whole
# steps of 256, as a cache's. (CUDA: under 256 keys.)
CHECK_CASES = {
    "metal": (
        (1, 3, 37, 256),
        (4, 16, 1015, 1280),
        (4, 5, 4089, 4352),
        (6, 16, 16380, 16640),
        (2, 7, 9000, 9216),
        (8, 3, 8190, 8448),
    ),
    "cuda": ((1, 3, 37, 256), (4, 16, 200, 256), (8, 16, 239, 256)),
}


def check_cases(where: str, dtype, head_dim: int):
    """(q, k, v, q_offset): random verifies of each case over a cache-like buffer
    (a tree's: its rows the nodes of random_parents(rows, q_offset))."""
    for g, rows, start, n in CHECK_CASES[where]:
        key = mx.random.key(g * 1000 + rows + head_dim)
        kq, kk, kv = mx.random.split(key, 3)
        q = mx.random.normal((1, rows, 2 * g, head_dim), key=kq).astype(dtype).transpose(0, 2, 1, 3)
        k = mx.random.normal((1, 2, n, head_dim), key=kk).astype(dtype)
        v = mx.random.normal((1, 2, n, head_dim), key=kv).astype(dtype)
        mx.eval(q, k, v)
        yield q, k, v, start


def self_check(where: str, dtype, head_dim: int, tree: bool = False) -> ExactAttentionCheck:
    """The kernel's rows against MLX's one-row attention of the same rows (a
    tree's: of each node over its gathered keys), bit for bit, with each
    multiply-add form in turn, keeping the first that matches."""
    name = str(dtype).split(".")[-1]

    def pairs(kernel, form: int):
        arch = arch_code(where)
        for q, k, v, start in check_cases(where, dtype, head_dim):
            scale = head_dim**-0.5
            kw = dict(scale=scale, q_offset=mx.array(start), arch=arch, form=form)
            if tree:
                parents = random_parents(q.shape[2], start)
                got = kernel(q, k, v, **kw, tree=ancestor_table(from_parents(mx.array(parents), q.shape[2])))
                want = one_row_tree_attention(q, k, v, scale=scale, q_offset=start, parents=parents)
            else:
                got = kernel(q, k, v, **kw)
                want = one_row_attention(q, k, v, scale=scale, q_offset=start)
            yield got.reshape(-1, head_dim), want.reshape(-1, head_dim), f"at {start} keys: "

    return first_exact(
        where,
        FORMS.get(where, (0,)),
        (_kernels, BUILDERS),
        pairs,
        lambda ok, detail, form=0: ExactAttentionCheck(where, name, head_dim, ok, detail, form, tree),
        passed="every row equal to MLX's one-row attention",
    )


def self_check_all(report=None) -> list[ExactAttentionCheck]:
    """Check every variant this backend serves (for `dflash-mlx doctor`), each
    told to ``report``; [] where the kernel does not run."""
    where = backend()
    if where not in BUILDERS:
        return []
    for dtype, d, tree in itertools.product(DTYPES, HEAD_DIMS[where], (False, True)):
        checked(where, dtype, d, tree)
    return checked_here(_checks, where, report)


def record_variants(factory, backend_name: str) -> None:
    """Launch every variant the kernel can (each dtype, head dim, form, row
    tile, a block's and a tree's, and, on Metal, GQA kernel's factor) through
    ``factory``, a stand-in for MLX's kernel factory that records them
    (scripts/check_metal_kernels.py, check_cuda_kernels.py)."""
    kernel = ExactAttentionKernel(backend_name, factory=factory)
    table = ancestor_table(from_parents(mx.array([0, 0], mx.int32), 2))
    variants = itertools.product(DTYPES, HEAD_DIMS[backend_name], FORMS[backend_name], (None, table))
    for dtype, d, form, tree in variants:
        kv = mx.zeros((1, 1, 4096, d), dtype)
        at = dict(q_offset=mx.array([100], mx.int32), form=form, tree=tree)
        for rows in ROW_TILES:
            q = mx.zeros((1, rows // 2, 2, d), dtype)
            kernel(q, kv, kv, scale=d**-0.5, arch=1, **at)
        for g in (g for g, hd in GQA_HEADS if hd == d and backend_name == "metal"):
            kv = mx.zeros((1, 1, GQA_KERNEL_KEYS, d), dtype)
            q = mx.zeros((1, g, 2, d), dtype)
            kernel(q, kv, kv, scale=d**-0.5, arch=0, **at)
