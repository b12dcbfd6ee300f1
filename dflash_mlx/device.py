"""Which backend MLX computes on, and device-side values a cycle's kernels read."""

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


def device_info() -> dict:
    """MLX's description of the default device (name, memory, ...); {} where it has none."""
    try:
        return dict(mx.device_info())
    except Exception:
        try:
            return dict(mx.metal.device_info())
        except Exception:
            return {}


def device_name() -> str:
    return str(device_info().get("device_name", ""))


def device_scalar(x, add: int = 0):
    """``x + add``; on CUDA, for an int32 scalar array, a view of a 16-byte
    array the device writes (MLX keeps arrays of 8 bytes or less in managed
    memory, slow for kernels to read). Each call is a launch: share them."""
    if not (isinstance(x, mx.array) and x.ndim == 0 and backend() == "cuda"):
        return x + add if add else x
    # a broadcast view plus a constant: one fused launch (a filled array would be another)
    return (mx.broadcast_to(x, (4,)) + add)[:1].reshape(())


_aranges: dict[tuple[int, object], mx.array] = {}


def constant_arange(n: int, dtype=mx.int32) -> mx.array:
    """``mx.arange(n, dtype=dtype)``, evaluated once per process so that a compiled
    cycle captures a constant instead of a launch. Never written to."""
    key = (n, dtype)
    made = _aranges.get(key)
    if made is None:
        made = mx.arange(n, dtype=dtype)
        mx.eval(made)
        _aranges[key] = made
    return made
