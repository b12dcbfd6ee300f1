import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
# Commands render through rich, which wraps at the terminal's width (80 when
# there is none): a wide one keeps long temporary paths (pytest-xdist's
# popen-gwN folders) on one line, so what a test looks for is not cut.
os.environ["COLUMNS"] = "240"
# Tests run on MLX's own BLAS, whatever this machine has installed: a system
# OpenBLAS (fast_blas.py) would change the CPU's dtype and compile defaults
# under every test. Its own tests turn it on in fresh processes.
os.environ["DFLASH_MLX_BLAS"] = "off"

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def auto_memory_home(tmp_path_factory, monkeypatch):
    """Each test's `auto` memory (block_memory.py) in a folder of its own,
    never the user's: a test starts knowing nothing unless it says otherwise."""
    monkeypatch.setenv("DFLASH_MLX_HOME", str(tmp_path_factory.mktemp("dflash-home")))
    monkeypatch.delenv("DFLASH_MLX_AUTO_MEMORY", raising=False)
    # A fake GPU's kernels serve wherever the dispatch table lets them: the
    # measurement that decides on a real machine (decisions.py) has its own tests.
    monkeypatch.setenv("DFLASH_MLX_KERNELS", "on")
    # Kernel checks passed in an earlier test are not remembered in this one (passed_checks.py).
    from dflash_mlx.kernels import decisions, passed_checks

    decisions.reset()
    passed_checks.reset()
    yield
    decisions.reset()
    passed_checks.reset()


@pytest.fixture(scope="module")
def agreeing_pair():
    """A tiny pair whose drafter is often right: whole blocks get accepted."""
    from tiny import draft_config, lean_towards_one_token, make_draft, make_target, random_draft_weights, target_config

    tcfg = target_config("qwen3", vocab=24, layers=5)
    model = lean_towards_one_token(make_target(tcfg, seed=21), 0.36)
    dcfg = draft_config(tcfg, layers=2, block_size=16, taps=[0, 3])
    return model, make_draft(dcfg, random_draft_weights(dcfg, seed=22))


@pytest.fixture(params=[False, True], ids=["eager", "compiled"])
def compiled(request, monkeypatch):
    """Cycles built eagerly or through mx.compile (a GPU's path); a module
    that must check more about its compiled runs defines its own."""
    from dflash_mlx.decode.cycle import Cycle

    monkeypatch.setattr(Cycle, "compile_graphs", request.param)
    return request.param


@pytest.fixture
def measured(monkeypatch):
    """Kernel decisions measured (DFLASH_MLX_KERNELS=measure) with given
    times: ``measured(ours_ms, mlx_ms)`` makes every measurement return them
    and returns the list that counts the measurements."""
    from dflash_mlx.kernels import decisions

    def install(ours_ms: float, mlx_ms: float) -> list:
        timed = []

        def seconds_per_call(ours, theirs):
            timed.append(1)
            return ours_ms * 1e-3, mlx_ms * 1e-3

        monkeypatch.setenv("DFLASH_MLX_KERNELS", "measure")
        decisions.reset()
        monkeypatch.setattr(decisions, "seconds_per_call", seconds_per_call)
        return timed

    return install


@pytest.fixture
def buffer_copies(monkeypatch):
    """The growths that copy a filled key/value buffer, plain or quantized,
    into a larger one, as (capacity before, after); allocating an empty
    buffer is not one."""
    from dflash_mlx.kv.buffer import BufferKVCache
    from dflash_mlx.kv.quantized import QuantizedBufferKVCache

    copies = []

    def counting(grow):
        def counted(self, n, keys, values):
            before = self.capacity
            grow(self, n, keys, values)
            if before and self.capacity != before:
                copies.append((before, self.capacity))

        return counted

    for kind in (BufferKVCache, QuantizedBufferKVCache):
        monkeypatch.setattr(kind, "_grow", counting(kind._grow))
    return copies
