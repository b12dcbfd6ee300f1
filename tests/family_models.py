"""Tiny random targets in each family's own mlx-lm config layout (what a
converted checkpoint's config.json holds), for the family tests."""

from __future__ import annotations

import importlib

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from dflash_mlx import stream_generate
from dflash_mlx.tiny import greedy_reference, make_tokenizer, target_config


def _common(family: str, vocab: int, layers: int, hidden: int) -> dict:
    """The dense qwen3 layout's shared fields, relabelled for ``family``."""
    cfg = target_config("qwen3", vocab=vocab, layers=layers, hidden=hidden)
    for key in ("architectures", "intermediate_size", "torch_dtype"):
        del cfg[key]
    return {**cfg, "model_type": family}


# The multimodal checkpoints' model_type -> their text model's.
WRAPPED = {"gemma3": "gemma3_text", "gemma4": "gemma4_text"}


def _deepseek_v3(vocab: int, layers: int, hidden: int) -> dict:
    """DeepSeek V3's (and Kimi K2's) fields: latent attention (MLA), a dense
    first layer, then routed experts in groups plus a shared one, yarn RoPE."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "moe_intermediate_size": hidden // 2,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_shared_experts": 1,
        "n_routed_experts": 8,
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": 64,
        "q_lora_rank": 64,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "qk_nope_head_dim": 32,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "n_group": 2,
        "topk_group": 1,
        "num_experts_per_tok": 2,
        "moe_layer_freq": 1,
        "first_k_dense_replace": 1,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "attention_bias": False,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 1,
        "torch_dtype": "bfloat16",
    }


def _large_family(family: str, vocab: int, layers: int, hidden: int) -> dict:
    """The largest published drafters' targets, in their checkpoints' layouts."""
    if family == "deepseek_v3":
        return _deepseek_v3(vocab, layers, hidden)
    if family == "kimi_k25":
        # Kimi K2.5: a vision-language wrapper whose text model is DeepSeek V3's.
        text = {**_deepseek_v3(vocab, layers, hidden), "model_type": "kimi_k2", "n_group": 1}
        del text["architectures"]
        return {
            "architectures": ["KimiK25ForConditionalGeneration"],
            "model_type": "kimi_k25",
            "text_config": text,
            "vision_config": {"model_type": "moonvit", "hidden_size": 16, "num_hidden_layers": 1},
            "media_placeholder_token_id": vocab - 2,
        }
    if family in ("glm_moe_dsa", "deepseek_v32"):
        # GLM-5 and DeepSeek V3.2: MLA plus DeepSeek sparse attention, whose
        # indexer keeps ``index_topk`` past positions per query (small here,
        # so it selects).
        cfg = {
            **_deepseek_v3(vocab, layers, hidden),
            "architectures": ["DeepseekV32ForCausalLM"],
            "model_type": "deepseek_v32",
            "index_head_dim": 16,
            "index_n_heads": 16,
            "index_topk": 6,
        }
        if family == "glm_moe_dsa":
            cfg.update(
                architectures=["GlmMoeDsaForCausalLM"],
                model_type="glm_moe_dsa",
                n_group=1,
                indexer_rope_interleave=True,
                rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
                rms_norm_eps=1e-5,
            )
            del cfg["rope_theta"], cfg["rope_scaling"]
        return cfg
    if family == "minimax_m2":
        return {
            "architectures": ["MiniMaxM2ForCausalLM"],
            "model_type": "minimax_m2",
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": hidden // 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": hidden // 4,
            "num_hidden_layers": layers,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "shared_intermediate_size": 0,
            "rotary_dim": hidden // 8,
            "rope_theta": 5000000.0,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 4096,
            "scoring_func": "sigmoid",
            "use_qk_norm": True,
            "qk_norm_type": "per_layer",
            "use_routing_bias": True,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
        }
    if family == "glm4_moe":
        return {
            "architectures": ["Glm4MoeForCausalLM"],
            "model_type": "glm4_moe",
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": 2 * hidden,
            "moe_intermediate_size": hidden // 2,
            "max_position_embeddings": 4096,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": hidden // 4,
            "partial_rotary_factor": 0.5,
            "num_hidden_layers": layers,
            "n_shared_experts": 1,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_group": 1,
            "topk_group": 1,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "first_k_dense_replace": 1,
            "rms_norm_eps": 1e-5,
            "rope_theta": 1000000.0,
            "rope_scaling": None,
            "use_qk_norm": True,
            "attention_bias": True,
            "tie_word_embeddings": False,
            "num_nextn_predict_layers": 1,
            "torch_dtype": "bfloat16",
        }
    raise ValueError(family)


# The largest published drafters' targets (issue 39), by their configs' model_type.
LARGE = ("deepseek_v3", "kimi_k25", "deepseek_v32", "glm_moe_dsa", "glm4_moe", "minimax_m2")


def family_config(family: str, vocab: int = 48, layers: int = 4, hidden: int = 64, **extra) -> dict:
    if family in LARGE:
        return {**_large_family(family, vocab, layers, hidden), **extra}
    if family in WRAPPED:
        # As the published checkpoints hold it: the text model's fields under
        # text_config, the vocabulary at the top, a vision tower's config too.
        text = family_config(WRAPPED[family], vocab, layers, hidden, **extra)
        del text["vocab_size"]
        return {
            "architectures": [f"{family.capitalize()}ForConditionalGeneration"],
            "model_type": family,
            "text_config": text,
            "vocab_size": vocab,
            "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 16, "num_hidden_layers": 1},
        }
    cfg = _common(family, vocab, layers, hidden)
    if family == "qwen3_moe":
        cfg.update(
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            moe_intermediate_size=hidden // 2,
            intermediate_size=2 * hidden,
            norm_topk_prob=True,
        )
    elif family == "gpt_oss":
        cfg.update(
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=hidden // 2,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * (layers // 2),
        )
        del cfg["tie_word_embeddings"]
    elif family == "gemma3_text":
        cfg.update(
            intermediate_size=2 * hidden,
            query_pre_attn_scalar=hidden // 4,
            sliding_window=8,
            sliding_window_pattern=3,
            rope_local_base_freq=10000.0,
        )
    elif family == "gemma4_text":
        cfg.update(
            intermediate_size=2 * hidden,
            global_head_dim=hidden // 2,
            num_kv_shared_layers=2,
            hidden_size_per_layer_input=32,
            vocab_size_per_layer_input=vocab,
            sliding_window=8,
            sliding_window_pattern=3,
            final_logit_softcapping=4.0,
            tie_word_embeddings=True,
        )
    elif family == "muse_glimmer":
        # [local x3, global] from the default pattern; a multiplier and a cap
        # that both change the logits.
        cfg.update(
            intermediate_size=2 * hidden,
            sliding_window=8,
            qk_scale_factor=2.0,
            output_multiplier=0.5,
            final_logit_softcapping=4.0,
        )
    elif family in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
        cfg.update(
            intermediate_size=2 * hidden,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            full_attention_interval=2,
            partial_rotary_factor=0.5,
        )
        if family == "qwen3_5":
            cfg["rope_parameters"] = {"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
        if family in ("qwen3_5_moe", "qwen3_next"):
            cfg.update(
                num_experts=4,
                num_experts_per_tok=2,
                decoder_sparse_step=1,
                mlp_only_layers=[],
                moe_intermediate_size=hidden // 2,
                shared_expert_intermediate_size=hidden // 2,
                norm_topk_prob=True,
            )
    else:
        raise ValueError(family)
    cfg.update(extra)
    return cfg


def make_family_target(cfg: dict, seed: int = 0) -> nn.Module:
    """An mlx-lm model of ``cfg``'s family with random float32 weights, its
    norms sharpened so greedy choices are far from ties."""
    from mlx_lm.utils import MODEL_REMAPPING

    model_type = cfg["model_type"]
    module = importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(model_type, model_type)}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(cfg))
    params = dict(tree_flatten(model.parameters()))
    final = next(k for k in params if k.endswith("model.norm.weight"))
    # Gemma 3 scales by 1 + weight; the others by weight.
    params[final] = mx.full(params[final].shape, 2.0 if cfg["model_type"].startswith("gemma3") else 3.0)
    for k, v in params.items():
        if k.endswith(".sinks"):  # gpt-oss attention sinks: away from zero so they count
            params[k] = mx.random.normal(v.shape)
        # Routers mlx-lm creates as zeros (DeepSeek's and GLM's gates, the
        # experts' score biases): random, so tokens route apart.
        if k.endswith(("gate.weight", "e_score_correction_bias")) and not mx.any(v).item():
            params[k] = 0.5 * mx.random.normal(v.shape)
    model.update(tree_unflatten(list(params.items())))
    mx.eval(model.parameters())
    return model


class ScriptedDraft:
    """Mixed into a DFlash drafter (see ``scripted``): its proposals follow a
    script, the sequence the target will produce, each position right or
    deliberately wrong by a fixed random pattern, so cycles accept every
    count from none to the whole block. Its context cache still grows
    through the real ``extend``, and the script is read on the device at the
    cache's length, as the real drafter reads its position."""

    script: mx.array
    right: mx.array

    def set_script(self, sequence: list[int], p_right: float = 0.7, seed: int = 0) -> None:
        n = len(sequence) + 64
        mx.random.seed(seed)
        self.script = mx.array(sequence + [0] * 64, mx.int32)
        self.right = mx.random.uniform(shape=(n,)) < p_right

    def __call__(self, block: mx.array, taps, cache, fused=None) -> mx.array:
        if taps is not None and taps.shape[1]:
            self.extend(taps, cache, fused)
        bs = block.shape[1]
        at = mx.minimum(cache[0].offset + 1 + mx.arange(bs - 1), self.script.shape[0] - 1)
        want = self.script[at]
        proposal = mx.where(self.right[at], want, (want + 1) % self.config.vocab_size)
        return 10.0 * mx.eye(self.config.vocab_size)[proposal][None]


