"""A prompt-cache file with the right format and fingerprint but damaged
(metadata edited by hand, a tensor missing, cut or added, the file cut
short) is refused in one sentence: a ValueError through the API, "error:
..." and exit 1 through the CLI, never a traceback."""

import json

import mlx.core as mx
import pytest
from tiny import draft_config, make_draft, make_target, make_tokenizer, random_draft_weights, target_config

from dflash_mlx import make_prompt_cache, stream_generate
from dflash_mlx.cache.files import load_prompt_cache, save_prompt_cache

VOCAB = 24
SENTENCE = r"^\S+ is damaged \([^()]+\); make it again with `dflash-mlx cache-prompt`\.$"


def saved(pair, path, **kv):
    model, draft = pair
    cache = make_prompt_cache(model, draft, **kv)
    prefix = [(i * 7) % 23 + 1 for i in range(40)]
    for _ in stream_generate(model, draft, make_tokenizer(VOCAB), prefix + [0], max_tokens=1, prompt_cache=cache):
        pass
    cache.keep_prefix(prefix + [0])
    save_prompt_cache(path, cache, {"model": "tiny"})
    return path


def damaged(src, dst, arrays=None, meta=None):
    """A copy of ``src`` with its arrays and metadata changed by the given functions."""
    a, m = mx.load(str(src), return_metadata=True)
    a, m = (arrays or (lambda x: x))(dict(a)), (meta or (lambda x: x))(dict(m))
    mx.save_safetensors(str(dst), a, metadata=m)
    return dst


def edit(**changes):
    return lambda m: {k: v for k, v in {**m, **changes}.items() if v is not None}


def first_token_past_vocab(m):
    return {**m, "tokens": json.dumps([VOCAB + 5] + json.loads(m["tokens"])[1:])}


def one_more_token(m):
    return {**m, "tokens": json.dumps(json.loads(m["tokens"]) + [3])}


PLAIN = {
    "no tokens": dict(meta=edit(tokens=None)),
    "tokens not json": dict(meta=edit(tokens="[1, 2")),
    "tokens not a list": dict(meta=edit(tokens='{"a": 1}')),
    "tokens not ids": dict(meta=edit(tokens='[1, "x", 2.5]')),
    "no token": dict(meta=edit(tokens="[]")),
    "a token past the vocabulary": dict(meta=first_token_past_vocab),
    "more tokens than positions": dict(meta=one_more_token),
    "kv settings half there": dict(meta=edit(kv_bits="4")),
    "a tensor missing": dict(arrays=lambda a: {k: v for k, v in a.items() if k != "draft.1.values"}),
    "a tensor cut": dict(arrays=lambda a: {**a, "target.2.keys": a["target.2.keys"][..., :-3, :]}),
    "a tensor of other heads": dict(arrays=lambda a: {**a, "draft.0.keys": a["draft.0.keys"][:, :1]}),
    "a tensor of ints": dict(arrays=lambda a: {**a, "target.0.values": a["target.0.values"].astype(mx.int32)}),
    "a tensor too many": dict(arrays=lambda a: {**a, "target.99.keys": a["target.0.keys"]}),
}
QUANTIZED = {
    "kv settings not numbers": dict(meta=edit(kv_group_size="thirty-two")),
    "a packed part missing": dict(arrays=lambda a: {k: v for k, v in a.items() if k != "target.1.values.2"}),
    "packed keys as floats": dict(arrays=lambda a: {**a, "target.0.keys.0": a["target.0.keys.0"].astype(mx.float16)}),
}
KV = dict(kv_bits=4, kv_group_size=32, quantized_kv_start=0)
TCFG = target_config("qwen3", vocab=VOCAB, layers=5, hidden=128)  # head_dim 32: a group of 32 divides it
DCFG = draft_config(TCFG, layers=2, block_size=8, taps=[0, 3])


@pytest.fixture(scope="module")
def pair():
    return make_target(TCFG, seed=21), make_draft(DCFG, random_draft_weights(DCFG, seed=22))


@pytest.fixture(scope="module")
def files(pair, tmp_path_factory):
    d = tmp_path_factory.mktemp("files")
    return saved(pair, d / "plain.safetensors"), saved(pair, d / "q.safetensors", **KV)


@pytest.mark.parametrize("how", sorted(PLAIN) + sorted(QUANTIZED))
def test_a_damaged_file_is_refused_in_one_sentence(pair, files, tmp_path, how):
    quantized = how in QUANTIZED
    src = files[quantized]
    load_prompt_cache(src, *pair, **(KV if quantized else {}))  # the file as saved loads
    path = damaged(src, tmp_path / "d.safetensors", **(QUANTIZED if quantized else PLAIN)[how])
    with pytest.raises(ValueError, match=SENTENCE):
        load_prompt_cache(path, *pair, **(KV if quantized else {}))


def test_a_file_cut_short_is_refused_in_one_sentence(pair, files, tmp_path):
    data = files[0].read_bytes()
    for keep in (len(data) - 100, len(data) // 2, 40):
        path = tmp_path / "cut.safetensors"
        path.write_bytes(data[:keep])
        with pytest.raises(ValueError, match=r"is not a safetensors file, or is cut short; make a prompt cache"):
            load_prompt_cache(path, *pair)


def test_through_the_cli(pair, tmp_path, monkeypatch):
    from tiny import write_target, write_zlab_draft
    from typer.testing import CliRunner

    from dflash_mlx.cli.app import app

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    write_target(tmp_path / "t", TCFG, pair[0], make_tokenizer(VOCAB))
    write_zlab_draft(tmp_path / "d", DCFG, random_draft_weights(DCFG, seed=22))
    pair = ["--model", str(tmp_path / "t"), "--draft-model", str(tmp_path / "d"), "--ignore-chat-template"]
    made = CliRunner().invoke(
        app,
        ["cache-prompt", *pair, "-p", "a b c d", "--prompt-cache-file", str(tmp_path / "c.safetensors")],
        prog_name="dflash-mlx",
    )
    assert made.exit_code == 0, made.output
    cases = {
        "tokens": dict(meta=edit(tokens="[1, 2")),
        "template": dict(meta=edit(template_kwargs="{not json")),
        "tensor": dict(arrays=lambda a: {k: v for k, v in a.items() if k != "target.3.keys"}),
    }
    for how, change in cases.items():
        path = damaged(tmp_path / "c.safetensors", tmp_path / f"{how}.safetensors", **change)
        result = CliRunner().invoke(
            app,
            ["generate", *pair, "-p", " e", "-m", "4", "--prompt-cache-file", str(path)],
            prog_name="dflash-mlx",
            env={"COLUMNS": "300"},
        )
        said = " ".join(result.stderr.split())
        assert result.exit_code == 1 and said.startswith("error: ") and "is damaged (" in said, (how, result.output)
        assert "Traceback" not in result.output and said.endswith("make it again with `dflash-mlx cache-prompt`."), how
