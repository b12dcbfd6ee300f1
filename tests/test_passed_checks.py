"""Kernel self-checks remembered per machine (kernels/passed_checks.py): a
later process (here: the modules' state reset and the store read again)
trusts a pass kept on this machine and skips the check's cases, restoring
what the check chose and building the kernel object as a pass does; another
kernel source, machine or MLX version checks again; a damaged or foreign
file is ignored with a warning; a failure is never kept. On a pretend GPU
with stand-in kernels whose builders take a factory, as the real ones do."""

import json
import re
import warnings

import mlx.core as mx
import mlx.nn as nn
import pytest
from test_doctor import run as run_doctor

from dflash_mlx.kernels import dispatch, passed_checks
from dflash_mlx.kernels import exact_products as ep
from dflash_mlx.kernels import quantized as qp
from dflash_mlx.kernels.ops import ops_attention


def built_from(source: str, factory) -> None:
    """What a real kernel's constructor does with its factory: hand it a source (MLX compiles it at a launch)."""
    if factory is not None:
        factory(name="stand_in_v1", input_names=["x"], output_names=["y"], source=source, header="")


class ExactProduct:
    """An exact product whose rows equal MLX's one-row products only in
    multiply-add form 2 (``right``); counts its launches (class-wide)."""

    SOURCE = "y = x . w, in one row's order"
    launches = 0
    right = (2,)

    def __init__(self, where, factory=None):
        built_from(self.SOURCE, factory)

    def __call__(self, x, weight, bias, *, form=0, launch=None):
        ExactProduct.launches += 1
        y = ep.one_row_products(x.reshape(-1, x.shape[-1]), weight, bias)
        y = y if form in self.right else y.at[-1, 0].add(mx.array(1.0, y.dtype))
        return y.reshape(*x.shape[:-1], -1)


@pytest.fixture
def exact_gpu(monkeypatch):
    """The exact product on a pretend GPU 'fake' (CUDA's order rules) built by ExactProduct."""
    ep.reset()
    monkeypatch.setattr(ep, "backend", lambda: "fake")
    monkeypatch.setitem(ep.BUILDERS, "fake", ExactProduct)
    monkeypatch.setitem(ep.FORMS, "fake", (1, 2))
    monkeypatch.setattr(ExactProduct, "launches", 0)
    yield
    ep.reset()


def next_process(*modules) -> None:
    """What a new process starts with: no checks, no built kernels, the store read again."""
    for module in modules:
        module.reset()
    passed_checks.reset()


VARIANT = ep.Variant(mx.bfloat16, 256, ep.one_row_order("cuda", 256, 64), False)


def test_a_pass_is_kept_and_a_later_process_skips_the_checks_cases(exact_gpu):
    first = ep.checked("fake", VARIANT)
    assert first.ok and first.form == 2 and ExactProduct.launches > 0 and not passed_checks.recalled(first)
    assert passed_checks.current().path.exists()
    module = nn.Linear(256, 64, bias=False)
    module.set_dtype(mx.bfloat16)
    x = mx.random.normal((1, 5, 256)).astype(mx.bfloat16)
    served = ep.product(module, x, measuring=True)
    launched = ExactProduct.launches

    next_process(ep)
    again = ep.checked("fake", VARIANT)
    assert ExactProduct.launches == launched  # no case ran
    assert again.ok and again.form == 2 and again.detail == first.detail and passed_checks.recalled(again)
    assert isinstance(ep._kernels["fake"], ExactProduct)  # built, as a pass leaves it
    assert mx.array_equal(ep.product(module, x, measuring=True), served)


def test_another_kernel_source_checks_again_and_replaces_the_entry(exact_gpu, monkeypatch):
    ep.checked("fake", VARIANT)
    launched = ExactProduct.launches
    monkeypatch.setattr(ExactProduct, "SOURCE", "y = x . w, edited")
    next_process(ep)
    assert ep.checked("fake", VARIANT).ok and ExactProduct.launches > launched
    assert len(json.loads(passed_checks.current().path.read_text())["passed"]) == 1


