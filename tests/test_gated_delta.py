"""The gated delta-net recurrence (kernels/gated_delta.py): its ops path
against mlx-lm's ``gated_delta_update``, a limited run against a plain run of
the prefix, which inputs the kernel takes, a kernel that fails its self-check
refused, every Metal and CUDA variant recorded as MLX would build it (the
Metal ones compiled by clang where it is installed), and, with a kernel that
passed its check (mlx-lm's ops standing in for it, as CUDA routes): every
delta-net write one launch, the cut one limited launch, replay the default,
states and greedy output mlx-lm's."""

import mlx.core as mx
import pytest
from family_models import family_config, greedy_over_blocks, make_family_target, scripted
from gated_delta_stand_in import OpsKernel, checked_kernel  # noqa: F401 (a fixture)
from mlx_lm.models.gated_delta import compute_g, gated_delta_update
from repo_files import repo_module
from tiny import draft_config, make_draft, random_draft_weights

from dflash_mlx.kernels import gated_delta
from dflash_mlx.kernels.gated_delta import GatedDeltaKernel, check_cases, fits, recurrence
from dflash_mlx.targets import adapt
from dflash_mlx.targets.recurrent import DeltaCache

VOCAB = 48


def load_script(name: str):
    return repo_module(f"scripts/{name}.py")


def layer_inputs(dtype, B=1, T=9, Hk=2, Hv=4, Dk=32, Dv=16, seed=0):
    """q, k, v, a, b, A_log, dt_bias as a Qwen3.5 layer makes them."""
    ks = mx.random.split(mx.random.key(seed), 7)
    q = mx.random.normal((B, T, Hk, Dk), key=ks[0])
    k = mx.random.normal((B, T, Hk, Dk), key=ks[1])
    q = (Dk**-1.0 * mx.fast.rms_norm(q, None, 1e-6)).astype(dtype)
    k = (Dk**-0.5 * mx.fast.rms_norm(k, None, 1e-6)).astype(dtype)
    v = mx.random.normal((B, T, Hv, Dv), key=ks[2]).astype(dtype)
    a = mx.random.normal((B, T, Hv), key=ks[3]).astype(dtype)
    b = mx.random.normal((B, T, Hv), key=ks[4]).astype(dtype)
    A_log = mx.random.uniform(-1.0, 1.0, (Hv,), key=ks[5])
    dt_bias = mx.random.normal((Hv,), key=ks[6]).astype(dtype)
    return q, k, v, a, b, A_log, dt_bias


def same(x, y) -> bool:
    return x.shape == y.shape and x.dtype == y.dtype and mx.array_equal(x, y).item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("heads", [(2, 4), (3, 3)])
def test_recurrence_is_mlx_lms_update(dtype, heads):
    Hk, Hv = heads
    q, k, v, a, b, A_log, dt_bias = layer_inputs(dtype, Hk=Hk, Hv=Hv)
    g, beta = compute_g(A_log, a, dt_bias), mx.sigmoid(b)
    for state in (None, 0.1 * mx.random.normal((1, Hv, 16, 32), key=mx.random.key(3))):
        want_y, want_state = gated_delta_update(q, k, v, a, b, A_log, dt_bias, state)
        zeros = mx.zeros((1, Hv, 16, 32), mx.float32)
        y, last = recurrence(q, k, v, g, beta, zeros if state is None else state)
        assert same(y, want_y) and same(last, want_state)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_a_limited_run_is_the_plain_run_of_its_prefix(dtype):
    q, k, v, a, b, A_log, dt_bias = layer_inputs(dtype, T=7, seed=1)
    g, beta = compute_g(A_log, a, dt_bias), mx.sigmoid(b)
    state = 0.1 * mx.random.normal((1, 4, 16, 32), key=mx.random.key(5))
    y_all, _ = recurrence(q, k, v, g, beta, state)
    for s in range(8):
        y, kept = recurrence(q, k, v, g, beta, state, steps=mx.array([s], mx.int32))
        if s == 0:
            assert same(kept, state)
            continue
        y_prefix, want = recurrence(q[:, :s], k[:, :s], v[:, :s], g[:, :s], beta[:, :s], state)
        assert same(kept, want), s
        assert same(y[:, :s], y_prefix) and same(y_prefix, y_all[:, :s]), s


