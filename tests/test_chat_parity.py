"""The chat side of mlx_lm.server's API on vqpool-worker: tools, tool messages, template kwargs,
/v1/models entries.

Rendering is compared in-process, token for token, with mlx-lm's own ``apply_chat_template``
called as ``mlx_lm.server`` calls it, on a test-written model directory whose chat template uses
tools and a thinking switch (:data:`~vqpool.worker.testing.model_dirs.TOOL_CHAT_TEMPLATE`). The
HTTP surface is checked on a real worker (real vqpoold) serving that directory: its greedy
answer to a tool conversation is mlx-lm's ``generate_step`` on the same prompt tokens.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from daemon_harness import remove_tree, short_tmpdir
from mlx_lm.generate import generate_step
from serving_harness import ServingStack
from vqpool.worker.api.openai_api import CHAT, ApiError, parse_completion
from vqpool.worker.models.loading import LoadedModel, load_model
from vqpool.worker.testing.http_client import request_json
from vqpool.worker.testing.model_dirs import write_model_dir

MAX_TOKENS = 12

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]

TOOL_CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]


@pytest.fixture(scope="module")
def model_dir() -> Iterator[Path]:
    base = short_tmpdir("vqc")
    yield write_model_dir(base / "tools", "llama", tool_chat=True)
    remove_tree(base)


@pytest.fixture(scope="module")
def loaded(model_dir: Path) -> LoadedModel:
    return load_model(str(model_dir))


@pytest.fixture(scope="module")
def stack(model_dir: Path) -> Iterator[ServingStack]:
    serving = ServingStack([str(model_dir), "builtin:llama"]).start()
    yield serving
    serving.stop()


def mlx_server_prompt(model_dir: Path, body: dict[str, Any]) -> list[int]:
    """The prompt tokens mlx_lm.server renders for a chat ``body``: its own message processing
    and its own ``apply_chat_template`` call (with no ``--chat-template-args``)."""
    from mlx_lm import load
    from mlx_lm.server import process_message_content

    tokenizer = load(str(model_dir))[1]
    messages = copy.deepcopy(body["messages"])
    process_message_content(messages)
    tokens = tokenizer.apply_chat_template(
        messages,
        add_generation_prompt=True,
        tools=body.get("tools") or None,
        tokenize=True,
        **(body.get("chat_template_kwargs") or {}),
    )
    return [int(t) for t in tokens]


def worker_prompt(loaded: LoadedModel, body: dict[str, Any]) -> list[int]:
    request = parse_completion(body, CHAT, loaded, default_max_tokens=8, max_tokens_limit=64)
    return request.prompt


BODIES: dict[str, dict[str, Any]] = {
    "tools and a tool conversation": {"messages": TOOL_CONVERSATION, "tools": TOOLS},
    "thinking switched off": {
        "messages": TOOL_CONVERSATION,
        "tools": TOOLS,
        "chat_template_kwargs": {"enable_thinking": False},
    },
    "content as text parts, no tools": {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}]
    },
    "arguments sent as an object": {
        "messages": [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "c9",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c9", "content": "snow"},
        ],
        "tools": TOOLS,
    },
}


@pytest.mark.parametrize("case", sorted(BODIES))
def test_chat_renders_as_mlx_lm_server_renders_it(
    case: str, model_dir: Path, loaded: LoadedModel
) -> None:
    body = BODIES[case]
    sent = copy.deepcopy(body)
    expected = mlx_server_prompt(model_dir, body)
    assert worker_prompt(loaded, body) == expected
    assert body == sent  # the request's messages are not changed in place


def test_the_rendering_uses_tools_calls_and_the_thinking_switch(
    model_dir: Path, loaded: LoadedModel
) -> None:
    """The premise of the parity test: every argument changes the rendered prompt."""
    with_tools = worker_prompt(loaded, BODIES["tools and a tool conversation"])
    no_thinking = worker_prompt(loaded, BODIES["thinking switched off"])
    no_tools = worker_prompt(loaded, {"messages": TOOL_CONVERSATION})
    assert len({tuple(with_tools), tuple(no_thinking), tuple(no_tools)}) == 3
    from mlx_lm import load

    text = load(str(model_dir))[1].decode(with_tools)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "<|tool|>[call_1]sunny, 21 C" in text
    assert text.endswith("<|assistant|><think>")


@pytest.mark.parametrize(
    ("change", "param", "message"),
    [
        ({"tools": {"name": "x"}}, "tools", "tools must be a list"),
        ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs", "must be an object"),
        (
            {"messages": [{"role": "assistant", "content": None, "tool_calls": "x"}]},
            "messages",
            "tool_calls must be a list",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}],
                    }
                ]
            },
            "messages",
            "arguments must be JSON",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages",
            "list of text parts",
        ),
    ],
)
def test_malformed_tool_fields_are_refused_by_name(
    change: dict[str, Any], param: str, message: str, loaded: LoadedModel
) -> None:
    body = {"messages": TOOL_CONVERSATION, **change}
    with pytest.raises(ApiError) as refused:
        worker_prompt(loaded, body)
    assert refused.value.status == 400
    assert refused.value.param == param
    assert message in refused.value.message


def test_a_tool_conversation_is_served_as_mlx_lm_generates_it(
    stack: ServingStack, model_dir: Path
) -> None:
    body = {**BODIES["tools and a tool conversation"], "max_tokens": MAX_TOKENS}
    reply = stack.complete(
        str(model_dir), {**body, "return_token_ids": True}, "/v1/chat/completions"
    )
    assert reply.status == 200, reply
    prompt = mlx_server_prompt(model_dir, body)
    assert reply.body["usage"]["prompt_tokens"] == len(prompt)

    from mlx_lm import load

    model = load(str(model_dir))[0]
    steps = generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS)
    expected = [int(token) for token, _ in steps]
    choice = reply.body["choices"][0]
    assert choice["finish_reason"] == "length"  # random weights: no EOS within a few tokens
    assert choice["token_ids"] == expected


def test_the_byte_template_refuses_tools_by_name(stack: ServingStack) -> None:
    """The built-in models' fixed template has no place for tools: refused, not ignored."""
    for change, param in (
        ({"tools": TOOLS}, "tools"),
        ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
    ):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **change}
        reply = stack.complete("builtin:llama", body, "/v1/chat/completions")
        assert reply.status == 400, reply
        assert reply.body["error"]["param"] == param
        assert param in reply.body["error"]["message"]
    tool_messages = {"messages": TOOL_CONVERSATION, "max_tokens": 2}
    reply = stack.complete("builtin:llama", tool_messages, "/v1/chat/completions")
    assert reply.status == 400, reply
    assert "tool_calls" in reply.body["error"]["message"]


def test_models_entries_carry_created(stack: ServingStack, model_dir: Path) -> None:
    before = int(time.time())
    reply = request_json(stack.url(str(model_dir)), "GET", "/v1/models")
    assert reply.status == 200
    (entry,) = reply.body["data"]
    assert entry["id"] == str(model_dir)
    assert entry["object"] == "model"
    assert isinstance(entry["created"], int) and 0 < entry["created"] <= before
    again = request_json(stack.url(str(model_dir)), "GET", "/v1/models").body["data"][0]
    assert again["created"] == entry["created"]  # the worker's start, not the request's time
