"""benchmarks/gpu_time.py's cases on the CPU, profiler left out: each names its
case and runs (Nsight Compute reads their kernels on a GPU)."""

import mlx.core as mx
import pytest
from repo_files import ROOT, repo_module


@pytest.fixture
def gpu_time(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    module = repo_module("benchmarks/gpu_time.py")
    ran = []

    def unprofiled(name, fn):
        mx.eval(fn())
        ran.append(name)

    monkeypatch.setattr(module, "profiled", unprofiled)
    module.ran = ran
    return module


@pytest.mark.parametrize("family, bits", [("qwen3.5-9b-like", "4"), ("gpt-oss-20b-like", "mxfp4")])
def test_a_familys_cycle_tree_and_plain_steps_run_as_cases(gpu_time, family, bits):
    families = repo_module("benchmarks/families.py")
    model, draft = families.build(families.FAMILIES[family](True), bits, mx.float32)
    gpu_time.cycle_at(model, draft, 40, 4)
    gpu_time.cycle_at(model, draft, 40, 8, tree=True)
    gpu_time.cycle_at(model, draft, 40, 1)
    gpu_time.plain_at(model, draft, 40)
    assert gpu_time.ran == [
        "cycle block 4 after 40",
        "cycle tree 8 rows after 40",
        "our plain step after 40",
        "plain mlx-lm step after 40",
    ]


def test_mxfp4_takes_a_familys_shape(gpu_time):
    with pytest.raises(SystemExit, match="takes a family's --shape"):
        gpu_time.pair_for("qwen3-1.7b", "mxfp4")
    with pytest.raises(SystemExit, match="--draft-bits takes a Qwen3 --shape"):
        gpu_time.pair_for("gpt-oss-20b-like", "4", draft_bits=4)


def test_cycle_runs_only_the_cases_asked_for(gpu_time, monkeypatch):
    """--cases splits a long run under ncu: the block's cycle beside mlx-lm's step, our step apart."""
    families = repo_module("benchmarks/families.py")
    pair = families.build(families.FAMILIES["qwen3.5-9b-like"](True), "4", mx.float32)
    monkeypatch.setattr(gpu_time, "pair_for", lambda *a, **k: pair)
    gpu_time.cycle_cases("qwen3.5-9b-like", [40], 4, "4", cases=("cycle", "plain"))
    assert gpu_time.ran == ["cycle block 4 after 40", "plain mlx-lm step after 40"]
    gpu_time.ran.clear()
    gpu_time.cycle_cases("qwen3.5-9b-like", [40], 4, "4", cases=("ours",))
    assert gpu_time.ran == ["our plain step after 40"]
    monkeypatch.setattr("sys.argv", ["gpu_time.py", "cycle", "--cases", "cycle,mine"])
    with pytest.raises(SystemExit, match="--cases takes some of cycle,ours,plain"):
        gpu_time.main()