def test_which_inputs_the_kernel_takes():
    def args(Dk=128, Dv=128, dtype=mx.bfloat16, g_shape=None, state_dtype=mx.float32, beta_dtype=None, Hk=2, Hv=4):
        q = mx.zeros((1, 2, Hk, Dk), dtype)
        v = mx.zeros((1, 2, Hv, Dv), dtype)
        g = mx.zeros(g_shape or (1, 2, Hv), mx.float32)
        beta = mx.zeros((1, 2, Hv), beta_dtype or dtype)
        return q, v, g, beta, mx.zeros((1, Hv, Dv, Dk), state_dtype)

    assert fits(*args())
    for dk in gated_delta.KEY_DIMS:
        assert fits(*args(Dk=dk, Dv=64))
    assert not fits(*args(Dk=16, Dv=16))  # under a lane's 32 elements: mlx-lm's ops
    assert not fits(*args(Dk=96))  # a value row's lanes must be a power of two
    assert not fits(*args(Dk=32, Dv=48))  # 32 value rows a simdgroup
    assert not fits(*args(g_shape=(1, 2, 4, 128)))  # gates per key element
    assert not fits(*args(state_dtype=mx.bfloat16))
    assert not fits(*args(beta_dtype=mx.float32))
    assert not fits(*args(Hk=3, Hv=4))


def test_the_cpu_runs_mlx_lms_ops_and_checks_nothing():
    gated_delta.reset()
    gated_delta.prepare(mx.bfloat16, 128, 128)
    assert gated_delta.self_check_all() == []
    q, k, v, g, beta, state = next(check_cases(mx.bfloat16, 128, 128))
    assert gated_delta.kernel_for(q, v, g, beta, state) is None
    assert not gated_delta.one_launch_replay(q, v, g, beta, state)


def test_a_wrong_kernel_fails_its_self_check():
    """A kernel whose outputs are wrong (a recorder's zeros) is refused with
    the error named, so ``recurrence`` keeps mlx-lm's path for it."""
    recorder = load_script("check_cuda_kernels").Recorder()
    gated_delta.reset()
    try:
        gated_delta._kernels["cuda"] = GatedDeltaKernel("cuda", factory=recorder.factory)
        result = gated_delta.self_check("cuda", mx.float32, 32, 32)
        assert not result.ok and result.detail.startswith("max relative error") and "> 2e-03" in result.detail
        assert gated_delta.passed(mx.float32, 32) is None
    finally:
        gated_delta.reset()


def test_every_variant_is_recorded_as_mlx_builds_it():
    cuda = load_script("check_cuda_kernels").Recorder()
    gated_delta.record_variants(cuda.factory, "cuda")
    # each dtype, Dk: a write limited or not, a tree keeping every state or not
    assert len(cuda.variants) == len(gated_delta.DTYPES) * len(gated_delta.KEY_DIMS) * 4
    tree = cuda.variants[f"dflash_gated_delta_tree_v{gated_delta.VERSION}_float16_64_False"]
    assert (
        "const int32_t* parents,\n    __half* y,\n    float* states)" in tree
        and "constexpr bool KEEP_ALL = false;" in tree
    )
    src = cuda.variants[f"dflash_gated_delta_v{gated_delta.VERSION}_bfloat16_128_True"]
    assert "const __nv_bfloat16* q,\n    const __grid_constant__ Shape q_shape," in src
    assert "const int32_t* steps,\n    __nv_bfloat16* y,\n    float* state_out)" in src
    assert "constexpr int Dk = 128;" in src and "__shfl_xor_sync" in src
    metal = load_script("check_metal_kernels").Recorder()
    gated_delta.record_variants(metal.factory, "metal")
    names = list(metal.variants)
    # the gates and betas of few heads in constant memory, of many in device memory
    assert any("_floatc_bfloat16_tc_float_int32_tc_" in n for n in names)
    assert any("_float_bfloat16_t_float_int32_tc_" in n for n in names)
    assert all(
        len(v.launches) and not load_script("check_metal_kernels").launch_problems(v) for v in metal.variants.values()
    )


@pytest.mark.skipif(
    load_script("check_metal_kernels").find_clang() is None, reason="no clang++ on PATH: Metal sources not compiled"
)
def test_the_metal_variants_compile():
    script = load_script("check_metal_kernels")
    recorder = script.Recorder()
    gated_delta.record_variants(recorder.factory, "metal")
    # (a sample, each Dk limited and not: the check script compiles them all)
    recorder.variants = {
        n: v
        for n, v in recorder.variants.items()
        if "__bfloat16_t_" in n and "_floatc_" not in n or "__float_128_" in n
    }
    compiler = script.Compiler(script.find_clang())
    try:
        assert script.check_all(recorder, compiler, jobs=2, report=lambda *_: None) == []
    finally:
        compiler.close()


