"""Build and launch the two-pass block-attention kernel on Metal or CUDA."""

from __future__ import annotations

import math

import mlx.core as mx

from . import attention_source as source
from . import attention_tiles as source_tiles
from .launch_source import compacting

THREADS_TARGET = 1024  # threadgroups pass 1 aims for: enough to fill a large GPU several times
THREADGROUP_BYTES = 28 * 1024  # under the 32 KB of threadgroup memory Apple GPUs allow
# The matrix-unit pass aims for TILE_GROUPS_TARGET threadgroups with chunks of at least
# TILE_CHUNK_FLOOR keys: fewer threadgroups leave the GPU's bandwidth idle, more make
# the merge read more partials.
TILE_GROUPS_TARGET = 256
TILE_CHUNK_FLOOR = 256


def make_factory(backend: str):
    """mx.fast.metal_kernel or mx.fast.cuda_kernel, called with the same
    arguments (``shared_memory``: CUDA's dynamic shared memory; Metal's
    kernels declare theirs)."""
    if backend == "metal":
        return lambda shared_memory=0, **kw: mx.fast.metal_kernel(**kw)
    if backend == "cuda":
        return lambda **kw: mx.fast.cuda_kernel(**kw)
    raise ValueError(f"no kernel dialect for backend {backend!r}; use 'metal' or 'cuda'.")


def unread_input(size: int, dtype: mx.Dtype) -> mx.array:
    """An input a variant never reads (an absent bias, no sinks), made from
    data: an array made by an op belongs to the stream of the thread that made
    it, and a kernel object is built on one thread and launched from others."""
    return mx.array([0] * size, dtype=dtype)


