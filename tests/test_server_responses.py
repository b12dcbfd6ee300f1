"""POST /v1/responses through the official OpenAI client: a real server on
127.0.0.1, the scripted tiny pair on the CPU (see test_server_fixtures)."""

from __future__ import annotations

import itertools
import json

import httpx
import openai
import pytest
from test_server import openai_client, prompt_ids
from test_server_fixtures import KV_PAIR_CONTEXT, kv_pair, scripted_pair, scripted_server, serving  # noqa: F401

from dflash_mlx import stream_generate

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
REPLY = "w13 w14 w15 w16 w17 w18 w19 w20"


def test_text_whole_equals_generate(scripted_pair, scripted_server):
    client = openai_client(scripted_server)
    reply = client.responses.create(model="tiny", input="w30", max_output_tokens=50)
    assert reply.id.startswith("resp_") and reply.object == "response" and reply.status == "completed"
    assert [item.type for item in reply.output] == ["reasoning", "message"]
    assert reply.output[0].content[0].text.strip() == "w12"
    assert reply.output_text.strip() == REPLY
    model, draft, tokenizer = scripted_pair
    messages = [{"role": "user", "content": "w30"}]
    ids = prompt_ids(tokenizer, messages)
    committed = sum(len(r.tokens) for r in stream_generate(model, draft, tokenizer, ids, max_tokens=50))
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (len(ids), committed)
    assert reply.usage.total_tokens == len(ids) + committed
    assert reply.usage.model_extra["dflash"]["cycles"] >= 1

    # instructions are a system message; a list of items reads as the string did
    listed = client.responses.create(
        model="tiny",
        instructions="w9",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "w30"}]}],
        max_output_tokens=50,
        temperature=0,
    )
    with_system = prompt_ids(tokenizer, [{"role": "system", "content": "w9"}, *messages])
    assert listed.output_text == reply.output_text and listed.usage.input_tokens == len(with_system)

    short = client.responses.create(model="tiny", input="w30", max_output_tokens=3)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"


def test_streamed_events_in_order(scripted_server):
    client = openai_client(scripted_server)
    events = list(client.responses.create(model="tiny", input="w30", max_output_tokens=50, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # each item is added, its part added, filled with deltas (runs of them shown once), then done
    kinds = [kind.removeprefix("response.") for kind, _ in itertools.groupby(e.type for e in events)]
    assert kinds == [
        "created",
        "in_progress",
        *("output_item.added", "content_part.added", "reasoning_text.delta"),
        *("reasoning_text.done", "content_part.done", "output_item.done"),
        *("output_item.added", "content_part.added", "output_text.delta"),
        *("output_text.done", "content_part.done", "output_item.done"),
        "completed",
    ]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    final = events[-1].response
    assert text == final.output_text and text.strip() == REPLY and reasoning.strip() == "w12"
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert done.text == text
    assert [i.type for i in final.output] == ["reasoning", "message"] and final.status == "completed"
    assert final.usage.output_tokens > 0

    # the client's stream helper reads the same events into the same response
    with client.responses.stream(model="tiny", input="w30", max_output_tokens=50) as stream:
        helped = stream.get_final_response()
    assert helped.output_text == text and helped.status == "completed"


def test_function_call_item_and_its_output(scripted_server):
    client = openai_client(scripted_server)
    reply = client.responses.create(model="tiny", input="weather in Paris?", tools=[WEATHER], max_output_tokens=20)
    (call,) = reply.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id and reply.output_text == ""

    events = list(
        client.responses.create(
            model="tiny", input="weather in Paris?", tools=[WEATHER], max_output_tokens=20, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert json.loads(events[4].arguments) == {"city": "Paris"} and events[5].item.name == "get_weather"

    # the call and its output go back as items
    after = client.responses.create(
        model="tiny",
        input=[
            {"role": "user", "content": "weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "w13"},
        ],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=20,
    )
    assert after.status == "completed"

    # an agent's loop: the tool's output continues the stored call
    followed = client.responses.create(
        model="tiny",
        previous_response_id=reply.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "w13"}],
        max_output_tokens=20,
    )
    assert followed.status == "completed" and followed.usage.input_tokens > reply.usage.input_tokens


@pytest.fixture
def dflash_only_server(scripted_pair):
    """Its own server, batching off: a request submitted while the last one's
    cache is being kept counts two clients together, and a batch (no prompt
    cache) could serve it, whichever way the machine's timing fell."""
    with serving(*scripted_pair, batching="off") as url:
        yield url


def test_previous_response_id_continues_the_conversation(scripted_pair, dflash_only_server):
    client = openai_client(dflash_only_server)
    first = client.responses.create(model="tiny", input="w30", max_output_tokens=50)
    second = client.responses.create(model="tiny", input="w31", previous_response_id=first.id, max_output_tokens=50)
    tokenizer = scripted_pair[2]
    turns = [
        {"role": "user", "content": "w30"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "w31"},
    ]
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == len(prompt_ids(tokenizer, turns))
    # the prompt continues the first turn's, so its prefix comes from the prompt cache
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 1
    assert client.responses.retrieve(second.id).output_text == second.output_text

    with pytest.raises(openai.NotFoundError) as refused:
        client.responses.create(model="tiny", input="w31", previous_response_id="resp_unknown")
    assert "resp_unknown" in refused.value.message

    unkept = client.responses.create(model="tiny", input="w30", max_output_tokens=5, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input="w31", previous_response_id=unkept.id)


def test_unknown_and_unsupported_fields_refused_by_name(scripted_server):
    def post(body):
        return httpx.post(f"{scripted_server}/v1/responses", json=body, timeout=60)

    for body, param in (
        ({"input": "w30", "frobnicate": 1}, "frobnicate"),
        ({"input": "w30", "reasoning": {"effort": "low", "bogus": 1}}, "reasoning.bogus"),
        ({"input": "w30", "tools": [{"type": "web_search"}]}, "tools.0.type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.content.0.type",
        ),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id"),
        ({"input": "w30", "text": {"format": {"type": "json_object"}}}, "text.format"),
        ({"input": "w30", "max_output_tokens": "7"}, "max_output_tokens"),
    ):
        response = post(body)
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert error["param"] == param and param in error["message"], error
    ok = post({"input": "w30", "max_output_tokens": 2, "store": False, "reasoning": {"effort": "low"}, "include": []})
    assert ok.status_code == 200, ok.text
    plain = httpx.post(f"{scripted_server}/v1/responses", content=b'{"input": "w30"}', timeout=60)
    assert plain.status_code == 415


def test_a_reply_past_the_context_is_refused_naming_max_output_tokens(kv_pair):
    with serving(*kv_pair[2]) as url:
        body = {"input": "w7 w8 w9 w10 w11 w12", "max_output_tokens": KV_PAIR_CONTEXT}
        asked = httpx.post(f"{url}/v1/responses", json=body, timeout=60)
        assert asked.status_code == 400, asked.text
        error = asked.json()["error"]
        assert (error["param"], error["code"]) == ("max_output_tokens", "context_length_exceeded")
        assert f"+ {KV_PAIR_CONTEXT} > {KV_PAIR_CONTEXT}" in error["message"]
        assert httpx.get(f"{url}/health").json()["stored_responses"] == 0