@pytest.mark.parametrize("change", ["mlx", "device", "os"])
def test_another_mlx_version_device_or_os_checks_again(exact_gpu, monkeypatch, change):
    from dflash_mlx.kernels import decisions

    ep.checked("fake", VARIANT)
    launched = ExactProduct.launches
    if change == "mlx":
        monkeypatch.setattr(mx, "__version__", "0.0.0")
    elif change == "device":
        monkeypatch.setattr(decisions, "device_name", lambda: "another GPU")
    else:
        monkeypatch.setattr(passed_checks.platform, "platform", lambda: "another-os-1.0")
    next_process(ep)
    assert ep.checked("fake", VARIANT).ok and ExactProduct.launches > launched


@pytest.mark.parametrize(
    "written, why",
    [
        ("{not json", "not readable JSON"),
        ('{"format": "dflash-mlx kernel checks", "version": 99}', "not a kernel checks file of this version"),
        ("foreign", "checked on another machine"),
        ("malformed", "an entry is malformed"),
    ],
)
def test_a_damaged_or_foreign_file_is_ignored_with_a_warning_and_checked_again(exact_gpu, written, why):
    ep.checked("fake", VARIANT)
    path = passed_checks.current().path
    state = json.loads(path.read_text())
    if written == "foreign":
        state["machine"] = dict(state["machine"], device="another GPU")
        written = json.dumps(state)
    elif written == "malformed":
        state["passed"][0]["result"] = "passed"
        written = json.dumps(state)
    path.write_text(written)
    launched = ExactProduct.launches
    next_process(ep)
    with pytest.warns(RuntimeWarning, match=rf"ignoring the kernel checks remembered in .*{why}"):
        assert ep.checked("fake", VARIANT).ok
    assert ExactProduct.launches > launched
    next_process(ep)  # the check's pass was written over what was ignored
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert passed_checks.recalled(ep.checked("fake", VARIANT))


def test_a_failure_is_not_kept_and_forgets_a_pass_whose_form_is_no_longer_tried(exact_gpu, monkeypatch):
    ep.checked("fake", VARIANT)
    monkeypatch.setitem(ep.FORMS, "fake", (1,))  # form 2 no longer tried: the kept pass no longer fits
    for _ in range(2):
        launched = ExactProduct.launches
        next_process(ep)
        with pytest.warns(RuntimeWarning, match="failed its self-check"):
            assert not ep.checked("fake", VARIANT).ok
        assert ExactProduct.launches > launched
        assert json.loads(passed_checks.current().path.read_text())["passed"] == []


def test_a_stand_in_whose_builder_takes_no_factory_is_never_kept(exact_gpu, monkeypatch):
    monkeypatch.setitem(ep.BUILDERS, "fake", lambda where: ExactProduct(where))
    assert ep.checked("fake", VARIANT).ok
    assert not passed_checks.current().path.exists()


def test_nothing_is_kept_without_auto_memory(exact_gpu, monkeypatch):
    monkeypatch.setenv("DFLASH_MLX_AUTO_MEMORY", "off")
    next_process(ep)
    ep.checked("fake", VARIANT)
    launched = ExactProduct.launches
    next_process(ep)
    assert ep.checked("fake", VARIANT).ok and ExactProduct.launches > launched
    assert passed_checks.current().path is None


class Attention:
    """A block-attention kernel computing as MLX's ops (bit for bit); counts its launches."""

    launches = 0

    def __init__(self, where, factory=None):
        built_from("partial and merge", factory)

    def __call__(self, q, k, v, **kw):
        Attention.launches += 1
        if "tree" in kw:
            return dispatch.ops_tree_attention(q, k, v, **{n: a for n, a in kw.items() if n != "causal"})
        return ops_attention(q, k, v, **kw)


