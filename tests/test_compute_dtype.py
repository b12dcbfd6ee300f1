"""The dtype a pair computes in (compute_dtype.py): load's ``dtype`` and
the CLI's --dtype, float32 on a CPU whose products run on a fast BLAS, and
the compiled cycle that goes with it there."""

import shutil

import mlx.core as mx
import mlx.nn as nn
import pytest
from convert_fixtures import assert_clean_failure
from mlx.utils import tree_flatten
from tiny import (
    draft_config,
    greedy_reference,
    lean_towards_one_token,
    make_target,
    make_tokenizer,
    random_draft_weights,
    target_config,
    write_target,
    write_zlab_draft,
)
from typer.testing import CliRunner

from dflash_mlx import compute_dtype, fast_blas, load, stream_generate
from dflash_mlx.auto import memory as block_memory
from dflash_mlx.cache.prompt import PromptCache
from dflash_mlx.cli.app import app
from dflash_mlx.decode.cycle import Cycle
from dflash_mlx.decode.sampling import SamplingParams
from dflash_mlx.targets import adapt


@pytest.fixture(scope="module")
def bf16_pair(tmp_path_factory):
    """A tiny pair stored in bfloat16, as published checkpoints are."""
    root = tmp_path_factory.mktemp("bf16-pair")
    tcfg = target_config("qwen3", vocab=32, layers=4)
    model = lean_towards_one_token(make_target(tcfg, seed=3), 0.3)
    model.set_dtype(mx.bfloat16)
    write_target(root / "target", tcfg, model, make_tokenizer(32))
    dcfg = draft_config(tcfg, layers=2, block_size=6, taps=[0, 2])
    write_zlab_draft(root / "draft", dcfg, random_draft_weights(dcfg, seed=4))
    return str(root / "target"), str(root / "draft")


@pytest.fixture
def fast(monkeypatch):
    """As if dflash_mlx had opened OpenBLAS for MLX in this process."""
    monkeypatch.setattr(fast_blas, "loaded", "libopenblas.so.0")


@pytest.fixture
def reference(monkeypatch):
    """MLX's own BLAS: nothing opened, nothing preloaded."""
    monkeypatch.setattr(fast_blas, "loaded", None)
    monkeypatch.delenv("LD_PRELOAD", raising=False)


def dtypes(*modules) -> set:
    return {a.dtype for m in modules for _, a in tree_flatten(m.parameters()) if mx.issubdtype(a.dtype, mx.floating)}


def test_auto_keeps_the_weights_dtype_without_a_fast_blas(bf16_pair, reference):
    model, draft, _ = load(*bf16_pair)
    assert dtypes(model, draft) == {mx.bfloat16}
    assert compute_dtype.computing(model) == mx.bfloat16


def test_auto_computes_in_float32_on_a_cpu_with_a_fast_blas_and_decodes_the_targets_own_greedy(bf16_pair, fast):
    model, draft, tok = load(*bf16_pair)
    assert dtypes(model, draft) == {mx.float32}
    prompt = [3, 1, 4, 1, 5]
    for block in (2, 6, "auto"):
        got = [t for r in stream_generate(model, draft, tok, prompt, max_tokens=40, block_size=block) for t in r.tokens]
        assert got == greedy_reference(model, prompt, 40), block


def test_auto_keeps_the_dtype_where_a_float32_copy_would_crowd_memory(bf16_pair, fast, monkeypatch):
    monkeypatch.setattr(compute_dtype, "memory_bytes", lambda: 64 * 1024)
    model, draft, _ = load(*bf16_pair)
    assert dtypes(model, draft) == {mx.bfloat16}


def test_auto_keeps_a_quantized_targets_dtype(bf16_pair, fast):
    model, draft, _ = load(*bf16_pair, dtype="bfloat16")
    nn.quantize(model, group_size=32, bits=4)
    assert compute_dtype.auto(model, draft) is None
    assert compute_dtype.apply(model, draft) == mx.bfloat16


