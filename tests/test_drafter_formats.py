"""Every published drafter format: the same weights written in Z Lab's layout,
vllm-project/speculators' (DFlash and DFlash 2, a reduced draft vocabulary
included) and a transformers-native assistant's load, convert, and draft the
same blocks, so each cycle accepts exactly what Z Lab's layout accepts; the
text is the target's greedy text; a bad config fails in one sentence.

The fixtures carry each published config's field set at tiny dimensions:
speculators' as its DFlashSpeculatorConfig serializes (the backbone under
transformer_layer_config, Qwen3 defaults left out), the assistant's as Z Lab's
tests/fixtures/assistant-config.json."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from convert_fixtures import PUBLISHED, assert_clean_failure, assistant_files, cli, published_drafter, speculators_files
from mlx.utils import tree_flatten
from test_dflash2 import dflash2_config, random_dflash2_weights
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

from dflash_mlx import load, load_draft, stream_generate
from dflash_mlx.convert.weights import convert
from dflash_mlx.draft import formats
from dflash_mlx.draft.dflash2 import CODEBOOKS, codebook_rows
from dflash_mlx.loading import (
    FAMILIES,
    KNOWN_PAIRS,
    check_target,
    drafter_format,
    is_drafter_config,
    known_pairs,
)
from dflash_mlx.targets import adapt

TCFG = target_config("qwen3", vocab=48, layers=6)
MASK = 47
# Tokens outside the reduced draft vocabulary. Their rows of the target's head
# are midpoints of two other rows, so no head ranks one strictly first: a
# drafter over the full vocabulary never drafts them either, and the reduced
# one must draft exactly the same blocks.
EXCLUDED = (3, 10, 17, 25, 33, 40)
INCLUDED = [t for t in range(TCFG["vocab_size"]) if t not in EXCLUDED]
PROMPTS = [[1, 5, 9, 2, 30], [7, 7, 12, 44, 8, 19, 2], [20, 3, 46, 11]]


def formats_target():
    model = lean_towards_one_token(make_target(TCFG, seed=11), 1.1)
    head = model.lm_head.weight
    for n, e in enumerate(EXCLUDED):
        a, b = INCLUDED[2 * n], INCLUDED[2 * n + 1]
        head[e] = (head[a] + head[b]) / 2
    model.lm_head.weight = head
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def target():
    return formats_target()


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, target):
    return write_target(tmp_path_factory.mktemp("formats") / "target", TCFG, target, make_tokenizer(48))


def zlab_v1_config(**extra) -> dict:
    """Non-causal (as the assistant always is), one sliding layer."""
    cfg = draft_config(TCFG, layers=2, block_size=6, taps=[1, 4], mask_token_id=MASK, **extra)
    cfg.update(layer_types=["sliding_attention", "full_attention"], sliding_window=8, is_causal=False)
    return cfg


def write_speculators(path: Path, zcfg: dict, weights: dict, model, *, reduced: bool = True, **kw) -> Path:
    """A speculators checkpoint for the target ``model``: its embedding and
    the head rows of the draft vocabulary (``reduced`` False: all of it)."""
    kept = kw.pop("kept", INCLUDED) if reduced else None
    return speculators_files(path, zcfg, weights, model.model.embed_tokens.weight, model.lm_head.weight, kept, **kw)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory, target):
    """One v1 drafter in every layout: name -> directory."""
    root = tmp_path_factory.mktemp("layouts")
    zcfg = zlab_v1_config()
    weights = random_draft_weights(zcfg, seed=3)
    return {
        "zlab": write_zlab_draft(root / "zlab", zcfg, weights, dtype=mx.float32),
        "speculators": write_speculators(root / "spec", zcfg, weights, target),
        "speculators-full": write_speculators(root / "spec-full", zcfg, weights, target, reduced=False),
        "assistant": assistant_files(root / "assistant", zcfg, weights),
        "assistant-flat": assistant_files(root / "assistant-flat", zcfg, weights, prefix=""),
        # Miswired on purpose: Z Lab's layer ids written as aux ids (one layer early).
        "off-by-one": write_speculators(root / "off", zcfg, weights, target, aux_hidden_state_layer_ids=[1, 4]),
    }


def cycles(model, draft, prompt, max_tokens=32):
    """(tokens, [(block size, accepted) per cycle]) of a greedy run."""
    tokens, steps = [], []
    for r in stream_generate(
        model, draft, make_tokenizer(48), prompt, max_tokens=max_tokens, block_size=draft.config.block_size
    ):
        tokens += r.tokens
        if r.block_size > 1:
            steps.append((r.block_size, r.accepted))
    return tokens, steps


# -- detection and loading -----------------------------------------------------------------


def test_each_layout_is_detected_by_its_contract(layouts):
    read = {name: json.loads((path / "config.json").read_text()) for name, path in layouts.items()}
    assert formats.drafter_format(read["zlab"]) == formats.ZLAB
    assert formats.drafter_format(read["speculators"]) == formats.SPECULATORS
    assert formats.drafter_format(read["assistant"]) == formats.ASSISTANT
    # The contract, not the model_type, makes an assistant a drafter.
    renamed = {**read["assistant"], "model_type": "some_new_assistant", "architectures": ["SomeAssistantModel"]}
    assert formats.drafter_format(renamed) == formats.ASSISTANT and is_drafter_config(renamed)
    plain = {k: v for k, v in read["assistant"].items() if k != "target_layer_ids"}
    assert formats.drafter_format(plain) is None and not is_drafter_config(plain)
    assert formats.drafter_format({**read["speculators"], "speculators_model_type": "eagle3"}) is None


def test_speculators_config_reads_as_zlab(layouts):
    zlab = load_draft(layouts["zlab"]).config
    spec = load_draft(layouts["speculators"]).config
    # aux id = Z Lab layer + 1; Qwen3's left-out defaults filled back in.
    assert spec.target_layer_ids == zlab.target_layer_ids == [1, 4]
    assert spec.rms_norm_eps == zlab.rms_norm_eps and spec.rope_theta == zlab.rope_theta
    assert spec.block_size == 6 and spec.mask_token_id == MASK and spec.is_causal is False
    assert spec.draft_vocab_size == len(INCLUDED) and spec.num_target_layers is None
    full = load_draft(layouts["speculators-full"]).config
    assert full.draft_vocab_size is None  # a full vocabulary shares the target's head
    assistant = load_draft(layouts["assistant"]).config
    assert assistant.target_layer_ids == [1, 4] and assistant.is_causal is False
    assert assistant.vocab_size is None and assistant.num_target_layers is None


def test_sliding_causality_follows_the_speculators_flag(tmp_path, target):
    zcfg = draft_config(TCFG, layers=2, block_size=6, taps=[1, 4], mask_token_id=MASK)
    zcfg.update(layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    weights = random_draft_weights(zcfg, seed=4)
    causal = load_draft(write_speculators(tmp_path / "causal", zcfg, weights, target))
    assert causal.config.is_causal is None  # sliding layers causal in the block, full ones not
    assert [layer.self_attn.causal for layer in causal.layers] == [True, False]
    zlab = load_draft(write_zlab_draft(tmp_path / "zlab", zcfg, weights, dtype=mx.float32))
    assert [layer.self_attn.causal for layer in zlab.layers] == [True, False]


def test_saved_or_absent_verifier_tensors_load_alike(tmp_path, layouts, target):
    """A full-vocabulary speculators drafter drafts through the target's head
    whether its embedding and head copies are saved, absent, or joined by
    the trainer's verifier_lm_head / verifier_norm."""
    src = layouts["speculators-full"]
    bare = _edited(tmp_path, src, None, lambda w: (w.pop("lm_head.weight"), w.pop("embed_tokens.weight")))
    extra = _edited(
        tmp_path,
        src,
        None,
        lambda w: w.update({"verifier_lm_head.weight": w["lm_head.weight"], "verifier_norm.weight": mx.ones((64,))}),
    )
    bound = adapt(target)
    mx.random.seed(0)
    taps = mx.random.normal((1, 9, 2 * TCFG["hidden_size"]))
    block = mx.array([[5] + [MASK] * 5])
    want = load_draft(layouts["zlab"]).bind(bound)
    want = want(block, taps, want.make_cache())
    for path in (src, bare, extra):
        draft = load_draft(path).bind(bound)
        assert not hasattr(draft, "lm_head")
        assert mx.array_equal(draft(block, taps, draft.make_cache()), want).item()


