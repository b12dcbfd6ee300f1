"""The pair, its fused projections and the kernel objects are built on one thread
(loading, the self-checks) and used from another (the server's decode thread).
MLX gives each thread its own streams, and an array made by an op belongs to the
stream of the thread that made it: evaluated from another thread, a lazy array
they hold fails the request ("There is no Stream(gpu, 0) in current thread")."""

import threading
from types import SimpleNamespace

import mlx.core as mx
import pytest
from cli_fixtures import make_tiny_pair
from repo_files import repo_module

from dflash_mlx import generate, load, tiny
from dflash_mlx.kernels.attention import BlockAttentionKernel
from dflash_mlx.kernels.cuda.products import BlockProductKernel
from dflash_mlx.kernels.exact_attention import ExactAttentionKernel
from dflash_mlx.kernels.exact_products import ExactProductKernel
from dflash_mlx.kernels.gated_delta import GatedDeltaKernel
from dflash_mlx.kernels.norm_rope import NormRopeKernel
from dflash_mlx.kernels.quantized import QuantizedProductKernel
from dflash_mlx.kernels.quantized_gather import QuantizedGatherKernel
from dflash_mlx.layers import fused

KERNELS = {
    "metal": [
        BlockAttentionKernel,
        ExactAttentionKernel,
        ExactProductKernel,
        GatedDeltaKernel,
        NormRopeKernel,
        QuantizedProductKernel,
        QuantizedGatherKernel,
    ],
    "cuda": [BlockAttentionKernel, BlockProductKernel, ExactProductKernel, GatedDeltaKernel, QuantizedProductKernel],
}


def arrays_held(obj, path: str = "", seen: set | None = None) -> list[tuple[str, mx.array]]:
    """The arrays ``obj`` holds: in its attributes, dicts, lists and tuples, and
    in those of the dflash_mlx and mlx-lm objects it holds, at any depth."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, mx.array):
        return [(path, obj)]
    items = []
    if isinstance(obj, dict):  # (an nn.Module too: its arrays and submodules)
        items += [(f"{path}[{k!r}]", v) for k, v in obj.items()]
    elif isinstance(obj, (list, tuple)):
        items += [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
    if hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] in ("dflash_mlx", "mlx_lm", "mlx"):
        items += [(f"{path}.{k}", v) for k, v in vars(obj).items()]
    return [found for name, value in items for found in arrays_held(value, name, seen)]


def on_another_thread(fn) -> Exception | None:
    failed = []

    def run():
        try:
            fn()
        except Exception as e:  # noqa: BLE001 (reported by the test)
            failed.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return failed[0] if failed else None


def lazy_on_another_thread(held: list[tuple[str, mx.array]]) -> list[str]:
    """The names of the ``held`` arrays another thread cannot evaluate."""

    def fails_here(array: mx.array) -> bool:
        try:
            mx.eval(array + 0)
        except RuntimeError:
            return True
        return False

    lazy = []
    assert on_another_thread(lambda: lazy.extend(name for name, a in held if fails_here(a))) is None
    return lazy


def test_a_lazy_array_made_on_one_thread_cannot_be_evaluated_on_another():
    """(What the test below guards against, shown on this MLX.)"""
    lazy = mx.zeros((1,), mx.float32)
    assert "in current thread" in str(on_another_thread(lambda: mx.eval(lazy + 1)))
    made_from_data = mx.array([0.0], mx.float32)
    assert on_another_thread(lambda: mx.eval(made_from_data + 1)) is None


@pytest.mark.parametrize(
    "backend, kernel",
    [(b, k) for b, kernels in KERNELS.items() for k in kernels],
    ids=lambda x: getattr(x, "__name__", x),
)
def test_a_kernel_object_holds_no_array_another_thread_cannot_read(backend, kernel):
    recorder = repo_module("scripts/check_metal_kernels.py").Recorder()
    built = kernel(backend, factory=recorder.factory)
    lazy = lazy_on_another_thread(arrays_held(built, kernel.__name__))
    assert not lazy, f"made lazily on the building thread: {lazy[:5]}"


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def pair(request, tmp_path_factory):
    """The tiny pair; and one whose target and drafter scale their RoPE as Llama
    3.1 does (mlx-lm's Llama3RoPE computes a frequency table, no parameter)."""
    if request.param == "qwen3":
        return make_tiny_pair(tmp_path_factory.mktemp("threads"))
    root = tmp_path_factory.mktemp("threads-llama")
    tcfg = tiny.target_config("llama", vocab=64)
    tiny.write_target(root / "target", tcfg, tiny.make_target(tcfg), tiny.make_tokenizer(64))
    dcfg = tiny.draft_config(tcfg, rope_scaling=tcfg["rope_scaling"])
    tiny.write_zlab_draft(root / "draft", dcfg, tiny.random_draft_weights(dcfg))
    return SimpleNamespace(target=root / "target", draft=root / "draft")


def test_a_loaded_pair_and_its_fused_projections_hold_nothing_lazy(pair):
    model, draft, _ = load(str(pair.target), draft=str(pair.draft))
    draft.fused_projections()  # (as a cycle makes them)
    held = arrays_held(model, "model") + arrays_held(draft, "draft") + arrays_held(fused._fused, "fused")
    assert any(".kv" in name for name, _ in held)  # the projections' views of keys and values are among them
    if getattr(model.args, "rope_scaling", None):
        assert any("_freqs" in name for name, _ in held)  # and the RoPE's frequency table
    lazy = lazy_on_another_thread(held)
    assert not lazy, f"made lazily on the loading thread: {lazy[:5]}"


def test_a_pair_built_on_one_thread_decodes_on_another(pair):
    model, draft, tokenizer = load(str(pair.target), draft=str(pair.draft))
    draft.fused_projections()
    replies = []
    assert (
        on_another_thread(lambda: replies.append(generate(model, draft, tokenizer, "def f(x):", max_tokens=12))) is None
    )
    assert replies == [generate(model, draft, tokenizer, "def f(x):", max_tokens=12)]


@pytest.mark.parametrize("family", ["gpt_oss", "gemma4_text", "qwen3_5", "deepseek_v3"])
def test_each_familys_adapter_holds_nothing_lazy_once_loaded(family):
    """The adapters' own state (sinks, windows, recurrent layers, MLA) and their
    RoPE variants (YaRN, proportional), built as ``load`` builds them."""
    from family_models import family_config, make_family_target
    from tiny import make_draft

    from dflash_mlx.loading import evaluate_held
    from dflash_mlx.targets import adapt

    cfg = family_config(family, vocab=48, layers=6 if family.startswith("gemma") else 4)
    model = make_family_target(cfg)
    dcfg = tiny.draft_config(cfg, layers=1, block_size=8)
    draft = make_draft(dcfg, tiny.random_draft_weights(dcfg, seed=2))
    target = adapt(model)
    draft.bind(target)
    evaluate_held(model, draft)
    draft.fused_projections()
    held = arrays_held(model, "model") + arrays_held(draft, "draft") + arrays_held(target, "target")
    lazy = lazy_on_another_thread(held)
    assert not lazy, f"made lazily on the loading thread: {lazy[:5]}"
