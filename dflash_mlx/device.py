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
