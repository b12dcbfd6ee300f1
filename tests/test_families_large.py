"""The largest published drafters' targets (issue 39): DeepSeek V3 and Kimi
K2.5 (multi-head latent attention), DeepSeek V3.2 and GLM-5 (latent attention
with DeepSeek sparse attention), GLM-4.5 and MiniMax M2, each a tiny random
model in its checkpoint's config layout. The adapter's logits are mlx-lm's;
its caches are plain buffers whose rollback is a move of the length; a verify
block's rows attend as mlx-lm's one-token decode steps would; greedy DFlash
output equals mlx-lm's own greedy decoding token for token over block sizes,
``auto``, prompt lengths past a buffer growth, an EOS, a prompt cache reused
across turns, and 4-bit weights."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from family_models import (
    LARGE,
    check_turns,
    family_config,
    greedy_over_blocks,
    make_family_target,
    run,
    scripted,
)
from test_attention_routing import decode, fake_gpu  # noqa: F401
from test_attention_routing_families import HeadDimRecorder, target_forwards
from test_attention_routing_families import pair as routing_pair
from test_sampling import plain_sampled
from tiny import draft_config, greedy_reference, make_draft, make_tokenizer, random_draft_weights

from dflash_mlx import make_prompt_cache, stream_generate
from dflash_mlx.decode.cycle import Cycle
from dflash_mlx.kv.buffer import BufferKVCache
from dflash_mlx.targets import adapt

VOCAB = 48
# config model_type -> the adapter's family
FAMILY = {
    "deepseek_v3": "deepseek_v3",
    "kimi_k25": "deepseek_v3",
    "deepseek_v32": "deepseek_v32",
    "glm_moe_dsa": "glm_moe_dsa",
    "glm4_moe": "glm4_moe",
    "minimax_m2": "minimax",
}
# Seeds whose random weights give a varied greedy text (not one token repeated).
SEED = {"deepseek_v3": 3, "kimi_k25": 3, "deepseek_v32": 2, "glm_moe_dsa": 2, "glm4_moe": 4, "minimax_m2": 15}
LATENT = ("deepseek_v3", "kimi_k25", "deepseek_v32", "glm_moe_dsa")
SPARSE = ("deepseek_v32", "glm_moe_dsa")


def text_config(cfg: dict) -> dict:
    return cfg.get("text_config", cfg)


def make_pair(family: str, quantize: bool = False, **extra):
    cfg = family_config(family, vocab=VOCAB, layers=4, **extra)
    model = make_family_target(cfg, SEED[family])
    if quantize:
        nn.quantize(model, group_size=32, bits=4)
        mx.eval(model.parameters())
    dcfg = draft_config(text_config(cfg), layers=1, block_size=16)
    return model, scripted(make_draft(dcfg, random_draft_weights(dcfg, seed=SEED[family] + 1)))


@pytest.fixture(scope="module", params=LARGE)
def pair(request):
    return (request.param, *make_pair(request.param))


def test_every_family_is_served_by_its_adapter():
    assert set(FAMILY) == set(LARGE)
    for family, adapter_family in FAMILY.items():
        model, _ = make_pair(family)
        target = adapt(model)
        assert target.family == adapter_family
        assert target.vocab_size == VOCAB and target.num_layers == 4 and not target.tied
        if family == "kimi_k25":
            assert target.text is model.language_model and target.model is model


def test_logits_match_mlx_lm_and_rollback_is_a_move_of_the_length(pair):
    family, model, _ = pair
    target = adapt(model)
    tokens = mx.array([[(7 * i + 3) % (VOCAB - 1) for i in range(48)]])
    want = model(tokens)
    cache = target.make_cache()
    # Chunks: a long one (the expanded form for latent attention), then short ones.
    parts = [target(tokens[:, a:b], cache, [1])[0] for a, b in [(0, 40), (40, 43), (43, 44), (44, 48)]]
    assert mx.allclose(mx.concatenate(parts, axis=1), want, atol=1e-4).item()
    assert all(type(c) is BufferKVCache for c in cache)
    if family in LATENT:
        # One latent row and one rotary key (plus DSA's index key) per position, shared by the heads.
        args = target.text.args
        extra = args.index_head_dim if family in SPARSE else 0
        assert cache[0].keys.shape[1] == 1 and cache[0].keys.shape[3] == args.kv_lora_rank
        assert cache[0].values.shape[3] == args.qk_rope_head_dim + extra
    # A rejected block: roll back to 30 positions and write other tokens there.
    keys = [c.keys for c in cache]
    target.set_length(cache, 30)
    other = mx.array([[5, 9, 2, 11, 13, 1]])
    logits, _ = target(other, cache, [1])
    assert all(c.keys.shape == k.shape for c, k in zip(cache, keys))  # no copy, no regrowth
    fresh = model(mx.concatenate([tokens[:, :30], other], axis=1))[:, 30:]
    assert mx.allclose(logits, fresh, atol=1e-4).item()


def test_verify_rows_attend_as_decode_steps(pair):
    """Each row of a block gets the logits and hidden states that the same
    tokens fed one at a time (mlx-lm's decode steps) get."""
    family, model, _ = pair
    target = adapt(model)
    prompt = mx.array([[(5 * i + 1) % (VOCAB - 1) for i in range(20)]])
    block = mx.array([[3, 17, 4, 40, 22, 8, 30, 1]])
    a, b = target.make_cache(), target.make_cache()
    target(prompt, a, [1, 2], last_only=True)
    target(prompt, b, [1, 2], last_only=True)
    logits, hidden = target(block, a, [1, 2])
    steps = [target(block[:, i : i + 1], b, [1, 2]) for i in range(block.shape[1])]
    assert mx.allclose(logits, mx.concatenate([s[0] for s in steps], axis=1), atol=1e-5).item()
    assert mx.allclose(hidden, mx.concatenate([s[1] for s in steps], axis=1), atol=1e-5).item()


@pytest.mark.parametrize("family", SPARSE)
def test_sparse_attention_selects(family):
    """With a small ``index_topk`` the indexer changes the output (so the tests
    above run its selection), and with a large one it is plain attention."""
    tokens = mx.array([[(3 * i + 2) % (VOCAB - 1) for i in range(24)]])
    sparse, _ = make_pair(family)
    dense, _ = make_pair(family, index_topk=64)
    assert not mx.allclose(sparse(tokens), dense(tokens), atol=1e-3).item()
    target = adapt(dense)
    logits, _ = target(tokens, target.make_cache(), [1])
    assert mx.allclose(logits, dense(tokens), atol=1e-4).item()


def test_greedy_equals_mlx_lm(pair):
    family, model, draft = pair
    # Prompts past DSA's index_topk (6) and past a buffer growth (256).
    accepted = greedy_over_blocks(model, draft, VOCAB, (1, 11, 300), (2, 4, 8, 16, 8, 16), prefill_step_size=45)
    assert {0, 1, 2, 3, 4, 5, 7} <= accepted  # rollbacks of many lengths, a whole block of 8 kept
    prompt = list(range(2, 21))
    ref = greedy_reference(model, prompt, 24)
    assert len(set(ref)) >= 4, family  # a varied text, not one token over and over
    tokens, _ = run(model, draft, prompt, ref, vocab=VOCAB, max_tokens=24, block_size="auto")
    assert tokens == ref


def test_eos_and_prompt_cache_across_turns(pair):
    _, model, draft = pair
    check_turns(model, draft, VOCAB)


def test_compiled_cycles_equal_mlx_lm(pair, monkeypatch):
    """The cycle as a GPU (a Mac's included) runs it, through mx.compile over
    whole buffers, across two turns of one prompt cache."""
    monkeypatch.setattr(Cycle, "compile_graphs", True)
    _, model, draft = pair
    prompt = [(5 * i + 2) % (VOCAB - 1) for i in range(13)]
    for block in (4, 16):
        cache = make_prompt_cache(model, draft)
        want = greedy_reference(model, prompt, 28)
        assert (
            run(model, draft, prompt, want, vocab=VOCAB, max_tokens=28, block_size=block, prompt_cache=cache)[0] == want
        )
        more = prompt + want + [5, 6]
        want = greedy_reference(model, more, 20)
        assert (
            run(model, draft, more, want, vocab=VOCAB, max_tokens=20, block_size=block, prompt_cache=cache)[0] == want
        )


@pytest.mark.parametrize("family", ["kimi_k25", "glm_moe_dsa"])
def test_whole_buffer_reads_as_on_cuda(family, monkeypatch):
    """On CUDA every forward spans the whole buffer (kv/buffer.py), the
    unfilled and rolled-back tail hidden by the mask only, the indexer's
    top-k included: still mlx-lm's greedy text, across prompt-cache turns."""
    from dflash_mlx import device

    monkeypatch.setattr(device, "backend", lambda: "cuda")
    model, draft = make_pair(family)
    cache = make_prompt_cache(model, draft)
    prompt = [(5 * i + 2) % (VOCAB - 1) for i in range(13)]
    for turn in range(2):
        want = greedy_reference(model, prompt, 20)
        assert run(model, draft, prompt, want, vocab=VOCAB, max_tokens=20, block_size=8, prompt_cache=cache)[0] == want
        c = cache.target[0]
        c.set_length(mx.array(c.offset, mx.int32), c.bound)  # a cycle's length, on the device
        assert c.read_width(8) == c.width_after(8) > c.bound + 8  # the whole buffer, not up to the bound
        prompt = prompt + want + [4, 2]


@pytest.mark.parametrize("family", ["kimi_k25", "glm_moe_dsa", "minimax_m2"])
def test_seeded_sampling_is_the_targets_own(family):
    """A seed fixes the sampled text at every block size, and it is the text
    mlx-lm's generate_step samples from the target alone with the same noise."""
    model, draft = make_pair(family)
    tok = make_tokenizer(VOCAB)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    for seed, (temperature, top_p, top_k) in [(0, (0.8, 1.0, 0)), (1, (1.0, 0.9, 20))]:
        want = plain_sampled(model, prompt, 24, seed, temperature, top_p, top_k)
        draft.set_script(prompt + want)  # drafts mostly right: cycles keep several
        for bs in (2, 5, 16, "auto"):
            got = list(
                stream_generate(
                    model,
                    draft,
                    tok,
                    prompt,
                    max_tokens=24,
                    temperature=temperature,
                    top_p=top_p,
                    top_k=top_k,
                    block_size=bs,
                    seed=seed,
                )
            )
            assert [t for r in got for t in r.tokens] == want, (seed, bs)
            assert sum(r.accepted for r in got[1:]) > 0, (seed, bs)


@pytest.mark.parametrize("family", LARGE)
def test_quantized_target(family):
    model, draft = make_pair(family, quantize=True)
    prompt = list(range(1, 30))
    tokens, _ = run(model, draft, prompt, vocab=VOCAB, max_tokens=24, block_size=4)
    assert tokens == greedy_reference(model, prompt, 24)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_kv_settings_the_family_cannot_use_are_refused(family):
    model, draft = make_pair(family)
    with pytest.raises(ValueError, match="run without kv_bits"):
        make_prompt_cache(model, draft, kv_bits=4)
    with pytest.raises(ValueError, match="run without it"):
        make_prompt_cache(model, draft, max_kv_size=64)


@pytest.mark.parametrize("family", ["kimi_k25", "glm_moe_dsa"])
def test_a_saved_prompt_cache_decodes_what_the_uncached_prompt_decodes(family, tmp_path):
    """A latent (and index) cache written to a prompt-cache file and read back
    continues exactly as the uncached run of the whole prompt."""
    from dflash_mlx.cache.files import load_prompt_cache, save_prompt_cache

    model, draft = make_pair(family)
    prefix = [(7 * i) % (VOCAB - 2) + 1 for i in range(40)]
    cache = make_prompt_cache(model, draft)
    run(model, draft, prefix + [0], [0], vocab=VOCAB, max_tokens=1, prompt_cache=cache)
    cache.keep_prefix(prefix + [0])
    path = tmp_path / "prefix.safetensors"
    save_prompt_cache(path, cache, {"model": family})
    loaded, _ = load_prompt_cache(path, model, draft)
    assert loaded.tokens == prefix
    prompt = prefix + [5, 6, 7]
    want = greedy_reference(model, prompt, 20)
    assert run(model, draft, prompt, want, vocab=VOCAB, max_tokens=20, block_size=8, prompt_cache=loaded)[0] == want


@pytest.mark.parametrize("family", ["glm4_moe", "minimax_m2", "deepseek_v3"])
def test_which_layers_reach_the_attention_kernel(fake_gpu, family):
    """On a stand-in GPU whose kernel records its calls: GLM-4.5's and
    MiniMax's attention layers call the block-attention kernel in every
    prefill chunk and verify (head dim 64 at hidden 256), with the cache's
    start and valid length; latent attention never does (its scores add a
    rotary part the kernel does not compute). Output stays mlx-lm's."""
    kernel = fake_gpu(HeadDimRecorder())
    model, draft = routing_pair(family, seed=11)
    prompt = [(3 * i + 1) % 20 for i in range(40)]
    assert decode(model, draft, prompt, block_size=8, prefill_step_size=16) == greedy_reference(model, prompt, 24)
    # this decode's forwards (the kernel's own self-check cases sit at position 500)
    forwards = {k: v for k, v in target_forwards(kernel.calls).items() if k[0] < 100}
    if family in LATENT:
        assert not forwards
        return
    assert {start for start, _ in forwards} >= {0, 16, 32} and any(start >= 40 for start, _ in forwards)
    for (start, rows), calls in forwards.items():
        assert [c["head_dim"] for c in calls] == [64] * 4, (start, rows)
        assert all(
            (c["kv_length"].item() if isinstance(c["kv_length"], mx.array) else c["kv_length"]) == start + rows
            for c in calls
        )