def test_reduced_vocabulary_logits_are_the_targets_over_its_tokens(layouts, target):
    bound = adapt(target)
    zlab, spec = load_draft(layouts["zlab"]).bind(bound), load_draft(layouts["speculators"]).bind(bound)
    mx.random.seed(0)
    taps = mx.random.normal((1, 9, 2 * TCFG["hidden_size"]))
    block = mx.array([[5] + [MASK] * 5])
    a = zlab(block, taps, zlab.make_cache())[0]
    b = spec(block, taps, spec.make_cache())[0]
    inside, outside = mx.array(INCLUDED), mx.array(EXCLUDED)
    assert mx.allclose(a[:, inside], b[:, inside], atol=1e-5).item()
    assert mx.all(b[:, outside] == -mx.inf).item()
    assert mx.array_equal(mx.argmax(a, -1), mx.argmax(b, -1)).item()


def test_other_layouts_match_the_official_code(layouts, target, monkeypatch):
    """The official Z Lab MLX code on the Z Lab layout is the oracle: the
    speculators (reduced vocabulary) and assistant layouts of the same
    weights give its logits over their tokens, context cached in steps."""
    from mlx_lm.models.cache import make_prompt_cache
    from test_dflash2 import official_load_draft

    theirs = official_load_draft(layouts["zlab"], monkeypatch).bind(target)
    bound = adapt(target)
    ours = {name: load_draft(layouts[name]).bind(bound) for name in ("speculators", "assistant")}
    caches = {name: d.make_cache() for name, d in ours.items()}
    their_cache = make_prompt_cache(theirs)
    inside = mx.array(INCLUDED)
    mx.random.seed(2)
    # Within the sliding window (8), where the official rotating cache and ours hold the same keys.
    for ctx, anchor in ((4, 5), (2, 12), (1, 30)):
        taps = mx.random.normal((1, ctx, 2 * TCFG["hidden_size"]))
        block = mx.array([[anchor] + [MASK] * 5])
        want = theirs(block, taps, their_cache, logits_start=1)[0]
        for name, draft in ours.items():
            got = draft(block, taps, caches[name])[0]
            assert mx.allclose(got[:, inside], want[:, inside], rtol=1e-4, atol=1e-4).item(), name


