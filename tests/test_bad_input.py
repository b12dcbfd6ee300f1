"""Bad input ends in a ValueError whose message names the problem."""

import json

import mlx.core as mx
import pytest
from tiny import (
    draft_config,
    make_draft,
    make_target,
    make_tokenizer,
    random_draft_weights,
    target_config,
    write_target,
    write_zlab_draft,
)

from dflash_mlx import DraftConfig, generate, load, load_draft, stream_generate
from dflash_mlx.draft.dflash import default_target_layer_ids


@pytest.fixture(scope="module")
def setup():
    tcfg = target_config("qwen3", vocab=32, layers=6)
    model = make_target(tcfg)
    dcfg = draft_config(tcfg)
    return tcfg, model, dcfg, random_draft_weights(dcfg)


def checkpoint(tmp_path, cfg, weights):
    return write_zlab_draft(tmp_path / "draft", cfg, weights)


def test_missing_tensor(tmp_path, setup):
    _, _, cfg, w = setup
    w = dict(w)
    del w["layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing tensors layers\.1\.mlp\.up_proj\.weight"):
        load_draft(checkpoint(tmp_path, cfg, w))


def test_extra_tensor(tmp_path, setup):
    _, _, cfg, w = setup
    w = {**w, "lm_head.weight": mx.zeros((32, 64))}
    with pytest.raises(ValueError, match=r"unexpected tensors lm_head\.weight"):
        load_draft(checkpoint(tmp_path, cfg, w))


def test_misshapen_tensor(tmp_path, setup):
    _, _, cfg, w = setup
    w = {**w, "fc.weight": mx.zeros((64, 64))}
    with pytest.raises(ValueError, match=r"misshapen tensors: fc\.weight is \(64, 64\), expected \(64, 128\)"):
        load_draft(checkpoint(tmp_path, cfg, w))


@pytest.mark.parametrize(
    "change,message",
    [
        ({"hidden_size": 32, "head_dim": 8, "intermediate_size": 64}, "hidden size is 32 but the target's is 64"),
        ({"vocab_size": 50}, "vocabulary is 50 tokens but the target's is 32"),
        (
            {"dflash_config": {"target_layer_ids": [1, 9], "mask_token_id": 31}},
            r"target_layer_ids \[9\] do not exist in a 6-layer target",
        ),
        ({"num_target_layers": 8}, "trained on a 8-layer target but this one has 6"),
        ({"dflash_config": {"target_layer_ids": [1, 4], "mask_token_id": 40}}, "mask_token_id 40 is outside"),
    ],
)
def test_drafter_that_does_not_fit_the_target(setup, change, message):
    tcfg, model, cfg, _ = setup
    cfg = {**cfg, **change}
    draft = make_draft(cfg, random_draft_weights(cfg))
    with pytest.raises(ValueError, match="does not fit the target: .*" + message):
        list(stream_generate(model, draft, make_tokenizer(32), [1, 2]))


def test_load_checks_the_pair(tmp_path, setup):
    tcfg, model, cfg, w = setup
    target_dir = write_target(tmp_path / "target", tcfg, model, make_tokenizer(32))
    other = {**cfg, "num_target_layers": 12}
    with pytest.raises(ValueError, match="trained on a 12-layer target but this one has 6"):
        load(str(target_dir), draft=str(write_zlab_draft(tmp_path / "d", other, w)))
    model2, draft, tok = load(str(target_dir), draft=str(write_zlab_draft(tmp_path / "ok", cfg, w)))
    assert generate(model2, draft, tok, [1, 2, 3], max_tokens=5)


@pytest.mark.parametrize("bs", [1, 0, -3, 2.5])
def test_block_size_below_two(setup, bs):
    _, model, cfg, w = setup
    with pytest.raises(ValueError, match="block_size must be an integer >= 2"):
        stream_generate(model, make_draft(cfg, w), make_tokenizer(32), [1], block_size=bs)


@pytest.mark.parametrize("prompt", ["", [], mx.array([], mx.int32)])
def test_empty_prompt(setup, prompt):
    _, model, cfg, w = setup
    with pytest.raises(ValueError, match="the prompt is empty"):
        stream_generate(model, make_draft(cfg, w), make_tokenizer(32), prompt)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"temperature": -1}, "temperature must be >= 0"),
        ({"top_p": 0}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -2}, "top_k must be a non-negative integer"),
        ({"max_tokens": 0}, "max_tokens must be a positive integer"),
    ],
)
def test_bad_sampling_arguments(setup, kwargs, message):
    _, model, cfg, w = setup
    with pytest.raises(ValueError, match=message):
        generate(model, make_draft(cfg, w), make_tokenizer(32), [1], **kwargs)


def test_token_ids_outside_vocabulary(setup):
    _, model, cfg, w = setup
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        generate(model, make_draft(cfg, w), make_tokenizer(32), [1, 32])


# -- config parsing ------------------------------------------------------


def test_config_missing_fields(setup):
    cfg = dict(setup[2])
    del cfg["hidden_size"], cfg["rope_theta"]
    with pytest.raises(ValueError, match="missing hidden_size, rope_theta"):
        DraftConfig.from_dict(cfg)