def kernel_sized_hybrid(seed: int = 1):
    cfg = family_config("qwen3_5", vocab=VOCAB, linear_key_head_dim=32, linear_value_head_dim=32)
    model = make_family_target(cfg, seed)
    model.eval()  # as mlx-lm's load leaves it: the kernels run only outside training
    dcfg = draft_config(cfg, layers=1, block_size=16)
    return model, scripted(make_draft(dcfg, random_draft_weights(dcfg, seed=seed + 1)))


def test_with_a_checked_kernel_every_write_is_one_launch_and_the_cut_one_more(checked_kernel):
    model, _ = kernel_sized_hybrid()
    target = adapt(model)
    cache = target.make_cache()
    layers = sum(isinstance(c, DeltaCache) for c in cache)
    prompt, block = list(range(1, 20)), list(range(20, 36))
    target(mx.array(prompt)[None], cache, [0])
    target.set_length(cache, len(prompt))
    del checked_kernel.launches[:]
    target(mx.array(block)[None], cache, [0])
    assert all(c.pending.states is None for c in cache if isinstance(c, DeltaCache))  # the default: replay
    target.set_length(cache, mx.array(len(prompt) + 5, mx.int32), len(prompt) + len(block))
    assert checked_kernel.launches == [("write", 16)] * layers + [("limited", 16)] * layers
    want = model.make_cache()
    model(mx.array(prompt + block[:5])[None], cache=want)
    for c, w in zip(cache, want):
        if isinstance(c, DeltaCache):
            assert mx.array_equal(c.ssm, w[1]).item() and mx.array_equal(c.conv, w[0]).item()


def test_with_a_checked_kernel_greedy_equals_mlx_lm(checked_kernel):
    model, draft = kernel_sized_hybrid(seed=3)
    accepted = greedy_over_blocks(model, draft, VOCAB, (1, 12, 90), (2, 5, 16), prefill_step_size=40)
    assert set(range(4)) <= accepted and max(accepted) >= 7
    assert {kind for kind, _ in checked_kernel.launches} == {"write", "limited"}


def path_to(parents: list[int], node: int) -> list[int]:
    path = [node]
    while path[-1] != 0:
        path.append(parents[path[-1]])
    return path[::-1]


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_a_trees_nodes_are_plain_runs_over_their_paths(dtype):
    q, k, v, a, b, A_log, dt_bias = layer_inputs(dtype, T=11, seed=2)
    g, beta = compute_g(A_log, a, dt_bias), mx.sigmoid(b)
    state = 0.1 * mx.random.normal((1, 4, 16, 32), key=mx.random.key(7))
    parents = [0, 0, 1, 1, 3, 0, 5, 2, 7, 7, 4]
    y, states = gated_delta.tree_recurrence(q, k, v, g, beta, state, parents=mx.array(parents, mx.int32))
    assert states.shape == (12, 1, 4, 16, 32) and same(states[0], state)
    for i in range(len(parents)):
        path = mx.array(path_to(parents, i))
        y_path, want = recurrence(*(mx.take(x, path, axis=1) for x in (q, k, v, g, beta)), state)
        assert same(y[:, i], y_path[:, -1]) and same(states[i + 1], want), i
    y_read, none = gated_delta.tree_recurrence(
        q, k, v, g, beta, state, parents=mx.array(parents, mx.int32), keep_all=False
    )
    assert none is None and same(y_read, y)


def test_the_self_check_runs_a_tree_node_by_node():
    """A kernel whose trees run each node from its parent passes; one that
    runs them as a chain (ignoring the parents) fails with the node named."""
    gated_delta.reset()
    try:
        gated_delta._kernels["cpu"] = OpsKernel(lambda t, parent: parent)
        assert gated_delta.self_check("cpu", mx.float32, 32, 32).ok
        gated_delta._kernels["cpu"] = OpsKernel(lambda t, parent: t - 1)
        result = gated_delta.self_check("cpu", mx.float32, 32, 32)
        assert not result.ok and result.detail == "tree node 2 differs from a plain step from its parent's state"
    finally:
        gated_delta.reset()