def test_every_layout_accepts_the_same_counts_cycle_by_cycle(layouts, target):
    """The key test: text alone cannot show a miswired drafter."""
    drafters = {name: load_draft(path) for name, path in layouts.items()}
    runs = {name: [cycles(target, d, p) for p in PROMPTS] for name, d in drafters.items()}
    by_zlab = [sampled(target, drafters["zlab"], p) for p in PROMPTS]
    want = [greedy_reference(target, p, 32) for p in PROMPTS]
    for name, results in runs.items():
        for prompt, (tokens, steps) in zip(PROMPTS, results):
            assert tokens == want[PROMPTS.index(prompt)], name
            if name != "off-by-one":
                assert steps == runs["zlab"][PROMPTS.index(prompt)][1], name
                assert sampled(target, drafters[name], prompt) == by_zlab[PROMPTS.index(prompt)], name
    # The counts say something: they vary, and a drafter tapping the wrong layers shows.
    accepted = {a for _, steps in runs["zlab"] for _, a in steps}
    assert len(accepted) >= 3, accepted
    assert [s for _, s in runs["off-by-one"]] != [s for _, s in runs["zlab"]]


def test_dflash2_layouts_accept_the_same_counts(tmp_path, target):
    """Greedy and seeded sampled runs: the selector's walk is the same in
    both layouts, so are the proposals, their q and what is accepted."""
    zcfg = _without_logit_scaling(dflash2_config(TCFG, taps=(1, 4), block_size=5))
    weights = random_dflash2_weights(zcfg, seed=5)
    zlab = load_draft(write_zlab_draft(tmp_path / "zlab", zcfg, weights, dtype=mx.float32))
    spec = load_draft(write_speculators(tmp_path / "spec", zcfg, weights, target, reduced=False))
    assert type(spec) is type(zlab) and spec.config.selector_top_k == zlab.config.selector_top_k
    seen = set()
    for prompt in PROMPTS:
        tokens, steps = cycles(target, spec, prompt)
        assert tokens == greedy_reference(target, prompt, 32)
        assert steps == cycles(target, zlab, prompt)[1]
        seen |= {a for _, a in steps}
        assert sampled(target, spec, prompt) == sampled(target, zlab, prompt)
    assert len(seen) >= 2, seen


