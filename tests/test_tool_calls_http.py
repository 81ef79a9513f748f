"""A tool call written by the model comes back as ``tool_calls`` over HTTP, whole and streamed,
from a worker and through the front door.

A random model writes a chosen token sequence under greedy decoding when each token of it gets
a bias one step below the one before (the first is the likeliest), with a frequency penalty that
retires a token once written and EOS biased below them all: the sequence, then EOS. That needs
every token of the sequence to differ, which the tool-chat tokenizer makes so for
:data:`~vqpool.worker.testing.model_dirs.TOOL_CALL_JSON`; a token the prompt already holds has
its bias raised by the penalty it starts with (the penalty's window covers prompt and answer).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from front_harness import FrontDoor
from serving_harness import ServingStack
from vqpool.worker.api.openai_api import CHAT, parse_completion
from vqpool.worker.models.loading import LoadedModel
from vqpool.worker.testing.http_client import request_json, stream_events
from vqpool.worker.testing.model_dirs import TOOL_CALL_JSON

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]

CHAT_BODY: dict[str, Any] = {
    "messages": [{"role": "user", "content": "Weather in Paris?"}],
    "tools": TOOLS,
    "chat_template_kwargs": {"enable_thinking": False},
}

BIAS_STEP = 100.0
"""Between two tokens of the forced sequence: far more than a random model's logits spread."""

EXPECTED_CALL = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
"""The call as OpenAI clients read it: arguments as JSON text (mlx-lm's ``json.dumps``)."""


def call_tokens(tool_chat_model: LoadedModel) -> list[int]:
    text = f"<tool_call>{TOOL_CALL_JSON}</tool_call>"
    return [int(t) for t in tool_chat_model.tokenizer.encode(text)]


def forced_body(
    tool_chat_model: LoadedModel, body: dict[str, Any], tokens: list[int]
) -> dict[str, Any]:
    """``body`` with the logit bias and frequency penalty under which greedy decoding writes
    ``tokens`` then EOS."""
    prompt = parse_completion(
        body, CHAT, tool_chat_model, default_max_tokens=8, max_tokens_limit=64
    ).prompt
    in_prompt = Counter(prompt)
    penalty = BIAS_STEP * (len(tokens) + 2)  # a written token falls below EOS
    eos = min(tool_chat_model.tokenizer.eos_token_ids)
    ranks = {token: len(tokens) - i for i, token in enumerate(tokens)} | {eos: 0}
    bias = {
        str(token): BIAS_STEP * (rank + 1) + penalty * in_prompt[token]
        for token, rank in ranks.items()
    }
    return {
        **body,
        "temperature": 0.0,
        "logit_bias": bias,
        "frequency_penalty": penalty,
        "frequency_context_size": len(prompt) + len(tokens) + 1,
        "max_tokens": len(tokens) + 4,
    }


def streamed_answer(events: Iterator[dict[str, Any]]) -> dict[str, Any]:
    """What a client reads from a streamed chat answer: content, the calls with their index
    and finish reason."""
    content, calls, finish = "", [], None
    for event in events:
        for choice in event["choices"]:
            content += choice["delta"].get("content") or ""
            calls += choice["delta"].get("tool_calls", [])
            finish = choice["finish_reason"] or finish
    return {"content": content, "tool_calls": calls, "finish_reason": finish}


def check_tool_call_answers(base_url: str, body: dict[str, Any], tokens: list[int]) -> None:
    whole = request_json(base_url, "POST", "/v1/chat/completions", body)
    assert whole.status == 200, whole
    (choice,) = whole.body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert whole.body["usage"]["completion_tokens"] == len(tokens) + 1  # the call, then EOS
    message = choice["message"]
    assert not message["content"]
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"]
    assert call["function"] == EXPECTED_CALL
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}

    streamed = streamed_answer(stream_events(base_url, "/v1/chat/completions", body))
    assert streamed["finish_reason"] == "tool_calls"
    assert streamed["content"] == ""
    (delta_call,) = streamed["tool_calls"]
    assert delta_call["index"] == 0 and delta_call["type"] == "function"
    assert delta_call["function"] == EXPECTED_CALL


def test_the_forced_sequence_is_distinct_tokens(tool_chat_model: LoadedModel) -> None:
    """The premise of the forcing: no token of the call repeats, none is EOS."""
    tokens = call_tokens(tool_chat_model)
    assert len(set(tokens)) == len(tokens) > 10
    assert not set(tokens) & set(tool_chat_model.tokenizer.eos_token_ids)


def test_a_tool_call_over_http_is_parsed_whole_and_streamed(
    tool_chat_dir: Path, tool_chat_model: LoadedModel
) -> None:
    tokens = call_tokens(tool_chat_model)
    stack = ServingStack([str(tool_chat_dir)]).start()
    try:
        body = forced_body(tool_chat_model, CHAT_BODY, tokens)
        reply = stack.complete(str(tool_chat_dir), {**body, "return_token_ids": True},
                               "/v1/chat/completions")  # fmt: skip
        assert reply.status == 200, reply
        eos = min(tool_chat_model.tokenizer.eos_token_ids)
        assert reply.body["choices"][0]["token_ids"] == [*tokens, eos]
        check_tool_call_answers(stack.url(str(tool_chat_dir)), body, tokens)
        unforced = stack.complete(str(tool_chat_dir), {**CHAT_BODY, "max_tokens": 8},
                                  "/v1/chat/completions")  # fmt: skip
        assert unforced.body["choices"][0]["finish_reason"] == "length"  # no call by chance
        assert "tool_calls" not in unforced.body["choices"][0]["message"]
    finally:
        stack.stop()


def test_a_tool_call_through_the_front_door(
    tool_chat_dir: Path, tool_chat_model: LoadedModel
) -> None:
    tokens = call_tokens(tool_chat_model)
    with FrontDoor("--model", str(tool_chat_dir)) as front:
        (name,) = [entry["id"] for entry in front.get("/v1/models").body["data"]]
        body = {**forced_body(tool_chat_model, CHAT_BODY, tokens), "model": name}
        check_tool_call_answers(front.url, body, tokens)
