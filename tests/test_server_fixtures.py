"""Tiny pairs and a real server on 127.0.0.1 for the server tests.

The scripted pair's target is a bigram model: its layers add nothing (zero
output projections), so the next token depends on the last one only, and
its greedy text follows SCRIPT; that is how a random tiny model writes
thinking sections, tool calls and known words for stop strings."""

from __future__ import annotations

import socket
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx

from dflash_mlx.tiny import (
    draft_config,
    make_target,
    random_draft_weights,
    target_config,
    write_target,
    write_zlab_draft,
)

SPECIAL = [
    "<sys>",
    "<user>",
    "<asst>",
    "<end>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    '{"name":"get_weather","arguments":{"city":"Paris"}}',
    "<asst_tools>",
    "<eos>",
]
WORDS = SPECIAL + [f"w{i}" for i in range(12, 48)] + ["<mask>"]
VOCAB = len(WORDS)
ID = {w: i for i, w in enumerate(WORDS)}

# <think>/</think> make mlx-lm see a thinking model; "<tool_call>" and
# "tool_call.name" in the template make it pick its json_tools parser.
SCRIPTED_TEMPLATE = (
    "{# tools are called as <tool_call>{...}</tool_call>, see tool_call.name #}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}<sys> {% elif m['role'] == 'assistant' %}<asst> {% else %}<user> {% endif %}"
    "{{ m['content'] }} <end> "
    "{% endfor %}"
    "{% if add_generation_prompt %}{% if tools %}<asst_tools>{% else %}<asst>{% endif %}"
    "{% if not enable_thinking %} <think> </think>{% endif %}{% endif %}"
)

# What the scripted target writes after each token (anything else: <eos>).
SCRIPT = {
    "<asst>": "<think>",
    "<think>": "w12",
    "w12": "</think>",
    "</think>": "w13",
    **{f"w{i}": f"w{i + 1}" for i in range(13, 20)},
    "w20": "<eos>",
    "<asst_tools>": "<tool_call>",
    "<tool_call>": SPECIAL[8],
    SPECIAL[8]: "</tool_call>",
    "</tool_call>": "<eos>",
}


def word_tokenizer(words: list[str], eos: str, template: str):
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos)
    fast.chat_template = template
    return TokenizerWrapper(fast)


def scripted_target(cfg: dict):
    """A qwen3 target whose greedy next token is SCRIPT[last token]."""
    model = make_target(cfg, seed=3)
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    head = mx.zeros((vocab, hidden))
    nxt = [ID[SCRIPT.get(w, "<eos>")] for w in WORDS]
    head[mx.array(nxt), mx.arange(vocab)] = 1.0
    layers = []
    for layer in model.model.layers:
        layers.append(
            {
                "self_attn": {"o_proj": {"weight": mx.zeros_like(layer.self_attn.o_proj.weight)}},
                "mlp": {"down_proj": {"weight": mx.zeros_like(layer.mlp.down_proj.weight)}},
            }
        )
    model.update(
        {
            "model": {
                "embed_tokens": {"weight": mx.eye(vocab, hidden)},
                "layers": layers,
                "norm": {"weight": mx.full((hidden,), 1.5)},
            },
            "lm_head": {"weight": head},
        }
    )
    mx.eval(model.parameters())
    return model


def write_scripted_pair(root: Path) -> tuple[Path, Path]:
    cfg = target_config(vocab=VOCAB, hidden=64, layers=4)
    write_target(root / "scripted", cfg, scripted_target(cfg), word_tokenizer(WORDS, "<eos>", SCRIPTED_TEMPLATE))
    dcfg = draft_config(cfg, block_size=4)
    write_zlab_draft(root / "scripted-draft", dcfg, random_draft_weights(dcfg, seed=5))
    mx.clear_cache()
    return root / "scripted", root / "scripted-draft"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(model, draft, tokenizer, **config):
    """A real server (uvicorn, 127.0.0.1, a free port) in a thread of this
    process; yields its base URL."""
    from dflash_mlx.server import ServerConfig, create_app, running_in_thread

    app = create_app(model, draft, tokenizer, ServerConfig(**{"model_name": "tiny", **config}))
    with running_in_thread(app, port=free_port()) as url:
        yield url


# -- pytest fixtures (import them into a test module to use them) -----------------------
import pytest  # noqa: E402


@pytest.fixture(scope="module")
def chat_pair(tmp_path_factory):
    """The CLI tests' tiny random pair, its target with a chat template:
    (model, draft, tokenizer) as dflash_mlx.load gives them."""
    from cli_fixtures import make_tiny_pair

    from dflash_mlx import load

    pair = make_tiny_pair(tmp_path_factory.mktemp("chat-pair"))
    return load(str(pair.chat_target), draft=str(pair.draft))


@pytest.fixture(scope="module")
def scripted_pair(tmp_path_factory):
    from dflash_mlx import load

    target, draft = write_scripted_pair(tmp_path_factory.mktemp("scripted-pair"))
    return load(str(target), draft=str(draft))


@pytest.fixture(scope="module")
def chat_server(chat_pair):
    with serving(*chat_pair) as url:
        yield url


@pytest.fixture(scope="module")
def scripted_server(scripted_pair):
    with serving(*scripted_pair) as url:
        yield url


@pytest.fixture(scope="module")
def kv_pair(tmp_path_factory):
    """A tiny chat pair whose head dimension (32) takes KV quantization
    (group size 32) and whose context is short (64 positions), on disk for
    the command and loaded: (target dir, draft dir, (model, draft, tokenizer))."""
    from cli_fixtures import TEMPLATE, VOCAB

    from dflash_mlx import load
    from dflash_mlx.tiny import make_tokenizer

    root = tmp_path_factory.mktemp("kv-pair")
    cfg = {**target_config(vocab=VOCAB, hidden=128, layers=2), "max_position_embeddings": KV_PAIR_CONTEXT}
    tokenizer = make_tokenizer(VOCAB)
    tokenizer._tokenizer.chat_template = TEMPLATE
    write_target(root / "target", cfg, make_target(cfg, seed=7), tokenizer)
    dcfg = draft_config(cfg, layers=1, block_size=4)
    write_zlab_draft(root / "draft", dcfg, random_draft_weights(dcfg, seed=8))
    mx.clear_cache()
    return root / "target", root / "draft", load(str(root / "target"), draft=str(root / "draft"))


KV_PAIR_CONTEXT = 64