def sampled(model, draft, prompt):
    run = stream_generate(
        model,
        draft,
        make_tokenizer(48),
        prompt,
        max_tokens=24,
        temperature=0.8,
        block_size=draft.config.block_size,
        seed=7,
    )
    return [(r.tokens, r.accepted) for r in run]


def _without_logit_scaling(zcfg: dict) -> dict:
    """The DFlash 2 fixture's config as speculators can hold it: no output
    multiplier or softcap; the mask token inside the draft vocabulary."""
    cfg = json.loads(json.dumps(zcfg))
    cfg["dflash_config"].pop("output_multiplier")
    cfg["dflash_config"].pop("final_logit_softcapping")
    cfg["dflash_config"]["mask_token_id"] = MASK
    return cfg


def test_dflash2_reduced_vocabulary_proposes_through_its_codebook_rows(tmp_path, target):
    """A speculators DFlash 2 drafter over a reduced vocabulary proposes what
    the same drafter over the full vocabulary proposes from the same logits
    with the tokens outside masked, its codebook rows looked up by draft id
    (and an outside anchor by the row before it, as speculators trains)."""
    zcfg = _without_logit_scaling(dflash2_config(TCFG, taps=(1, 4), block_size=5))
    weights = random_dflash2_weights(zcfg, seed=6)
    spec = load_draft(write_speculators(tmp_path / "spec", zcfg, weights, target))
    bound = adapt(target)
    spec.bind(bound)
    rows = codebook_rows(mx.array(INCLUDED), 48)
    assert rows[mx.array(INCLUDED)].tolist() == list(range(len(INCLUDED)))
    assert rows[3].item() == 2 and rows[10].item() == INCLUDED.index(9)
    # The full-vocabulary reference: the saved (draft-vocabulary) codebooks
    # expanded to one row per target token.
    full = {k: (v[mx.array(INCLUDED)][rows] if k in CODEBOOKS else v) for k, v in weights.items()}
    ref = load_draft(write_zlab_draft(tmp_path / "ref", zcfg, full, dtype=mx.float32)).bind(bound)
    mx.random.seed(1)
    taps = mx.random.normal((1, 7, 2 * TCFG["hidden_size"]))
    for anchor in (5, 3):  # inside and outside the draft vocabulary
        block = mx.array([[anchor] + [MASK] * 4])
        hidden = ref.hidden_states(block, taps, ref.make_cache())
        logits = ref.logits(hidden)
        masked = mx.where(mx.zeros((48,), mx.bool_).at[mx.array(INCLUDED)].add(True), logits, -mx.inf)
        want, _, _ = ref.candidate_selector(hidden.squeeze(0), masked.squeeze(0), block[0, 0])
        got, q = spec.propose(block, taps, spec.make_cache())
        assert got.tolist() == want.tolist() and q is None
        _, q = spec.propose(block, taps, spec.make_cache(), temperature=0.7, key=mx.random.key(3))
        assert mx.all(q[:, mx.array(EXCLUDED)] == 0).item() and mx.allclose(q.sum(-1), mx.ones(4)).item()
    for prompt in PROMPTS:
        assert cycles(target, spec, prompt)[0] == greedy_reference(target, prompt, 32)