@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
def test_a_named_dtype_is_what_both_models_compute_in(bf16_pair, fast, dtype):
    model, draft, _ = load(*bf16_pair, dtype=dtype)
    assert dtypes(model, draft) == {getattr(mx, dtype)}


def test_an_unknown_dtype_is_refused_before_anything_loads(tmp_path):
    with pytest.raises(ValueError, match=r"unknown dtype 'float64'; pass dtype= auto, float32, bfloat16 or float16"):
        load(tmp_path / "nowhere", draft=tmp_path / "nothing", dtype="float64")
    result = CliRunner().invoke(
        app,
        ["generate", "--model", str(tmp_path / "nowhere"), "--dtype", "float64", "-p", "a"],
        prog_name="dflash-mlx",
        env={"COLUMNS": "200"},
    )
    assert_clean_failure(result, "unknown dtype 'float64'", "--dtype auto, float32, bfloat16 or float16")


def test_the_cli_decodes_in_the_dtype_it_is_given(bf16_pair, reference):
    target, draft_dir = bf16_pair

    def cli(*args):
        return CliRunner().invoke(
            app,
            [
                "generate",
                "--model",
                target,
                "--draft-model",
                draft_dir,
                "--ignore-chat-template",
                "-p",
                "w3 w1 w4",
                "-m",
                "24",
                "--block-size",
                "4",
                *args,
            ],
            prog_name="dflash-mlx",
            env={"COLUMNS": "200"},
        )

    for dtype in ("float32", "bfloat16"):
        result = cli("--dtype", dtype)
        assert result.exit_code == 0, result.output
        model, draft, tok = load(target, draft=draft_dir, dtype=dtype)
        want = tok.decode(greedy_reference(model, tok.encode("w3 w1 w4"), 24))
        assert result.stdout.strip() == want.strip(), dtype


def test_the_cli_says_when_auto_computes_in_float32(bf16_pair, fast):
    target, draft_dir = bf16_pair

    def cli(*args):
        return CliRunner().invoke(
            app,
            [
                "generate",
                "--model",
                target,
                "--draft-model",
                draft_dir,
                "--ignore-chat-template",
                "-p",
                "w3 w1",
                "-m",
                "4",
                *args,
            ],
            prog_name="dflash-mlx",
            env={"COLUMNS": "200"},
        )

    said = "computing in float32: this CPU's matrix products run on OpenBLAS"
    result = cli()
    assert result.exit_code == 0 and said in result.stderr, result.output
    result = cli("--dtype", "bfloat16")
    assert result.exit_code == 0 and said not in result.stderr, result.output


def test_a_cpu_with_a_fast_blas_compiles_its_cycles(bf16_pair, monkeypatch):
    model, draft, _ = load(*bf16_pair, dtype="float32")
    monkeypatch.setattr(Cycle, "compile_graphs", None)

    def compiled() -> bool:
        return Cycle(adapt(model), draft, PromptCache(model, draft), SamplingParams(), 0).compiled

    monkeypatch.setattr(fast_blas, "loaded", None)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert not compiled()
    monkeypatch.setattr(fast_blas, "loaded", "libopenblas.so.0")
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/" + name)
    assert compiled()
    monkeypatch.setattr(shutil, "which", lambda name: None)  # MLX builds the CPU's fused kernels with g++
    assert not compiled()
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/" + name)
    model, draft, _ = load(*bf16_pair, dtype="bfloat16")  # its products do not reach the BLAS: no gain to build for
    assert not compiled()


def test_autos_memory_is_kept_apart_by_dtype(bf16_pair, reference):
    """Cycle costs on a CPU differ by dtype: what one learned does not start the other."""
    keys = set()
    for dtype in ("bfloat16", "float32"):
        model, draft, _ = load(*bf16_pair, dtype=dtype)
        keys.add(block_memory.fingerprint(adapt(model), draft, 1, 6))
    assert len(keys) == 2
