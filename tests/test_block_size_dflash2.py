"""``block_size="auto"``'s range per pair (block_size.auto_range): a DFlash 2
drafter with a quantized target or drafter chooses in 2..5, as Z Lab
advises; every other pair in 4..the trained block. Output stays the
target's greedy decoding."""

import random
from collections import Counter

import mlx.core as mx
import mlx.nn as nn
from test_dflash2 import dflash2_config, random_dflash2_weights
from tiny import (
    draft_config,
    greedy_reference,
    make_draft,
    make_target,
    make_tokenizer,
    random_draft_weights,
    target_config,
    write_zlab_draft,
)

from dflash_mlx import stream_generate
from dflash_mlx.auto.chooser import auto_range, chooser_for, forget
from dflash_mlx.loading import load_draft
from dflash_mlx.targets import adapt

VOCAB = 24
TCFG = target_config("qwen3", vocab=VOCAB, layers=5)


def quantized(module):
    nn.quantize(module, group_size=32, bits=4)
    mx.eval(module.parameters())
    return module


def dflash2(tmp_path, name: str, block_size: int = 16, quantize: bool = False):
    cfg = dflash2_config(TCFG, block_size=block_size, taps=(0, 3), window=16, selector_top_k=4)
    draft = load_draft(write_zlab_draft(tmp_path / name, cfg, random_dflash2_weights(cfg, seed=22), dtype=mx.float32))
    return quantized(draft) if quantize else draft


def test_the_range_per_pair(tmp_path):
    plain, quant = make_target(TCFG, seed=21), quantized(make_target(TCFG, seed=21))
    v1cfg = draft_config(TCFG, layers=1, block_size=16, taps=[0, 3])
    v1 = make_draft(v1cfg, random_draft_weights(v1cfg))
    assert auto_range(adapt(quant), v1) == (4, 16)  # a v1 drafter: as before
    assert auto_range(plain, dflash2(tmp_path, "d")) == (4, 16)  # nothing quantized
    assert auto_range(adapt(quant), dflash2(tmp_path, "d")) == (2, 5)  # the adapter or the mlx-lm model alike
    assert auto_range(quant, dflash2(tmp_path, "d")) == (2, 5)
    assert auto_range(plain, dflash2(tmp_path, "dq", quantize=True)) == (2, 5)
    assert auto_range(quant, dflash2(tmp_path, "d4", block_size=4)) == (2, 4)  # never past the trained block
    assert auto_range(plain, dflash2(tmp_path, "d3", block_size=3)) == (3, 3)


def test_auto_with_a_quantized_target_and_a_dflash2_drafter(tmp_path):
    model = quantized(make_target(TCFG, seed=21))
    draft = dflash2(tmp_path, "d")
    forget(draft)
    rng = random.Random(1)
    seen = Counter()
    for n in (3, 40):
        prompt = [rng.randrange(VOCAB - 1) for _ in range(n)]
        responses = list(stream_generate(model, draft, make_tokenizer(VOCAB), prompt, max_tokens=40, block_size="auto"))
        assert [t for r in responses for t in r.tokens] == greedy_reference(model, prompt, 40)
        seen.update(responses[-1].block_sizes)  # this call's cycles per block size
    assert seen and max(seen) <= 5 and 2 in seen  # auto chose within 2..5 (its probes: 5, 2, 4, a plain step)
    assert chooser_for(draft, 2, 5).cycles == sum(seen.values())


def test_a_moe_target_with_quantized_experts(tmp_path):
    """A qwen3_moe target whose experts are mlx-lm's QuantizedSwitchLinear
    counts as quantized, even when its experts are all that is quantized."""
    from family_models import family_config, make_family_target
    from mlx_lm.models.switch_layers import SwitchLinear

    cfg = {**family_config("qwen3_moe", vocab=VOCAB, layers=5, hidden=64), "tie_word_embeddings": False}
    model = make_family_target(cfg, seed=21)
    assert auto_range(model, dflash2(tmp_path, "d")) == (4, 16)
    nn.quantize(model, group_size=32, bits=4, class_predicate=lambda _, m: isinstance(m, SwitchLinear))
    assert not any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())
    assert auto_range(model, dflash2(tmp_path, "d")) == (2, 5)
    assert auto_range(adapt(model), dflash2(tmp_path, "d")) == (2, 5)
