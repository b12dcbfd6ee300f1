"""The harness that runs Metal sources on this CPU (metal_on_cpu.py) shows
what a GPU would: threadgroup memory is fresh in each threadgroup."""

import ctypes

import mlx.core as mx
import numpy as np
import pytest
from metal_on_cpu import CLANG_F16, build_on_cpu, check_metal_script, run_grid

# Only the first threadgroup writes its threadgroup memory; every one reads it.
READS_WHAT_ONLY_THE_FIRST_GROUP_WROTE = """
  threadgroup T seen[32];
  const uint lane = thread_index_in_simdgroup;
  const uint group = threadgroup_position_in_grid.x;
  if (group == 0) seen[lane] = x[lane];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  y[group * 32 + lane] = seen[lane];
"""


@pytest.mark.skipif(CLANG_F16 is None, reason="no clang++ with _Float16 here (clang 15 on)")
def test_a_threadgroup_never_reads_what_the_last_threadgroup_left(tmp_path):
    """On a GPU a threadgroup's memory starts undefined; here the arrays are
    statics, so each threadgroup finds them poisoned (NaN), not holding the
    last threadgroup's values, which would hide a read before a write."""
    script = check_metal_script()
    recorder = script.Recorder()
    kernel = recorder.factory(
        name="reads_unwritten", input_names=["x"], output_names=["y"], source=READS_WHAT_ONLY_THE_FIRST_GROUP_WROTE
    )
    x = np.arange(1, 33, dtype=np.float32)
    kernel(
        inputs=[mx.array(x)],
        grid=(64, 1, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(64,)],
        output_dtypes=[mx.float32],
        template=[("T", mx.float32)],
    )
    ((_, variant),) = recorder.variants.items()
    lib = build_on_cpu(script, variant.source, ["x", "y"], tmp_path)
    y = np.zeros(64, np.float32)
    run_grid(lib, (ctypes.c_void_p * 2)(x.ctypes.data, y.ctypes.data), 2, 1, 1)
    assert np.array_equal(y[:32], x)
    assert np.isnan(y[32:]).all()
