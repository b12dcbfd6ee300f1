"""A kernel factory in place of MLX's (``mx.fast.metal_kernel`` / ``cuda_kernel``)
for tests of how a kernel is launched: it records each launch's arguments
(template, grid, threadgroup, output shapes...) and returns zeros of the
outputs' shapes, so no GPU is needed."""

import mlx.core as mx


def recording_factory():
    """(factory, launches): every launch through the factory appends its keyword arguments to ``launches``."""
    launches = []

    def factory(**made):
        def launch(**kw):
            launches.append(kw)
            return [mx.zeros(s, d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])]

        return launch

    return factory, launches
