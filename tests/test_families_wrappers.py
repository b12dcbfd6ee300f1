"""The multimodal Gemma checkpoints (config model_type ``gemma3`` / ``gemma4``:
the text model's fields under ``text_config``, weights under
``language_model.``, a vision tower mlx-lm drops at load) run through the
Gemma text adapters: a checkpoint in that layout loads with mlx-lm and greedy
DFlash output equals mlx-lm's own greedy decoding of the wrapper model, token
for token, over block sizes and prompt lengths, with an EOS, and 4-bit. Kimi
K2.5 (``kimi_k25``: DeepSeek V3 under ``language_model``) likewise, through
the DeepSeek V3 adapter."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from family_models import WRAPPED, check_eos, family_config, greedy_over_blocks, make_family_target, run, scripted
from mlx.utils import tree_flatten
from tiny import draft_config, greedy_reference, make_draft, make_tokenizer, random_draft_weights

from dflash_mlx.loading import family_runs, load_target
from dflash_mlx.targets import adapt

VOCAB = 48


def write_checkpoint(path, family: str, seed: int = 1):
    """A tiny checkpoint as mlx-community publishes the multimodal ones: no
    lm_head (tied), the text model under language_model., vision tensors."""
    cfg = family_config(family, vocab=VOCAB, layers=6)
    model = make_family_target(cfg, seed)
    weights = {k: v for k, v in tree_flatten(model.parameters()) if "lm_head" not in k}
    weights["vision_tower.encoder.layers.0.mlp.fc1.weight"] = mx.zeros((16, 16))
    weights["multi_modal_projector.mm_input_projection_weight"] = mx.zeros((16, 64))
    path.mkdir(parents=True)
    (path / "config.json").write_text(__import__("json").dumps(cfg))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    make_tokenizer(VOCAB)._tokenizer.save_pretrained(str(path))
    return cfg


def draft_for(cfg: dict, seed: int = 2):
    dcfg = draft_config({**cfg["text_config"], "vocab_size": VOCAB}, layers=1, block_size=16)
    return scripted(make_draft(dcfg, random_draft_weights(dcfg, seed=seed)))


@pytest.fixture(scope="module", params=sorted(WRAPPED))
def pair(request, tmp_path_factory):
    family = request.param
    path = tmp_path_factory.mktemp(family) / "ckpt"
    cfg = write_checkpoint(path, family)
    model, _ = load_target(path)
    return family, model, draft_for(cfg)


def test_the_wrapper_loads_and_is_served_by_its_text_adapter(pair):
    family, model, _ = pair
    assert model.model_type == family and family_runs(family)
    assert "vision_tower" not in model  # mlx-lm dropped it at load
    target = adapt(model)
    assert target.family == WRAPPED[family] and target.model is model
    assert target.text is model.language_model and target.tied  # no lm_head in the checkpoint
    assert target.vocab_size == VOCAB and target.num_layers == 6
    # The adapter's logits are the wrapper's own.
    tokens = mx.array([[1, 5, 9, 2, 7, 30, 11]])
    logits, _ = target(tokens, target.make_cache(), [1])
    assert mx.allclose(logits, model(tokens), atol=1e-4).item()


def test_greedy_equals_mlx_lm(pair):
    _, model, draft = pair
    # Prompts past the sliding window (8) and past a buffer growth (256).
    accepted = greedy_over_blocks(model, draft, VOCAB, (1, 13, 300), (2, 4, 7, 16), prefill_step_size=64)
    assert set(range(7)) <= accepted  # rollbacks of every short length


def test_eos(pair):
    _, model, draft = pair
    check_eos(model, draft, VOCAB, 17)


@pytest.mark.parametrize("family", sorted(WRAPPED))
def test_quantized_wrapper(family):
    cfg = family_config(family, vocab=VOCAB, layers=6)
    model = make_family_target(cfg, seed=5)
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    draft = draft_for(cfg, seed=6)
    prompt = list(range(1, 30))
    tokens, _ = run(model, draft, prompt, vocab=VOCAB, max_tokens=20, block_size=4)
    assert tokens == greedy_reference(model, prompt, 20)


def test_a_kimi_k25_checkpoint_loads_and_decodes_as_mlx_lm(tmp_path):
    """Kimi K2.5 as mlx-community publishes it: the DeepSeek V3 text model
    under language_model. (its latent attention's kv_b_proj already split
    into embed_q / unembed_out), the text fields under text_config, a vision
    tower mlx-lm drops at load. The checkpoint loads with mlx-lm, the
    DeepSeek V3 adapter serves it, and greedy output equals mlx-lm's."""
    cfg = family_config("kimi_k25", vocab=VOCAB, layers=4)
    model = make_family_target(cfg, seed=3)
    weights = dict(tree_flatten(model.parameters()))
    weights["vision_tower.encoder.blocks.0.mlp.fc0.weight"] = mx.zeros((16, 16))
    weights["mm_projector.proj.0.weight"] = mx.zeros((64, 16))
    path = tmp_path / "kimi"
    path.mkdir()
    (path / "config.json").write_text(__import__("json").dumps(cfg))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    make_tokenizer(VOCAB)._tokenizer.save_pretrained(str(path))

    loaded, _ = load_target(path)
    assert loaded.model_type == "kimi_k25" and family_runs("kimi_k25")
    assert "vision_tower" not in loaded and "mm_projector" not in loaded
    target = adapt(loaded)
    assert target.family == "deepseek_v3" and target.text is loaded.language_model and not target.tied
    dcfg = draft_config({**cfg["text_config"], "vocab_size": VOCAB}, layers=1, block_size=16)
    draft = scripted(make_draft(dcfg, random_draft_weights(dcfg, seed=4)))
    accepted = greedy_over_blocks(loaded, draft, VOCAB, (1, 13, 40), (2, 4, 8, 16), prefill_step_size=16)
    assert {0, 1, 2} <= accepted
