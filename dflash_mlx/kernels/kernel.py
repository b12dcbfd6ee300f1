"""Build and launch the two-pass block-attention kernel on Metal or CUDA."""

from __future__ import annotations

import math

import mlx.core as mx

from . import source, source_tiles

THREADS_TARGET = 1024  # threadgroups pass 1 aims for; enough to fill an H200's 132 SMs several times
THREADGROUP_BYTES = 28 * 1024  # under the 32 KB of threadgroup memory Apple GPUs allow
# The matrix-unit pass aims for TILE_GROUPS_TARGET threadgroups with chunks of at least
# TILE_CHUNK_FLOOR keys. Device time (benchmarks/gpu_time.py attention, H200, 16 rows over
# 36 distinct buffers) was lowest at 256 / 512 / 1024 keys a chunk for 4k / 16k / 32k keys,
# i.e. 128-256 threadgroups: fewer leave the GPU's bandwidth idle (4096-key chunks ran
# 2.4-5.8x slower), more make the merge read more partials.
TILE_GROUPS_TARGET = 256
TILE_CHUNK_FLOOR = 256


def make_factory(backend: str):
    """mx.fast.metal_kernel or mx.fast.cuda_kernel, called with the same arguments."""
    if backend == "metal":
        return lambda **kw: mx.fast.metal_kernel(**kw)
    if backend == "cuda":
        return lambda **kw: mx.fast.cuda_kernel(**kw)
    raise ValueError(f"no kernel dialect for backend {backend!r}; use 'metal' or 'cuda'.")


class BlockAttentionKernel:
    """The kernels for one backend: the partial pass on the matrix units
    (bf16, fp16) or in SIMT arithmetic (fp32), then the merge; compiled by MLX
    per template (dtype, head dim, warps, chunk, causal, window, sinks) on
    first launch."""

    def __init__(self, backend: str, factory=None):
        self.backend = backend
        factory = factory or make_factory(backend)
        hdr = source.header(backend)
        self.partial, self.partial_tiles, self.merge = (
            factory(name=f"dflash_block_attn_{stage}", input_names=inputs, output_names=outputs, source=body, header=h)
            for stage, inputs, outputs, body, h in (
                ("partial", source.PARTIAL_INPUTS, source.PARTIAL_OUTPUTS, source.partial_source(backend), hdr),
                (
                    "partial_tiles",
                    source.PARTIAL_INPUTS,
                    source.PARTIAL_OUTPUTS,
                    source_tiles.partial_source(source.PRELUDE[backend], backend),
                    hdr + source_tiles.header(backend),
                ),
                ("merge", source.MERGE_INPUTS, source.MERGE_OUTPUTS, source.merge_source(backend), hdr),
            )
        )
        self._params: dict[float, mx.array] = {}
        self._no_sinks = mx.zeros((1,), dtype=mx.float32)

    def __call__(self, queries, keys, values, *, scale, q_offset, kv_length, causal, window=None, sinks=None, chunk=None):
        """chunk: keys per threadgroup, a multiple of 64 (default: chosen from
        the shape; benchmarks/bench_attention.py sweeps it)."""
        b, hq, lq, d = queries.shape
        hkv, n = keys.shape[1], keys.shape[2]
        rows = (hq // hkv) * lq
        tiles = queries.dtype != mx.float32
        if tiles:
            rw = source_tiles.ROWS_PER_WARP
            warps = min(source_tiles.MOST_WARPS, -(-rows // rw))
        else:
            rw = source.ROWS_PER_WARP
            warps = min(max_warps(d), -(-rows // rw))
        row_tiles = -(-rows // (warps * rw))
        groups = b * hkv * row_tiles
        if tiles:
            chunk = chunk or max(TILE_CHUNK_FLOOR, chunk_size(n, groups, TILE_GROUPS_TARGET))
        else:
            chunk = chunk or chunk_size(n, groups)
        nch = -(-n // chunk)
        params = self._params.get(scale)
        if params is None:
            params = self._params[scale] = mx.array([scale * source.LOG2E], dtype=mx.float32)
        common = [("T", queries.dtype), ("D", d), ("NW", warps), ("C", chunk), ("CAUSAL", bool(causal)), ("WINDOW", int(window or 0))]
        o_part, m_part, l_part = (self.partial_tiles if tiles else self.partial)(
            inputs=[queries, keys, values, _int1(q_offset), _int1(kv_length), params],
            template=common + ([("KT", source_tiles.keys_per_tile(d, self.backend))] if tiles else [("RW", rw)]),
            grid=(row_tiles * warps * source.SIMD, nch, b * hkv),
            threadgroup=(warps * source.SIMD, 1, 1),
            output_shapes=[(b, hq, lq, nch, d), (b, hq, lq, nch), (b, hq, lq, nch)],
            output_dtypes=[mx.float32] * 3,
        )
        has_sinks = sinks is not None
        (out,) = self.merge(
            inputs=[o_part, m_part, l_part, sinks.astype(mx.float32) if has_sinks else self._no_sinks],
            template=[("T", queries.dtype), ("D", d), ("HAS_SINKS", has_sinks)],
            grid=(d * b * hq * lq, 1, 1),  # rows along x: y allows only 65535 threadgroups
            threadgroup=(d, 1, 1),
            output_shapes=[queries.shape],
            output_dtypes=[queries.dtype],
        )
        return out


def max_warps(d: int) -> int:
    """Warps per threadgroup of the SIMT pass: up to 16, within
    THREADGROUP_BYTES of query rows and probabilities (fp32)."""
    per_warp = source.ROWS_PER_WARP * (d + source.SIMD) * 4
    return max(1, min(16, THREADGROUP_BYTES // per_warp))


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
