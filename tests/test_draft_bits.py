"""The drafter's precision (draft/precision.py): quantized at load to 4 or 8
bits, kept as stored, or decided per machine by measurement (``auto``);
output is the target's own greedy decoding whatever the drafter's precision."""

from __future__ import annotations

import json
import random

import mlx.core as mx
import mlx.nn as nn
import pytest
from convert_fixtures import TCFG, assert_clean_failure, zlab_draft
from mlx_lm.utils import quantize_model
from tiny import (
    draft_config,
    greedy_reference,
    make_draft,
    make_target,
    make_tokenizer,
    random_draft_weights,
    target_config,
    write_target,
)
from typer.testing import CliRunner

from dflash_mlx import load, stream_generate
from dflash_mlx.cli.app import app
from dflash_mlx.convert.weights import convert
from dflash_mlx.draft import precision
from dflash_mlx.kernels import decisions
from dflash_mlx.targets import adapt

MACHINE = {"backend": "metal", "device": "Apple M4 Max", "mlx": "0.32.4"}


def pair_dirs(tmp_path, bits: int | None = None, seed: int = 0):
    """A tiny target directory (quantized to ``bits``) and its drafter's."""
    model = make_target(TCFG, seed=seed)
    cfg = dict(TCFG)
    if bits:
        model, cfg = quantize_model(model, cfg, 64, bits)
    target = write_target(tmp_path / f"target-{bits}", cfg, model, make_tokenizer(TCFG["vocab_size"]))
    return target, zlab_draft(tmp_path / "draft", block_size=8)


def dense_linears(module: nn.Module) -> list[str]:
    return [name for name, m in module.named_modules() if type(m) is nn.Linear]


def decoded(model, draft, tokenizer, prompt, max_tokens=24):
    responses = stream_generate(model, draft, tokenizer, prompt, max_tokens=max_tokens, block_size=8)
    return [t for r in responses for t in r.tokens]


@pytest.mark.parametrize("target_bits", [None, 4])
def test_greedy_output_is_the_targets_at_every_draft_width(tmp_path, target_bits):
    target, drafter = pair_dirs(tmp_path, target_bits)
    rng = random.Random(7)
    prompts = [[rng.randrange(TCFG["vocab_size"] - 1) for _ in range(n)] for n in (3, 40)]
    for draft_bits in (None, 8, 4, "auto"):
        model, draft, tokenizer = load(target, draft=drafter, draft_bits=draft_bits)
        for prompt in prompts:
            assert decoded(model, draft, tokenizer, prompt) == greedy_reference(model, prompt, 24), draft_bits


def test_quantized_layers_and_the_shared_embedding_and_head_untouched(tmp_path):
    target, drafter = pair_dirs(tmp_path)
    model, stored, _ = load(target, draft=drafter, draft_bits=None)
    _, draft, _ = load(target, draft=drafter, draft_bits=4)
    assert dense_linears(draft) == [] and precision.bits_of(draft) == 4
    assert {m.group_size for _, m in draft.named_modules() if isinstance(m, nn.QuantizedLinear)} == {64}
    # norms stay as stored; the embedding and head are the target's, dense
    assert mx.array_equal(draft.norm.weight, stored.norm.weight).item()
    assert type(draft.target.model.model.embed_tokens) is nn.Embedding
    assert mx.array_equal(draft.target.model.model.embed_tokens.weight, model.model.embed_tokens.weight).item()
    assert "embed_tokens" not in str([name for name, _ in draft.named_modules()])


def test_the_group_follows_each_layers_input_size():
    # hidden 48: q/k/v/o/gate/up (input 48) fit no group; fc (2 taps) and down (input 96) take 32
    tcfg = target_config("qwen3", vocab=32, hidden=48)
    dcfg = draft_config(tcfg, layers=2)
    draft = precision.quantize(make_draft(dcfg, random_draft_weights(dcfg)), 8)
    groups = {name: m.group_size for name, m in draft.named_modules() if isinstance(m, nn.QuantizedLinear)}
    assert groups == {"fc": 32, "layers.0.mlp.down_proj": 32, "layers.1.mlp.down_proj": 32}
    kept = (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
    )
    assert set(dense_linears(draft)) == {f"layers.{i}.{p}" for i in (0, 1) for p in kept}


def bound_draft(seed: int = 4):
    model = make_target(TCFG, seed=3)
    dcfg = draft_config(TCFG, layers=2, block_size=8)
    return model, make_draft(dcfg, random_draft_weights(dcfg, seed=seed)).bind(adapt(model))


def test_the_timed_forward_runs_the_drafter_itself():
    _, draft = bound_draft()
    same = precision.forward(precision.copy(draft))()
    assert mx.array_equal(same, precision.forward(draft)()).item()
    quantized = precision.forward(precision.copy(draft, 8))()
    assert not mx.array_equal(quantized, same).item() and mx.allclose(quantized, same, atol=0.1).item()
    assert precision.bits_of(draft) is None  # the copy was quantized, not the drafter


def quantized_target():
    model, draft = bound_draft()
    nn.quantize(model, group_size=64, bits=4)
    return model, draft


def test_auto_never_takes_a_slower_width_and_remembers(tmp_path, measured):
    model, draft = quantized_target()
    timed = measured(ours_ms=2.0, mlx_ms=1.0)
    assert precision.apply(draft, model, "auto") is None and precision.bits_of(draft) is None
    assert len(timed) == 2  # 8 bits and the target's 4, each once
    decisions.reset()
    assert precision.apply(draft, model, "auto") is None and len(timed) == 2


