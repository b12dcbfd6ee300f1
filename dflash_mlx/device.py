"""Which backend MLX computes on: what every kernel's dispatch, and the
caches' read widths, decide by."""

import mlx.core as mx


def backend() -> str:
    """'metal', 'cuda' or 'cpu': where MLX's default device computes."""
    if mx.default_device().type != mx.DeviceType.gpu:
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return "cpu"


# MLX's CUDA allocator puts every array of 8 bytes or less in one small pool
# of managed memory (mlx/backend/cuda/allocator.cpp), where the host's own
# scalars live too. Under Nsight Compute, the q/k norm + RoPE kernel took
# 20-22 us a launch reading a cycle's length from that pool and 3.2 us
# reading it from a 16-byte array the device wrote (benchmarks/gpu_time.py
# scalars, BENCHMARKS.md session 17). Switchable for benchmarks' A/B.
WIDE_SCALARS = True


def device_scalar(x, add: int = 0):
    """``x + add`` (``x`` an int32 scalar array) as a view of a 16-byte
    array the device writes (device memory, out of the small managed pool),
    on CUDA, in one launch; elsewhere, and for host ints, ``x + add`` itself.
    Made once per cycle (cycle.py) and per length a forward's layers share
    (kv_cache.SharedPositions), not per kernel: each costs a launch."""
    if not (WIDE_SCALARS and isinstance(x, mx.array) and x.ndim == 0 and backend() == "cuda"):
        return x + add if add else x
    # (a broadcast view plus a constant: one fused launch where a filled
    # array to add would be a launch of its own)
    return (mx.broadcast_to(x, (4,)) + add)[:1].reshape(())


_aranges: dict[tuple[int, object], mx.array] = {}


def constant_arange(n: int, dtype=mx.int32) -> mx.array:
    """``mx.arange(n, dtype=dtype)``, made and evaluated once per process:
    inside a compiled cycle an arange is a launch every cycle, while an
    evaluated array the trace captures is a constant (each launch is host
    time where a cycle is bound by its launches). Never written to."""
    key = (n, dtype)
    made = _aranges.get(key)
    if made is None:
        made = mx.arange(n, dtype=dtype)
        mx.eval(made)
        _aranges[key] = made
    return made
