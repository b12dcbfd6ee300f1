"""The per-machine kernel decisions (kernels/decisions.py): a kernel is used
for a shape class only where this machine measured it faster than MLX's own
path; nothing measured means MLX's path; a damaged or foreign file is ignored
with a warning; a decision outlives the process."""

import json
import time

import mlx.core as mx
import pytest

from dflash_mlx.kernels import decisions, dispatch, ops_attention


def slow(seconds: float):
    def call():
        time.sleep(seconds)
        return mx.array(0)

    return call


def fast():
    return mx.array(0)


def never():
    raise AssertionError("measured again: the decision was not remembered")


MACHINE = {"backend": "metal", "device": "Apple M4 Max", "mlx": "0.32.4"}


def store(path, policy="measure", on=MACHINE):
    return decisions.Decisions(path, policy, on)


def test_nothing_measured_runs_mlx_and_a_slower_kernel_is_never_used(tmp_path):
    path = tmp_path / "d.json"
    here = store(path)
    assert not here.uses("attention", "bf16 rows<=16")
    assert not here.decide("attention", "bf16 rows<=16", ours=slow(0.002), theirs=fast)
    assert not here.uses("attention", "bf16 rows<=16")
    # a later process reads the decision and never measures again
    again = store(path)
    assert not again.decide("attention", "bf16 rows<=16", ours=never, theirs=never)
    (found,) = again.all()
    assert found.ours > found.mlx and not found.faster


def test_a_faster_kernel_is_used_and_remembered(tmp_path):
    path = tmp_path / "d.json"
    assert store(path).decide("product", "q4 g64 rows<=16", ours=fast, theirs=slow(0.002))
    again = store(path)
    assert again.uses("product", "q4 g64 rows<=16") and not again.uses("product", "q4 g64 rows<=32")
    assert again.decide("product", "q4 g64 rows<=16", ours=never, theirs=never)


def test_a_tie_keeps_mlxs_own_path():
    d = decisions.Decision("k", "c", ours=1.0, mlx=1.0 + decisions.MARGIN / 2)
    assert not d.faster
    assert decisions.Decision("k", "c", ours=0.9, mlx=1.0).faster


@pytest.mark.parametrize(
    "content, why",
    [
        ("{not json", "not readable JSON"),
        (json.dumps({"format": "something else", "version": 1}), "not a decisions file"),
        (
            json.dumps({"format": decisions.FORMAT, "version": 1, "machine": MACHINE, "decisions": [{"kernel": 1}]}),
            "malformed",
        ),
        (
            json.dumps(
                {
                    "format": decisions.FORMAT,
                    "version": 1,
                    "machine": MACHINE,
                    "decisions": [{"kernel": "k", "case": "c", "ours": "fast", "mlx": 1.0}],
                }
            ),
            "malformed",
        ),
    ],
)
def test_a_damaged_file_is_ignored_with_a_warning_and_rewritten(tmp_path, content, why):
    path = tmp_path / "d.json"
    path.write_text(content)
    with pytest.warns(RuntimeWarning, match=why):
        here = store(path)
    assert here.all() == [] and not here.uses("k", "c")
    assert here.decide("k", "c", ours=fast, theirs=slow(0.002))
    assert json.loads(path.read_text())["decisions"][0]["case"] == "c"  # whole and valid again


def test_another_machines_decisions_are_not_used(tmp_path):
    path = tmp_path / "d.json"
    assert store(path).decide("k", "c", ours=fast, theirs=slow(0.002))
    with pytest.warns(RuntimeWarning, match="another machine or MLX"):
        elsewhere = store(path, on={**MACHINE, "mlx": "0.33.0"})
    assert not elsewhere.uses("k", "c")


def test_policies_override_the_measurement(tmp_path):
    assert store(None, "on").uses("k", "never measured")
    off = store(None, "off")
    assert not off.decide("k", "c", ours=never, theirs=never)
    with pytest.raises(
        ValueError, match="DFLASH_MLX_KERNELS='fastest' is not a policy; use one of: measure, exact, on, off"
    ):
        store(None, "fastest")


def test_exact_is_measure_with_exactness_first_on_every_backend():
    exact, measure = store(None, "exact"), store(None, "measure")
    assert exact.policy == "measure" and not exact.uses("k", "never measured")
    assert exact.exact_first("cuda") and exact.serves_exact("k", "never measured", "cuda")
    assert not measure.exact_first("cuda") and not measure.serves_exact("k", "never measured", "cuda")
    assert measure.exact_first("metal") and not store(None, "on").exact_first("metal")


