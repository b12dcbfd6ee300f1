"""`dflash-mlx serve` through the official OpenAI and Anthropic clients: a
real server on 127.0.0.1, tiny pairs on the CPU."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
from test_server_fixtures import chat_pair, chat_server, scripted_pair, scripted_server, serving  # noqa: F401

from dflash_mlx import generate, stream_generate

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def openai_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def anthropic_client(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=60)


def prompt_ids(tokenizer, messages, **kwargs) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs))


def reference(pair, messages, max_tokens, **kwargs) -> str:
    model, draft, tokenizer = pair
    return generate(model, draft, tokenizer, prompt_ids(tokenizer, messages), max_tokens=max_tokens, **kwargs)


# -- OpenAI chat completions ----------------------------------------------------------
def test_chat_equals_generate_streamed_and_not(chat_pair, chat_server):
    messages = [{"role": "system", "content": "w9"}, {"role": "user", "content": "w7 w8 w11"}]
    expected = reference(chat_pair, messages, 12)
    client = openai_client(chat_server)

    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    assert reply.choices[0].message.content == expected
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens == len(prompt_ids(chat_pair[2], messages))
    assert reply.usage.completion_tokens == 12
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 12
    figures = reply.usage.model_extra["dflash"]
    assert figures["cycles"] >= 1 and figures["block_sizes"] and 0 <= figures["acceptance_rate"] <= 1
    assert isinstance(figures["plain_decoding"], bool)

    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_completion_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_seeded_sampling_is_repeatable(chat_server):
    client = openai_client(chat_server)

    def sample(seed):
        return (
            client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "w20 w21"}],
                max_tokens=16,
                temperature=1.0,
                top_p=0.95,
                seed=seed,
            )
            .choices[0]
            .message.content
        )

    first = sample(7)
    assert sample(7) == first
    assert first != sample(8) or first != sample(9)


def test_second_turn_is_served_from_the_prompt_cache(chat_pair):
    # DFlash's path keeps prompt caches; a batch keeps its own (test_server_batch.py), and the
    # module's shared server may still count other tests' clients as company for a batch
    with serving(*chat_pair, batching="off") as url:
        client = openai_client(url)
        turn = [{"role": "user", "content": "w30 w31 w32 w33"}]
        first = client.chat.completions.create(model="tiny", messages=turn, max_tokens=8)
        turn += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "w40"}]
        second = client.chat.completions.create(model="tiny", messages=turn, max_tokens=8)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    assert second.choices[0].message.content == reference(chat_pair, turn, 8)


def test_stop_strings_end_the_reply(scripted_server):
    client = openai_client(scripted_server)
    messages = [{"role": "user", "content": "w30"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, stop=["w16", "w19"], max_tokens=50)
    assert reply.choices[0].message.content.strip() == "w13 w14 w15"
    assert reply.choices[0].finish_reason == "stop"
    chunks = client.chat.completions.create(model="tiny", messages=messages, stop="w15", max_tokens=50, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks).strip() == "w13 w14"


def test_reasoning_apart_from_content_and_thinking_off(scripted_pair, scripted_server):
    client = openai_client(scripted_server)
    messages = [{"role": "user", "content": "w30"}]
    thinking = client.chat.completions.create(model="tiny", messages=messages, max_tokens=50)
    message = thinking.choices[0].message
    assert message.model_extra["reasoning_content"].strip() == "w12"
    assert message.content.strip() == "w13 w14 w15 w16 w17 w18 w19 w20"
    assert thinking.choices[0].finish_reason == "stop"
    model, draft, tokenizer = scripted_pair
    committed = sum(
        len(r.tokens) for r in stream_generate(model, draft, tokenizer, prompt_ids(tokenizer, messages), max_tokens=50)
    )
    assert thinking.usage.completion_tokens == committed

    for switch in ({"chat_template_kwargs": {"enable_thinking": False}}, {"enable_thinking": False}):
        plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=50, extra_body=switch)
        assert "reasoning_content" not in (plain.choices[0].message.model_extra or {})
        assert plain.choices[0].message.content.strip() == "w13 w14 w15 w16 w17 w18 w19 w20"

    streamed = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=50, stream=True))
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content", "") for c in streamed)
    assert reasoning.strip() == "w12"


def test_tool_call_parsed(scripted_server):
    client = openai_client(scripted_server)
    messages = [{"role": "user", "content": "weather in Paris?"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER_TOOL], max_tokens=20)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=messages, tools=[WEATHER_TOOL], max_tokens=20, stream=True
        )
    )
    calls = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    assert [(t.index, t.function.name, json.loads(t.function.arguments)) for t in calls] == [
        (0, "get_weather", {"city": "Paris"})
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    # the call and its result go back through the template for the next turn
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "w13"},
    ]
    after = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20)
    assert after.choices[0].finish_reason == "stop"


# -- completions, models, health ---------------------------------------------------------
def test_completions_models_and_health(scripted_server):
    client = openai_client(scripted_server)
    reply = client.completions.create(model="tiny", prompt="w13", max_tokens=20)
    assert reply.choices[0].text == "w14 w15 w16 w17 w18 w19 w20"
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.prompt_tokens == 1
    streamed = client.completions.create(model="tiny", prompt="w13", max_tokens=3, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == "w14 w15 w16"
    assert [m.id for m in client.models.list()] == ["tiny"]
    health = httpx.get(f"{scripted_server}/health").json()
    assert health["status"] == "ok" and health["busy"] is False and health["served"] >= 2


# -- Anthropic messages -----------------------------------------------------------------------
def test_anthropic_text_and_system_equal_generate(chat_pair, chat_server):
    client = anthropic_client(chat_server)
    expected = reference(chat_pair, [{"role": "system", "content": "w9"}, {"role": "user", "content": "w7 w8"}], 10)
    reply = client.messages.create(
        model="tiny", max_tokens=10, system="w9", messages=[{"role": "user", "content": "w7 w8"}]
    )
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text == expected
    assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == 10
    with client.messages.stream(
        model="tiny",
        max_tokens=10,
        system=[{"type": "text", "text": "w9"}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "w7 w8"}]}],
    ) as stream:
        assert stream.get_final_text() == expected
        final = stream.get_final_message()
    assert final.stop_reason == "max_tokens"
    assert (
        final.usage.input_tokens + final.usage.cache_read_input_tokens
        == reply.usage.input_tokens + reply.usage.cache_read_input_tokens
    )


def test_anthropic_stop_sequences_thinking_and_tool_use(scripted_server):
    client = anthropic_client(scripted_server)
    user = [{"role": "user", "content": "w30"}]
    stopped = client.messages.create(
        model="tiny",
        max_tokens=50,
        messages=user,
        stop_sequences=["w17"],
        thinking={"type": "enabled", "budget_tokens": 1024},
    )
    assert [b.type for b in stopped.content] == ["thinking", "text"]
    assert stopped.content[0].thinking.strip() == "w12"
    assert stopped.content[1].text.strip() == "w13 w14 w15 w16"
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "w17"

    plain = client.messages.create(model="tiny", max_tokens=50, messages=user, thinking={"type": "disabled"})
    assert [b.type for b in plain.content] == ["text"] and plain.stop_reason == "end_turn"

    tools = [
        {
            "name": "get_weather",
            "description": "Weather in a city",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
    ]
    called = client.messages.create(model="tiny", max_tokens=50, messages=user, tools=tools)
    (use,) = [b for b in called.content if b.type == "tool_use"]
    assert (use.name, use.input, called.stop_reason) == ("get_weather", {"city": "Paris"}, "tool_use")
    with client.messages.stream(model="tiny", max_tokens=50, messages=user, tools=tools) as stream:
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "input", None)) for b in final.content] == [("tool_use", {"city": "Paris"})]

    answered = client.messages.create(
        model="tiny",
        max_tokens=50,
        tools=tools,
        messages=user
        + [
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "w13"}]},
        ],
    )
    assert answered.stop_reason in ("tool_use", "end_turn")