class BlockAttentionKernel:
    """The kernels for one backend: the partial pass on the matrix units
    (bf16, fp16) or in SIMT arithmetic (fp32), then the merge; compiled by MLX
    per template (dtype, head dim, warps, staging, causal, window, sinks) on
    first launch."""

    def __init__(self, backend: str, factory=None):
        self.backend = backend
        self._factory = compacting(factory or make_factory(backend), backend)
        hdr = source.header(backend)
        self.partial = self._partial_pass("dflash_block_attn_partial", source.partial_source(backend), hdr)
        self.merge = self._factory(
            name="dflash_block_attn_merge",
            input_names=source.MERGE_INPUTS,
            output_names=source.MERGE_OUTPUTS,
            source=source.merge_source(backend),
            header=hdr,
        )
        self._tiles_header = hdr + source_tiles.header(backend)
        self._tiles: dict[tuple[int, bool], object] = {}  # (staging bytes, tree) -> kernel
        self._trees = None  # the SIMT pass over a tree, made at its first launch
        self._params: dict[tuple[float, bool], mx.array] = {}  # (scale, one chunk written whole) -> params
        self._no_sinks = unread_input(1, mx.float32)

    def _partial_pass(self, name: str, body: str, header: str, tree: bool = False, **launch):
        # A partial pass reads the queries through their strides (no copy of a
        # rotated, transposed query); keys and values are made contiguous below.
        return self._factory(
            name=name + ("_tree" if tree else ""),
            input_names=source.PARTIAL_INPUTS + (source.TREE_INPUTS if tree else []),
            output_names=source.PARTIAL_OUTPUTS,
            source=body,
            header=header,
            ensure_row_contiguous=False,
            **launch,
        )

    def partial_tiles(self, staging_bytes: int, tree: bool = False):
        """The matrix-unit pass with ``staging_bytes`` of staging memory (one
        kernel object per size: CUDA fixes dynamic shared memory per object),
        over a block or a draft tree."""
        kernel = self._tiles.get((staging_bytes, tree))
        if kernel is None:
            kernel = self._tiles[(staging_bytes, tree)] = self._partial_pass(
                "dflash_block_attn_partial_tiles",
                source_tiles.partial_source(source.PRELUDE[self.backend], self.backend, tree),
                source.header(self.backend, tree) + source_tiles.header(self.backend),
                tree,
                shared_memory=staging_bytes,
            )
        return kernel

    def partial_tree(self):
        """The SIMT pass over a draft tree."""
        if self._trees is None:
            self._trees = self._partial_pass(
                "dflash_block_attn_partial",
                source.partial_source(self.backend, tree=True),
                source.header(self.backend, tree=True),
                tree=True,
            )
        return self._trees

    def __call__(
        self,
        queries,
        keys,
        values,
        *,
        scale,
        q_offset,
        kv_length,
        causal,
        window=None,
        sinks=None,
        tree=None,
        chunk=None,
        tile_keys=None,
        stages=None,
    ):
        """tree: a draft tree's layout (kv/tree.py's TreeLayout; causal, its
        nodes the L query rows, written at q_offset on), or None for a block;
        chunk: keys per threadgroup; tile_keys, stages:
        keys per staged tile and staging buffers of the matrix-unit pass
        (defaults: chosen from the shape and backend; benchmarks sweep them).
        The result is a [B, Hq, L, D] view of a [B, L, Hq, D] array."""
        b, hq, lq, d = queries.shape
        hkv, n = keys.shape[1], keys.shape[2]
        rows = (hq // hkv) * lq
        tiles = queries.dtype != mx.float32
        if tiles:
            rw = source_tiles.ROWS_PER_WARP
            warps = tile_warps(rows)
        else:
            rw = source.ROWS_PER_WARP
            warps = min(max_warps(d), -(-rows // rw))
        row_tiles = -(-rows // (warps * rw))
        groups = b * hkv * row_tiles
        if chunk:
            nch = -(-n // chunk)
        elif tiles:
            nch = tile_chunks(n, groups)
        else:
            nch = -(-n // chunk_size(n, groups))
        has_sinks = sinks is not None
        # One key chunk and no sinks: the matrix-unit pass on CUDA writes the output itself, no merge
        # (source_tiles.STORE: a run-time flag in params, the output's T elements in a float32 array's bytes).
        final = tiles and nch == 1 and not has_sinks and self.backend == "cuda"
        params = self._params.get((scale, final))
        if params is None:
            params = self._params[(scale, final)] = mx.array([scale * source.LOG2E, float(final)], dtype=mx.float32)
        common = [("T", queries.dtype), ("D", d), ("NW", warps), ("CAUSAL", bool(causal)), ("WINDOW", int(window or 0))]
        in_tree = tree is not None
        if tiles:
            kt, st = source_tiles.staging(d, self.backend, tile_keys, stages)
            staged = source_tiles.staging_bytes(d, kt, st)
            partial, extra = self.partial_tiles(staged, in_tree), [("KT", kt), ("ST", st)]
        else:
            partial, extra = self.partial_tree() if in_tree else self.partial, [("RW", rw)]
        inputs = [queries, mx.contiguous(keys), mx.contiguous(values), _int1(q_offset), _int1(kv_length), params]
        if in_tree:
            inputs += [tree.ancestors, tree.depths]
        if final:  # (T is 2 bytes: the output's d elements in d / 2 floats)
            shapes = [(b, lq, hq, d // 2), (1,), (1,)]
        else:
            shapes = [(b, hq, lq, nch, d), (b, hq, lq, nch), (b, hq, lq, nch)]
        o_part, m_part, l_part = partial(
            inputs=inputs,
            template=common + extra,
            grid=(row_tiles * warps * source.SIMD, nch, b * hkv),
            threadgroup=(warps * source.SIMD, 1, 1),
            output_shapes=shapes,
            output_dtypes=[mx.float32] * 3,
        )
        if final:
            return o_part.view(queries.dtype).transpose(0, 2, 1, 3)
        (out,) = self.merge(
            inputs=[o_part, m_part, l_part, sinks.astype(mx.float32) if has_sinks else self._no_sinks],
            template=[("T", queries.dtype), ("D", d), ("HAS_SINKS", has_sinks)],
            grid=(d * b * hq * lq, 1, 1),  # rows along x: y allows only 65535 threadgroups
            threadgroup=(d, 1, 1),
            output_shapes=[(b, lq, hq, d)],
            output_dtypes=[queries.dtype],
        )
        return out.transpose(0, 2, 1, 3)


def tile_warps(rows: int) -> int:
    """Warps per threadgroup of the matrix-unit pass for ``rows`` query rows
    per kv head: a power of two up to MOST_WARPS (its threads must stage
    each tile in whole passes, which 3 warps' do not)."""
    want = -(-rows // source_tiles.ROWS_PER_WARP)
    return min(source_tiles.MOST_WARPS, 1 << (want - 1).bit_length())


def max_warps(d: int) -> int:
    """Warps per threadgroup of the SIMT pass: up to 16, within
    THREADGROUP_BYTES of query rows and probabilities (fp32)."""
    per_warp = source.ROWS_PER_WARP * (d + source.SIMD) * 4
    return max(1, min(16, THREADGROUP_BYTES // per_warp))


def tile_chunks(n: int, groups: int) -> int:
    """Key chunks of the matrix-unit pass: TILE_GROUPS_TARGET threadgroups in
    all, no chunk under TILE_CHUNK_FLOOR keys (the kernel reads the count from
    its grid, so any count compiles once)."""
    return max(1, min(-(-TILE_GROUPS_TARGET // max(groups, 1)), -(-n // TILE_CHUNK_FLOOR)))


def chunk_size(n: int, groups: int, target: int = THREADS_TARGET) -> int:
    """Keys per chunk: a power of two from 64 to 4096 giving about `target`
    threadgroups, so few template variants get compiled."""
    want = max(1, target // max(groups, 1))
    c = 1 << max(6, math.ceil(math.log2(max(1, -(-n // want)))))
    return min(c, 4096)


def _int1(x):
    if isinstance(x, mx.array):
        if x.ndim != 1:
            x = x.reshape((1,))
        return x if x.dtype == mx.int32 else x.astype(mx.int32)
    return mx.array([x], dtype=mx.int32)