def test_sampling_through_a_reduced_vocabulary_keeps_the_target_distribution(tmp_path):
    """stream_generate at temperature 1 with a speculators DFlash 2 drafter
    that never drafts token 3: sampled proposals over the target's vocabulary
    (zero outside the draft tokens), accepted by min(1, p/q); the sequences
    follow the target's own distribution, token 3 included."""
    from test_dflash2 import check_sequence_distribution

    tcfg = target_config("qwen3", vocab=6, layers=3, hidden=32)
    model = make_target(tcfg, seed=7)
    model.update({"model": {"norm": {"weight": mx.full((32,), 1.5)}}})
    cfg = dflash2_config(tcfg, layers=1, block_size=3, taps=(1,), mask_token_id=5, selector_top_k=3, selector_rank=16)
    cfg["dflash_config"].pop("output_multiplier")
    cfg["dflash_config"].pop("final_logit_softcapping")
    path = write_speculators(tmp_path / "d", cfg, random_dflash2_weights(cfg, seed=8), model, kept=[0, 1, 2, 4, 5])
    draft = load_draft(path)
    tok = make_tokenizer(6)
    seen = set()

    def sample(prompt, length, seed):
        responses = list(
            stream_generate(model, draft, tok, prompt, max_tokens=length, temperature=1.0, block_size=3, seed=seed)
        )
        tokens = [t for r in responses for t in r.tokens]
        seen.update(tokens)
        return (
            tokens,
            sum(r.accepted for r in responses[1:]),
            sum(r.accepted < r.block_size - 1 for r in responses[1:]),
        )

    check_sequence_distribution(model, sample)
    assert 3 in seen  # the target still says what its drafter cannot

    def seeded():
        run = stream_generate(model, draft, tok, [1, 2], max_tokens=12, temperature=1.0, block_size=3, seed=4)
        return [t for r in run for t in r.tokens]

    assert seeded() == seeded()


# -- converting each format ----------------------------------------------------------------


@pytest.mark.parametrize("name", ["speculators", "assistant"])
def test_convert_writes_zlab_layout_that_drafts_the_same(tmp_path, layouts, target, name):
    out = convert(layouts[name], tmp_path / "mlx")
    cfg = json.loads((out / "config.json").read_text())
    assert formats.drafter_format(cfg) == formats.ZLAB and "transformer_layer_config" not in cfg
    saved = mx.load(str(out / "model.safetensors"))
    assert "embed_tokens.weight" not in saved and "t2d" not in saved
    assert ("d2t" in saved) == (name == "speculators")
    if name == "speculators":
        assert saved["d2t"].dtype == mx.int32 and saved["lm_head.weight"].shape == (len(INCLUDED), 64)
    source = formats.SPECULATORS if name == "speculators" else formats.ASSISTANT
    assert f"({source} format)" in (out / "README.md").read_text()
    bound = adapt(target)
    a, b = load_draft(layouts[name]).bind(bound), load_draft(out).bind(bound)
    for (ka, va), (kb, vb) in zip(sorted(tree_flatten(a.parameters())), sorted(tree_flatten(b.parameters()))):
        assert ka == kb and mx.array_equal(va, vb).item(), ka
    assert cycles(target, b, PROMPTS[0])[1] == cycles(target, a, PROMPTS[0])[1]


def test_convert_quantizes_a_reduced_vocabulary_head(tmp_path, layouts, target):
    out = convert(layouts["speculators"], tmp_path / "q", quantize=True, q_bits=8, q_group_size=32)
    saved = mx.load(str(out / "model.safetensors"))
    assert "lm_head.scales" in saved and saved["d2t"].dtype == mx.int32
    draft = load_draft(out)
    for prompt in PROMPTS[:2]:
        assert cycles(target, draft, prompt)[0] == greedy_reference(target, prompt, 32)


def test_load_pairs_a_speculators_drafter_with_its_target(target_dir, layouts, target):
    model, draft, tok = load(target_dir, draft=layouts["speculators"])
    assert draft.config.draft_vocab_size == len(INCLUDED)
    prompt = PROMPTS[1]
    assert cycles(model, draft, prompt)[0] == greedy_reference(model, prompt, 32)
    with pytest.raises(ValueError, match="is a DFlash drafter, not a target model"):
        check_target(layouts["speculators"])


# -- bad configs: one sentence each ----------------------------------------------------------