def test_the_process_store_lives_under_dflash_mlx_home(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_MLX_HOME", str(tmp_path))
    monkeypatch.setenv("DFLASH_MLX_KERNELS", "measure")
    decisions.reset()
    here = decisions.current()
    assert here.policy == "measure" and here.path.parent == tmp_path / "decisions"
    assert here.decide("k", "c", ours=fast, theirs=slow(0.002)) and here.path.is_file()
    monkeypatch.setenv("DFLASH_MLX_AUTO_MEMORY", "off")
    decisions.reset()
    assert decisions.current().path is None


class Kernel:
    """A GPU's attention kernel as dispatch sees it, ``extra`` seconds slower than the ops path."""

    def __init__(self, extra: float):
        self.extra, self.calls = extra, 0

    def __call__(self, q, k, v, **kw):
        self.calls += 1
        if self.extra:
            time.sleep(self.extra)
        return ops_attention(q, k, v, **kw)


@pytest.fixture
def measuring_gpu(monkeypatch):
    def install(kernel):
        monkeypatch.setattr(dispatch, "backend", lambda: "fake")
        monkeypatch.setitem(dispatch.BUILDERS, "fake", lambda where: kernel)
        monkeypatch.setattr(dispatch, "ROW_CLASSES", (16,))
        monkeypatch.setattr(dispatch, "KEY_CLASSES", (256,))
        monkeypatch.setenv("DFLASH_MLX_KERNELS", "measure")
        decisions.reset()
        return kernel

    dispatch.reset()
    yield install
    dispatch.reset()


def verify_call():
    q = mx.random.normal((1, 8, 4, 64)).astype(mx.float32)  # 16 rows per kv head at GQA 4
    k = mx.random.normal((1, 2, 256, 64)).astype(mx.float32)
    return q, k, dict(scale=0.125, q_offset=mx.array(200), kv_length=mx.array(204), causal=True)


def test_the_attention_dispatch_uses_a_checked_kernel_only_where_it_measured_faster(measuring_gpu):
    kernel = measuring_gpu(Kernel(extra=0.01))
    q, k, kw = verify_call()
    dispatch.block_attention(q, k, k, **kw)
    assert dispatch.serving_kernel("fake", mx.float32, 64, False, rows=16, keys=256) is None  # checked, never measured
    (made,) = dispatch.measure("fake", mx.float32, 64, None)
    assert made.case == "float32 d64 full rows<=16 keys<=256" and not made.faster
    assert dispatch.serving_kernel("fake", mx.float32, 64, False, rows=16, keys=256) is None
    calls = kernel.calls
    dispatch.block_attention(q, k, k, **kw)
    assert kernel.calls == calls  # the slower kernel is not called


def test_a_kernel_measured_faster_serves_its_class(measuring_gpu, measured):
    kernel = measuring_gpu(Kernel(extra=0.0))
    measured(0.5, 1.0)
    (made,) = dispatch.measure("fake", mx.float32, 64, None)
    assert made.faster
    assert dispatch.serving_kernel("fake", mx.float32, 64, False, rows=9, keys=100) is kernel
    assert dispatch.serving_kernel("fake", mx.float32, 64, True, rows=9, keys=100) is None  # the window: unmeasured
    assert dispatch.serving_kernel("fake", mx.float32, 128, False, rows=9, keys=100) is None  # another variant


def test_an_exact_kernel_serves_on_metal_whatever_it_measured(tmp_path):
    """Exactness first where the exact kernels follow MLX's one-row order (Metal);
    elsewhere they are speed kernels like any other; ``off`` turns them off everywhere."""
    here = store(tmp_path / "d.json")
    assert not here.decide("exact verify attention", "bf16 d128", ours=slow(0.002), theirs=fast)
    assert here.serves_exact("exact verify attention", "bf16 d128", "metal")
    assert not here.serves_exact("exact verify attention", "bf16 d128", "cuda")
    assert not here.serves_exact("exact verify attention", "never measured", "cuda")
    assert not store(None, "off").serves_exact("exact verify attention", "bf16 d128", "metal")
    assert store(None, "on").serves_exact("exact verify attention", "bf16 d128", "cuda")


def test_attention_is_timed_over_copies_of_the_keys_and_values(measuring_gpu, monkeypatch):
    """Each timed call reads other keys and values (equal to the first), enough
    copies to take serving.TIMED_BYTES together, as a verify's layers each
    read their own from memory: one buffer timed again would stay in a cache."""
    from dflash_mlx.kernels import serving

    class KeysSeen(Kernel):
        def __call__(self, q, k, v, **kw):
            self.keys.append(k)
            return super().__call__(q, k, v, **kw)

    kernel = measuring_gpu(KeysSeen(extra=0.0))
    kernel.keys = []
    monkeypatch.setattr(serving, "TIMED_BYTES", 1)
    seen = []

    def seconds_per_call(ours, theirs):
        kernel.keys.clear()
        mx.eval([ours() for _ in range(6)])
        seen.append(list(kernel.keys))
        return 1.0, 1.0

    monkeypatch.setattr(decisions, "seconds_per_call", seconds_per_call)
    dispatch.measure("fake", mx.float32, 64, None)
    assert seen and all(len({id(k) for k in keys}) == 1 for keys in seen)  # 1 byte: no copies needed
    decisions.reset()
    first = seen[0][0]
    monkeypatch.setattr(serving, "TIMED_BYTES", 3 * 2 * first.nbytes)
    seen.clear()
    dispatch.measure("fake", mx.float32, 64, None)
    for keys in seen:
        assert len({id(k) for k in keys}) == 3  # in turn: 6 calls over 3 copies
        assert all(mx.array_equal(k, keys[0]) for k in keys)