def scripted(draft):
    """The drafter ``draft``, its proposals now scripted."""
    draft.__class__ = type("Scripted" + type(draft).__name__, (ScriptedDraft, type(draft)), {})
    return draft


def run(model, draft, prompt, script=None, *, vocab: int, **kw):
    """DFlash's tokens and responses with a scripted drafter; ``script``: the
    reply the drafter proposes (right at most positions), None for mlx-lm's
    greedy reply."""
    draft.set_script(prompt + (script if script is not None else greedy_reference(model, prompt, kw["max_tokens"])))
    responses = list(stream_generate(model, draft, make_tokenizer(vocab, eos=kw.pop("eos", None)), prompt, **kw))
    return [t for r in responses for t in r.tokens], responses


def greedy_over_blocks(model, draft, vocab: int, lengths, blocks, prefill_step_size: int) -> set[int]:
    """Greedy DFlash == mlx-lm's greedy decoding, block sizes ``blocks`` over
    prompts of ``lengths`` in turn; returns the accepted counts seen."""
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(vocab - 1) for _ in range(n)] for n in lengths]
    refs = [greedy_reference(model, p, 32) for p in prompts]
    accepted = set()
    for i, bs in enumerate(blocks):
        k = i % len(prompts)
        tokens, responses = run(
            model,
            draft,
            prompts[k],
            refs[k],
            vocab=vocab,
            max_tokens=32,
            block_size=bs,
            prefill_step_size=prefill_step_size,
        )
        assert tokens == refs[k], (bs, len(prompts[k]))
        accepted |= {r.accepted for r in responses[1:]}
    return accepted