def _edited(tmp_path: Path, src: Path, edit=None, tensors=None) -> Path:
    dst = tmp_path / f"edited-{len(list(tmp_path.iterdir()))}"
    dst.mkdir()
    raw = json.loads((src / "config.json").read_text())
    if edit:
        edit(raw)
    (dst / "config.json").write_text(json.dumps(raw))
    weights = mx.load(str(src / "model.safetensors"))
    if tensors:
        tensors(weights)
    mx.save_safetensors(str(dst / "model.safetensors"), weights)
    return dst


def _one_sentence(message: str) -> None:
    assert message.count(". ") <= 1 and message.endswith((".", ")")) and "\n" not in message, message


@pytest.mark.parametrize(
    "edit, tensors, fragment",
    [
        (lambda c: c.pop("mask_token_id"), None, "missing mask_token_id"),
        (lambda c: c.pop("transformer_layer_config"), None, "missing transformer_layer_config"),
        (lambda c: c.update(aux_hidden_state_layer_ids=[0, 5]), None, "include 0, the embeddings' output"),
        (lambda c: c.update(aux_hidden_state_layer_ids="2,5"), None, "not a list of layer ids"),
        (lambda c: c.update(sample_from_anchor=True), None, "sample_from_anchor"),
        (lambda c: c["transformer_layer_config"].update(attention_bias=True), None, "attention_bias"),
        (lambda c: c.update(target_hidden_size=128), None, "target_hidden_size"),
        (lambda c: c.update(speculators_model_type="eagle3"), None, "not DFlash"),
        (None, lambda w: w.update(d2t=mx.zeros((len(INCLUDED) + 1,), mx.int64)), "must hold 42 integer offsets"),
        (None, lambda w: w.update(d2t=w["d2t"].astype(mx.float32)), "must hold 42 integer offsets"),
        (None, lambda w: w.pop("d2t"), "lacks d2t"),
        (None, lambda w: w.pop("lm_head.weight"), "lacks lm_head.weight"),
        (None, lambda w: w.update(t2d=mx.ones((48,), mx.bool_)), "t2d and d2t name different"),
        (None, lambda w: w.update(d2t=w["d2t"] + 10), "different draft vocabularies"),
    ],
)
def test_bad_speculators_checkpoints_fail_in_one_sentence(tmp_path, layouts, edit, tensors, fragment):
    bad = _edited(tmp_path, layouts["speculators"], edit, tensors)
    with pytest.raises(ValueError) as e:
        load_draft(bad)
    assert fragment in str(e.value)
    _one_sentence(str(e.value))
    assert_clean_failure(cli("--hf-path", bad, "--mlx-path", tmp_path / "out"), fragment)
    assert not (tmp_path / "out").exists()


def test_taps_past_the_target_fail_at_load(tmp_path, target_dir, layouts):
    bad = _edited(tmp_path, layouts["speculators"], lambda c: c.update(aux_hidden_state_layer_ids=[2, 7]))
    with pytest.raises(ValueError, match=r"target_layer_ids \[6\] do not exist in a 6-layer target"):
        load(target_dir, draft=bad)
    d2t_out = _edited(tmp_path, layouts["speculators"], None, lambda w: (w.pop("t2d"), w.update(d2t=w["d2t"] + 9)))
    with pytest.raises(ValueError, match="outside the target's 48-token vocabulary"):
        load(target_dir, draft=d2t_out)


def test_bad_assistant_config_fails_in_one_sentence(tmp_path, layouts):
    bad = _edited(tmp_path, layouts["assistant"], lambda c: c.update(target_layer_ids=[1, 1]))
    with pytest.raises(ValueError, match="repeats 1") as e:
        load_draft(bad)
    _one_sentence(str(e.value))
    missing = _edited(tmp_path, layouts["assistant"], lambda c: c.pop("mask_token_id"))
    with pytest.raises(ValueError, match="missing .*mask_token_id"):
        load_draft(missing)


# -- the registry ---------------------------------------------------------------------------