def test_block_attentions_result_is_restored_and_a_trees_is_its_own(monkeypatch):
    dispatch.reset()
    monkeypatch.setitem(dispatch.BUILDERS, "fake", Attention)
    monkeypatch.setattr(Attention, "launches", 0)
    try:
        assert dispatch.checked_kernel("fake", mx.float16, 64, True) is not None
        first = dispatch._checks[("fake", mx.float16, 64, True)]
        launched = Attention.launches
        next_process(dispatch)
        assert isinstance(dispatch.checked_kernel("fake", mx.float16, 64, True), Attention)
        again = dispatch._checks[("fake", mx.float16, 64, True)]
        assert Attention.launches == launched and again == first and again.bit_equal
        assert passed_checks.recalled(again)
        assert dispatch.checked_kernel("fake", mx.float16, 64, True, tree=True) is not None
        assert Attention.launches > launched  # the tree variant was never checked: it is
        assert dispatch._tree_checks[("fake", mx.float16, 64, True)].tree
    finally:
        dispatch.reset()


class Quantized:
    """A quantized product equal to MLX's one-row products only with its dequantization fused."""

    launches = 0

    def __init__(self, where, factory=None):
        built_from("dequantize, multiply", factory)

    def __call__(self, x, weight, scales, biases, *, bits, group, mode, fused=False):
        Quantized.launches += 1
        y = qp.one_row_products(x, weight, scales, biases, bits=bits, group=group, mode=mode)
        return y if fused else y + 1


def test_a_quantized_products_dequantization_is_restored(monkeypatch):
    """quantized.py keeps its pass without a change of its own: through CheckedVariants and first_exact."""
    qp.reset()
    monkeypatch.setitem(qp.BUILDERS, "fake", Quantized)
    monkeypatch.setitem(qp.DEQUANTIZATIONS, "fake", (False, True))
    monkeypatch.setattr(Quantized, "launches", 0)
    dense = nn.Linear(512, 64, bias=False)
    dense.set_dtype(mx.bfloat16)
    variant = qp.variant_of(nn.QuantizedLinear.from_linear(dense, group_size=64, bits=4), mx.bfloat16)
    try:
        assert qp.checked("fake", variant).fused
        launched = Quantized.launches
        next_process(qp)
        again = qp.checked("fake", variant)
        assert again.ok and again.fused and Quantized.launches == launched and "fake" in qp._kernels
    finally:
        qp.reset()


def test_doctor_says_which_passes_it_remembered_and_rechecks_on_request(monkeypatch):
    """The block-attention variants on a pretend GPU: checked, then remembered, then checked again on request."""
    dispatch.reset()
    monkeypatch.setattr(dispatch, "backend", lambda: "fake")
    monkeypatch.setattr("dflash_mlx.kernels.backend", lambda: "fake")
    monkeypatch.setitem(dispatch.BUILDERS, "fake", Attention)
    outs = []
    try:
        for args in ((), (), ("--recheck",)):
            next_process(dispatch)
            outs.append(run_doctor("--seconds", "0", *args))
    finally:
        dispatch.reset()
    statuses = [re.findall(r"^  check \w+ d\d+(?: win)? +(ok \(remembered\)|ok|FAILED)", out, re.M) for out in outs]
    assert [set(s) for s in statuses] == [{"ok"}, {"ok (remembered)"}, {"ok"}] and len(statuses[1]) == 18
    assert "18 of 18 passed (18 remembered from earlier checks here)" in outs[1]
    assert "--recheck checks it" in outs[0] and "remembered from earlier" not in outs[2]


def test_doctor_recheck_on_a_home_it_cannot_write_says_so_in_a_sentence(monkeypatch):
    """A kept file that cannot be removed: one sentence naming the fix, exit 1, no traceback."""
    from pathlib import Path

    from typer.testing import CliRunner

    from dflash_mlx.cli.app import app

    path = passed_checks.path_here()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{}")

    def refused(self, missing_ok=False):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "unlink", refused)
    result = CliRunner().invoke(app, ["doctor", "--seconds", "0", "--recheck"])
    assert result.exit_code == 1
    assert "cannot forget the kernel checks kept in" in result.output and "DFLASH_MLX_HOME" in result.output
    assert "Traceback" not in result.output