def test_auto_takes_a_faster_width_and_remembers(measured):
    model, draft = quantized_target()
    timed = measured(ours_ms=1.0, mlx_ms=2.0)
    assert precision.apply(draft, model, "auto") == 4  # a tie between widths: the fewer bytes
    assert precision.bits_of(draft) == 4 and dense_linears(draft) == []
    decisions.reset()
    _, again = quantized_target()
    assert precision.apply(again, model, "auto") == 4 and len(timed) == 2
    (found, *_) = decisions.current().all()
    assert found.kernel == precision.DECISION and found.faster


def store_with(draft, times: dict[int, float], stored: float = 1.0) -> decisions.Decisions:
    store = decisions.Decisions(None, "measure", MACHINE)
    for bits, ours in times.items():
        store.record(decisions.Decision(precision.DECISION, precision.case(draft, bits), ours, stored))
    return store


def test_auto_takes_the_fastest_of_the_faster_widths():
    model, draft = quantized_target()
    assert precision.choose(draft, model, store_with(draft, {8: 0.5, 4: 0.7})) == 8
    assert precision.choose(draft, model, store_with(draft, {8: 1.5, 4: 0.7})) == 4
    assert precision.choose(draft, model, store_with(draft, {8: 0.99, 4: 0.99})) is None  # a tie keeps it


def test_policies_and_a_dense_target(measured, monkeypatch):
    model, draft = quantized_target()
    never = decisions.Decisions(None, "off", MACHINE)
    assert precision.choose(draft, model, never) is None
    assert precision.choose(draft, model, decisions.Decisions(None, "on", MACHINE)) is None  # a strategy
    timed = measured(ours_ms=1.0, mlx_ms=2.0)
    dense, other = bound_draft()
    assert precision.apply(other, dense, "auto") is None and timed == []  # beside a dense target: as stored


@pytest.mark.parametrize("bad", [5, 16, "8", True, "fast"])
def test_bad_widths_are_refused_in_one_sentence(tmp_path, bad):
    target, drafter = pair_dirs(tmp_path)
    with pytest.raises(ValueError, match=r"^draft_bits must be None \(as stored\), 4, 8 or 'auto', got .*\.$"):
        load(target, draft=drafter, draft_bits=bad)


@pytest.mark.parametrize("bad", ["5", "bf16", ""])
def test_the_cli_refuses_a_bad_width(tmp_path, bad):
    target, drafter = pair_dirs(tmp_path)
    args = ["generate", "--model", str(target), "--draft-model", str(drafter), "--draft-bits", bad, "-p", "hi"]
    result = CliRunner().invoke(app, args)
    assert_clean_failure(result, "--draft-bits must be 4, 8, 16 (as stored) or auto, got")


def test_a_drafter_quantized_on_disk_is_kept(tmp_path):
    target, _ = pair_dirs(tmp_path)
    converted = convert(zlab_draft(tmp_path / "d", block_size=8), tmp_path / "q", quantize=True, q_bits=8)
    _, stored, _ = load(target, draft=converted, draft_bits=None)
    for kept in (8, "auto"):
        _, draft, _ = load(target, draft=converted, draft_bits=kept)
        assert precision.bits_of(draft) == 8
        assert mx.array_equal(draft.fc.weight, stored.fc.weight).item()
    with pytest.raises(
        ValueError, match=r"stored quantized to 8 bits .* pass draft_bits=None or 8, or its unquantized"
    ):
        load(target, draft=converted, draft_bits=4)


@pytest.mark.parametrize("target_bits, flags, want", [(None, [], 16), (4, [], 16), (4, ["--draft-bits", "8"], 8)])
def test_bench_reports_the_drafters_width(tmp_path, target_bits, flags, want):
    # conftest's DFLASH_MLX_KERNELS=on: auto keeps the drafter as stored, as any strategy does unmeasured
    target, drafter = pair_dirs(tmp_path, target_bits)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "w1 w2"}\n')
    args = ["bench", "--model", str(target), "--draft-model", str(drafter), "--prompts", str(prompts), *flags]
    result = CliRunner().invoke(app, [*args, "-m", "4", "--block-size", "4", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["draft_bits"] == want


def test_a_dflash2_drafter_quantizes_and_stays_lossless(tmp_path):
    from test_dflash2 import TCFG as TCFG2
    from test_dflash2 import dflash2_config, random_dflash2_weights
    from tiny import write_zlab_draft

    model = make_target(TCFG2, seed=11)
    target = write_target(tmp_path / "t", TCFG2, model, make_tokenizer(TCFG2["vocab_size"]))
    cfg = dflash2_config(TCFG2)
    drafter = write_zlab_draft(tmp_path / "d", cfg, random_dflash2_weights(cfg))
    prompt = [random.Random(3).randrange(TCFG2["vocab_size"] - 1) for _ in range(20)]
    for draft_bits in (8, 4):
        model, draft, tokenizer = load(target, draft=drafter, draft_bits=draft_bits)
        assert precision.bits_of(draft) == draft_bits
        assert type(draft.candidate_selector.successor_codebook) is nn.Embedding
        responses = stream_generate(model, draft, tokenizer, prompt, max_tokens=24, block_size=6)
        assert [t for r in responses for t in r.tokens] == greedy_reference(model, prompt, 24)