def check_eos(model, draft, vocab: int, prompt_length: int) -> tuple[list[int], list[int]]:
    """An EOS the target emits half-way stops DFlash exactly where mlx-lm
    stops; returns the prompt and mlx-lm's 30-token greedy reply (no EOS)."""
    import random

    rng = random.Random(3)
    prompt = [rng.randrange(vocab - 1) for _ in range(prompt_length)]
    ref = greedy_reference(model, prompt, 30)
    eos = ref[len(ref) // 2]
    tokens, responses = run(model, draft, prompt, ref, vocab=vocab, max_tokens=30, block_size=5, eos=eos)
    assert tokens == greedy_reference(model, prompt, 30, eos={eos})
    assert responses[-1].finish_reason == "stop"
    return prompt, ref


def check_turns(model, draft, vocab: int) -> None:
    """An EOS mid-reply (``check_eos``), then prompt-cache turns: a follow-up
    reads only what is new, and an edit inside the conversation keeps the
    common prefix; each turn equal to mlx-lm's greedy decoding."""
    from dflash_mlx import make_prompt_cache

    prompt, ref = check_eos(model, draft, vocab, 20)
    cache = make_prompt_cache(model, draft)
    out1, _ = run(model, draft, prompt, vocab=vocab, max_tokens=12, block_size=6, prompt_cache=cache)
    assert out1 == ref[:12]
    turn2 = prompt + out1 + [3, 4, 5]
    out2, _ = run(model, draft, turn2, vocab=vocab, max_tokens=16, block_size=3, prompt_cache=cache)
    assert out2 == greedy_reference(model, turn2, 16)
    turn3 = prompt[:9] + [7] + prompt[10:]
    out3, _ = run(model, draft, turn3, vocab=vocab, max_tokens=10, block_size=9, prompt_cache=cache)
    assert out3 == greedy_reference(model, turn3, 10)