def test_registry_names_every_published_drafter_its_family_and_format():
    pairs = known_pairs()
    rows = {
        ("Qwen/Qwen3.5-122B-A10B", "z-lab/Qwen3.5-122B-A10B-DFlash", "qwen3_5_moe", formats.ZLAB),
        ("google/gemma-4-26B-A4B-it", "z-lab/gemma-4-26B-A4B-it-DFlash", "gemma4", formats.ZLAB),
        ("MiniMaxAI/MiniMax-M2.5", "z-lab/MiniMax-M2.5-DFlash", "minimax", formats.ZLAB),
        ("moonshotai/Kimi-K2.5", "z-lab/Kimi-K2.5-DFlash", "kimi_k25", formats.ZLAB),
        ("zai-org/GLM-5.1", "z-lab/GLM-5.1-DFlash", "glm_moe_dsa", formats.ZLAB),
        ("Qwen/Qwen3.8-27B", "z-lab/Qwen3.8-27B-DFlash2", "qwen3_5", formats.ZLAB2),
        ("google/gemma-4-31B-it", "RedHatAI/gemma-4-31B-it-speculator.dflash", "gemma4", formats.SPECULATORS),
        ("google/gemma-4-31B-it", "RedHatAI/gemma-4-31B-it-speculator.dflash2", "gemma4", formats.SPECULATORS2),
        ("Qwen/Qwen3-8B", "RedHatAI/Qwen3-8B-speculator.dflash", "qwen3", formats.SPECULATORS),
        ("Qwen/Qwen3-30B-A3B", "RedHatAI/Qwen3-30B-A3B-speculator.dflash", "qwen3_moe", formats.SPECULATORS),
        ("meta-models/Muse-Glimmer-30B", "meta-models/Muse-Glimmer-30B-assistant", "muse_glimmer", formats.ASSISTANT),
    }
    for target, drafter, family, fmt in rows:
        assert (target, drafter) in pairs and FAMILIES[target] == family and drafter_format(drafter) == fmt
    # A target's default drafter stays Z Lab's where Z Lab publishes one.
    assert KNOWN_PAIRS["google/gemma-4-31B-it"] == "z-lab/gemma-4-31B-it-DFlash"
    assert all(drafter_format(d) in formats.FORMATS for _, d in pairs)
    assert all(t in FAMILIES for t, _ in pairs)


_DEEP_TARGETS: dict[int, object] = {}


@pytest.mark.parametrize("drafter", sorted({d for _, d in known_pairs()}))
def test_every_registry_drafter_loads_its_fixture(tmp_path, drafter):
    """Each drafter the registry names, at tiny width in its format's field
    set with its published structure, loads as that format, fits a target
    of its target's depth, and drafts a block."""
    facts = PUBLISHED[drafter]
    path = published_drafter(tmp_path / "d", drafter)
    assert formats.drafter_format(json.loads((path / "config.json").read_text())) == drafter_format(drafter)
    draft = load_draft(path)
    cfg = draft.config
    assert (cfg.num_hidden_layers, cfg.block_size, cfg.target_layer_ids) == (
        facts.layers,
        facts.block,
        list(facts.taps),
    )
    windows = [layer.self_attn.window for layer in draft.layers]
    assert windows == [facts.window] * facts.sliding + [None] * (facts.layers - facts.sliding)
    assert cfg.num_target_layers in (None, facts.target_layers)
    if facts.target_layers not in _DEEP_TARGETS:
        deep = target_config("qwen3", vocab=48, layers=facts.target_layers)
        _DEEP_TARGETS[facts.target_layers] = adapt(make_target(deep))
    draft.bind(_DEEP_TARGETS[facts.target_layers])
    mx.random.seed(0)
    taps = mx.random.normal((1, 5, len(facts.taps) * 64))
    block = mx.array([[4] + [cfg.mask_token_id] * (cfg.block_size - 1)])
    if draft.selects_candidates:
        drafts, _ = draft.propose(block, taps, draft.make_cache())
    else:
        drafts = mx.argmax(draft(block, taps, draft.make_cache())[0], axis=-1)
    assert drafts.shape == (cfg.block_size - 1,) and mx.all((drafts >= 0) & (drafts < 48)).item()
    if cfg.draft_vocab_size:  # drafts only from the draft vocabulary
        assert all(t % 2 == 0 or t == 47 for t in drafts.tolist())
