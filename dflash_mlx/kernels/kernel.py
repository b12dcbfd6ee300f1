"""Build and launch the two-pass block-attention kernel on Metal or CUDA."""

from __future__ import annotations

import math

import mlx.core as mx

from . import source

THREADS_TARGET = 1024  # threadgroups pass 1 aims for; enough to fill an H200's 132 SMs several times
THREADGROUP_BYTES = 28 * 1024  # under the 32 KB of threadgroup memory Apple GPUs allow


def make_factory(backend: str):
    """mx.fast.metal_kernel or mx.fast.cuda_kernel, called with the same arguments."""
    if backend == "metal":
        return lambda **kw: mx.fast.metal_kernel(**kw)
    if backend == "cuda":
        return lambda **kw: mx.fast.cuda_kernel(**kw)
    raise ValueError(f"no kernel dialect for backend {backend!r}; use 'metal' or 'cuda'.")


class BlockAttentionKernel:
    """The pair of kernels for one backend; compiled by MLX per template
    (dtype, head dim, warps, chunk, causal, window, sinks) on first launch."""

    def __init__(self, backend: str, factory=None):
        self.backend = backend
        factory = factory or make_factory(backend)
        hdr = source.header(backend)
        self.partial, self.merge = (
            factory(name=f"dflash_block_attn_{stage}", input_names=inputs, output_names=outputs, source=body, header=hdr)
            for stage, inputs, outputs, body in (
                ("partial", source.PARTIAL_INPUTS, source.PARTIAL_OUTPUTS, source.partial_source(backend)),
                ("merge", source.MERGE_INPUTS, source.MERGE_OUTPUTS, source.merge_source(backend)),
            )
        )
        self._params: dict[float, mx.array] = {}
        self._no_sinks = mx.zeros((1,), dtype=mx.float32)

    def __call__(self, queries, keys, values, *, scale, q_offset, kv_length, causal, window=None, sinks=None):
        b, hq, lq, d = queries.shape
        hkv, n = keys.shape[1], keys.shape[2]
        rows = (hq // hkv) * lq
        rw = source.ROWS_PER_WARP
        stage = queries.dtype != mx.float32
        warps = min(max_warps(d, stage), -(-rows // rw))
        row_tiles = -(-rows // (warps * rw))
        chunk = chunk_size(n, b * hkv * row_tiles)
        nch = -(-n // chunk)
        params = self._params.get(scale)
        if params is None:
            params = self._params[scale] = mx.array([scale * source.LOG2E], dtype=mx.float32)
        o_part, m_part, l_part = self.partial(
            inputs=[queries, keys, values, _int1(q_offset), _int1(kv_length), params],
            template=[
                ("T", queries.dtype), ("D", d), ("NW", warps), ("RW", rw), ("C", chunk),
                ("CAUSAL", bool(causal)), ("WINDOW", int(window or 0)), ("STAGE", stage),
            ],
            grid=(row_tiles * warps * source.SIMD, nch, b * hkv),
            threadgroup=(warps * source.SIMD, 1, 1),
            output_shapes=[(b, hq, lq, nch, d), (b, hq, lq, nch), (b, hq, lq, nch)],
            output_dtypes=[mx.float32] * 3,
        )
        has_sinks = sinks is not None
        (out,) = self.merge(
            inputs=[o_part, m_part, l_part, sinks.astype(mx.float32) if has_sinks else self._no_sinks],
            template=[("T", queries.dtype), ("D", d), ("HAS_SINKS", has_sinks)],
            grid=(d, b * hq * lq, 1),
            threadgroup=(d, 1, 1),
            output_shapes=[queries.shape],
            output_dtypes=[queries.dtype],
        )
        return out


def max_warps(d: int, stage: bool) -> int:
    """Warps per threadgroup: up to 16, within THREADGROUP_BYTES of query rows
    (fp32) and one staged 32-key tile (2-byte dtypes)."""
    tile = 32 * (d + 4) * 2 if stage else 0
    per_warp = source.ROWS_PER_WARP * (d + source.SIMD) * 4  # query rows and probabilities, fp32
    return max(1, min(16, (THREADGROUP_BYTES - tile) // per_warp))


def chunk_size(n: int, groups: int) -> int:
    """Keys per chunk: a power of two from 64 to 4096 giving about
    THREADS_TARGET threadgroups, so few template variants get compiled."""
    want = max(1, THREADS_TARGET // max(groups, 1))
    c = 1 << max(6, math.ceil(math.log2(max(1, -(-n // want)))))
    return min(c, 4096)


def _int1(x):
    if isinstance(x, mx.array):
        if x.ndim != 1:
            x = x.reshape((1,))
        return x if x.dtype == mx.int32 else x.astype(mx.int32)
    return mx.array([x], dtype=mx.int32)