def test_config_plain_language_model_refused(setup):
    plain = {k: v for k, v in setup[0].items()}
    with pytest.raises(ValueError, match="not a DFlash drafter"):
        DraftConfig.from_dict(plain)


def test_config_dflash2_refused(setup):
    cfg = {**setup[2], "architectures": ["DFlash2DraftModel"]}
    with pytest.raises(ValueError, match="DFlash2"):
        DraftConfig.from_dict(cfg)


def test_config_layer_types_must_match(setup):
    cfg = {**setup[2], "layer_types": ["full_attention"]}
    with pytest.raises(ValueError, match="layer_types lists 1 layers but num_hidden_layers is 2"):
        DraftConfig.from_dict(cfg)
    cfg = {**setup[2], "layer_types": ["sliding_attention", "full_attention"]}
    with pytest.raises(ValueError, match="no sliding_window"):
        DraftConfig.from_dict(cfg)


def test_config_variants_parse(setup):
    tcfg, _, base, _ = setup
    # transformers-5: rope under rope_parameters, no top-level rope_theta.
    t5 = {k: v for k, v in base.items() if k != "rope_theta"}
    t5["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e5}
    c = DraftConfig.from_dict(t5)
    assert c.rope_theta == 5e5 and c.rope_scaling is None
    yarn = {**t5, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}
    assert DraftConfig.from_dict(yarn).rope_scaling["factor"] == 4.0
    # Missing target_layer_ids: Z Lab's spread over the target's layers.
    no_taps = {**base, "num_hidden_layers": 5, "num_target_layers": 36, "dflash_config": {"mask_token_id": 7}}
    assert DraftConfig.from_dict(no_taps).target_layer_ids == [1, 9, 17, 25, 33] == default_target_layer_ids(36, 5)
    # block_size at the top level or in dflash_config; round trip through to_dict.
    nested = {**base, "dflash_config": {**base["dflash_config"], "block_size": 10}}
    nested.pop("block_size")
    c = DraftConfig.from_dict(nested)
    assert c.block_size == 10
    assert DraftConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c


# -- the server's request bodies ---------------------------------------------------


def parse(schema: str, body: dict):
    """The body as the server reads it, with ``schema`` from server/schemas.py."""
    from dflash_mlx.server import schemas

    return schemas.parse_json(json.dumps(body).encode(), getattr(schemas, schema))


def refused(schema: str, body: dict, message: str) -> None:
    from dflash_mlx.server.errors import APIError

    with pytest.raises(APIError) as e:
        parse(schema, body)
    assert e.value.status == 400 and e.value.message == message, e.value.message


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    "tool,message",
    [
        ({"type": "function"}, "tools.0.function: Field required."),
        ({"type": "function", "function": {}}, "tools.0.function.name: Field required."),
        ({"type": "function", "function": {"name": 5}}, "tools.0.function.name: Input should be a valid string."),
        (
            {"type": "function", "function": {"name": "f", "parameters": "x"}},
            "tools.0.function.parameters: Input should be a valid dictionary.",
        ),
        ({"type": "web_search", "function": {"name": "f"}}, "tools.0.type: Input should be 'function'."),
        ({"name": "f"}, "tools.0.type: Field required."),
    ],
)
def test_chat_tool_that_is_not_a_function(tool, message):
    refused("ChatRequest", {**CHAT, "tools": [tool]}, message)


def test_chat_tool_reaches_the_template_as_sent():
    """Keys beyond what the template renders (some clients add their own) pass on as sent."""
    function = {"name": "f", "description": "d", "parameters": {"type": "object"}, "x-client": {"v": 1}}
    tool = {"type": "function", "function": function, "cache_control": {"type": "ephemeral"}}
    body = parse("ChatRequest", {**CHAT, "tools": [tool]})
    assert [t.model_dump(exclude_none=True) for t in body.tools] == [tool]


MESSAGES = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("schema", ["AnthropicRequest", "CountTokensRequest"])
@pytest.mark.parametrize(
    "tool,message",
    [
        ({}, "tools.0.name: Field required."),
        ({"name": 5}, "tools.0.name: Input should be a valid string."),
        ({"name": "f", "input_schema": "x"}, "tools.0.input_schema: Input should be a valid dictionary."),
    ],
)
def test_anthropic_tool_without_a_name_or_schema(schema, tool, message):
    body = MESSAGES if schema == "AnthropicRequest" else {k: v for k, v in MESSAGES.items() if k != "max_tokens"}
    refused(schema, {**body, "tools": [tool]}, message)


def test_anthropic_tool_reaches_the_template_as_a_function():
    from dflash_mlx.server.templates import anthropic_tools

    tool = {"name": "f", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}}
    body = parse("AnthropicRequest", {**MESSAGES, "tools": [tool]})
    function = {"name": "f", "description": "", "parameters": {"type": "object"}}
    assert anthropic_tools(body.tools) == [{"type": "function", "function": function}]
