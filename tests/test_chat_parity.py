"""The chat side of mlx_lm.server's API on vqpool-worker: tools, tool messages, template kwargs,
the answer split into reasoning, tool calls and content, /v1/models entries.

Rendering is compared in-process, token for token, with mlx-lm's own ``apply_chat_template``
called as ``mlx_lm.server`` calls it, on a test-written model directory whose chat template uses
tools and a thinking switch (:data:`~vqpool.worker.testing.model_dirs.TOOL_CHAT_TEMPLATE`). The
HTTP surface is checked on a real worker (real vqpoold) serving that directory: its greedy
answer to a tool conversation is mlx-lm's ``generate_step`` on the same prompt tokens.

The answer split is compared with mlx_lm.server's own handler (``APIHandler.handle_completion``)
given the same tokens, whole and streamed: its generator is replaced by a replay of them, since a
random model cannot be made to write a tool call yet (no logit_bias). Over HTTP, the thinking
template makes the whole random answer reasoning.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from serving_harness import ServingStack
from vqpool.shared.api_error import ApiError
from vqpool.worker.api.chat_output import ChatOutput
from vqpool.worker.api.completion_text import CompletionText
from vqpool.worker.api.openai_api import CHAT, ResponseBuilder, parse_completion
from vqpool.worker.models.loading import LoadedModel, load_model
from vqpool.worker.testing.http_client import request_json, stream_events

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
def stack(tool_chat_dir: Path) -> Iterator[ServingStack]:
    serving = ServingStack([str(tool_chat_dir), "builtin:llama"]).start()
    yield serving
    serving.stop()


def mlx_server_prompt(tool_chat_dir: Path, body: dict[str, Any]) -> list[int]:
    """The prompt tokens mlx_lm.server renders for a chat ``body``: its own message processing
    and its own ``apply_chat_template`` call (with no ``--chat-template-args``)."""
    from mlx_lm import load
    from mlx_lm.server import process_message_content

    tokenizer = load(str(tool_chat_dir))[1]
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


def worker_prompt(tool_chat_model: LoadedModel, body: dict[str, Any]) -> list[int]:
    request = parse_completion(
        body, CHAT, tool_chat_model, default_max_tokens=8, max_tokens_limit=64
    )
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
    case: str, tool_chat_dir: Path, tool_chat_model: LoadedModel
) -> None:
    body = BODIES[case]
    sent = copy.deepcopy(body)
    expected = mlx_server_prompt(tool_chat_dir, body)
    assert worker_prompt(tool_chat_model, body) == expected
    assert body == sent  # the request's messages are not changed in place


def test_the_rendering_uses_tools_calls_and_the_thinking_switch(
    tool_chat_dir: Path, tool_chat_model: LoadedModel
) -> None:
    """The premise of the parity test: every argument changes the rendered prompt."""
    with_tools = worker_prompt(tool_chat_model, BODIES["tools and a tool conversation"])
    no_thinking = worker_prompt(tool_chat_model, BODIES["thinking switched off"])
    no_tools = worker_prompt(tool_chat_model, {"messages": TOOL_CONVERSATION})
    assert len({tuple(with_tools), tuple(no_thinking), tuple(no_tools)}) == 3
    from mlx_lm import load

    text = load(str(tool_chat_dir))[1].decode(with_tools)
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
    change: dict[str, Any], param: str, message: str, tool_chat_model: LoadedModel
) -> None:
    body = {"messages": TOOL_CONVERSATION, **change}
    with pytest.raises(ApiError) as refused:
        worker_prompt(tool_chat_model, body)
    assert refused.value.status == 400
    assert refused.value.param == param
    assert message in refused.value.message


def test_a_tool_conversation_is_served_as_mlx_lm_generates_it(
    stack: ServingStack, tool_chat_dir: Path
) -> None:
    body = {**BODIES["tools and a tool conversation"], "max_tokens": MAX_TOKENS}
    reply = stack.complete(
        str(tool_chat_dir), {**body, "return_token_ids": True}, "/v1/chat/completions"
    )
    assert reply.status == 200, reply
    prompt = mlx_server_prompt(tool_chat_dir, body)
    assert reply.body["usage"]["prompt_tokens"] == len(prompt)

    from mlx_lm import load

    model = load(str(tool_chat_dir))[0]
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


def test_models_entries_carry_created(stack: ServingStack, tool_chat_dir: Path) -> None:
    before = int(time.time())
    reply = request_json(stack.url(str(tool_chat_dir)), "GET", "/v1/models")
    assert reply.status == 200
    (entry,) = reply.body["data"]
    assert entry["id"] == str(tool_chat_dir)
    assert entry["object"] == "model"
    assert isinstance(entry["created"], int) and 0 < entry["created"] <= before
    again = request_json(stack.url(str(tool_chat_dir)), "GET", "/v1/models").body["data"][0]
    assert again["created"] == entry["created"]  # the worker's start, not the request's time


# -- the answer split: reasoning, tool calls, content ---------------------------------------------

REASONING_THEN_CALL = (
    'plan it</think>Let me check.<tool_call>{"name": "get_weather", "arguments": '
    '{"city": "Paris"}}</tool_call>'
)
ANSWERS = {
    "reasoning then a tool call": (REASONING_THEN_CALL, "stop"),
    "reasoning then text": ("hm</think>It is sunny.", "stop"),
    "cut inside the reasoning": ("still thinking about <tool", "length"),
    "two tool calls": (
        '</think><tool_call>{"name": "a", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "b", "arguments": {"n": 1}}</tool_call>',
        "stop",
    ),
}


class _ReplayedGeneration:
    """mlx_lm.server's response generator replaced by a replay of known tokens: its own
    handler then builds the answer to them (the reference)."""

    def __init__(self, ctx: Any, responses: list[Any]) -> None:
        self._ctx, self._responses = ctx, responses
        self.cli_args = None

    def generate(self, request: Any, args: Any, progress_callback: Any = None) -> Any:
        return self._ctx, iter(self._responses)


def mlx_server_answer(
    tool_chat_dir: Path, prompt: list[int], answer: str, finish: str, stream: bool
) -> list[dict[str, Any]]:
    """What mlx_lm.server's handler answers when the model generates ``answer``'s tokens and
    ends with ``finish`` (a stop is an EOS token): its response objects, in order."""
    import io

    from mlx_lm import load
    from mlx_lm.generate import make_text_state_machine
    from mlx_lm.server import APIHandler, GenerationContext, Response
    from mlx_lm.server import CompletionRequest as MlxRequest

    tokenizer = load(str(tool_chat_dir))[1]
    markers = load_model(str(tool_chat_dir)).tokenizer.output_markers(prompt)
    assert markers is not None
    ctx = GenerationContext(
        tokenizer.has_tool_calling,
        tokenizer.has_thinking,
        tokenizer.tool_parser,
        make_text_state_machine(tokenizer),
        markers.initial_state,
        prompt,
    )
    detokenizer = tokenizer.detokenizer
    no_top_tokens: Any = ()
    responses = []
    tokens = tokenizer.encode(answer, add_special_tokens=False)
    for i, token in enumerate(tokens):
        detokenizer.add_token(token)
        last = i == len(tokens) - 1 and finish == "length"
        if last:
            detokenizer.finalize()
        responses.append(
            Response(detokenizer.last_segment, token, 0.0, finish if last else None, no_top_tokens)
        )
    if finish == "stop":
        responses.append(Response("", tokenizer.eos_token_id, 0.0, "stop", no_top_tokens))

    class Handler(APIHandler):
        def __init__(self) -> None:  # no socket: only the answer building is used
            pass

        def _set_completion_headers(self, status_code: int = 200) -> None:
            pass

        def _set_stream_headers(self, status_code: int = 200) -> None:
            pass

        def send_header(self, keyword: str, value: str) -> None:
            pass

        def end_headers(self) -> None:
            pass

    handler = Handler()
    fields = dict(
        stream=stream, stream_options=None, requested_model="m", requested_draft_model=None,
        adapter=None, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, xtc_probability=0.0,
        xtc_threshold=0.0, logit_bias=None, repetition_penalty=0.0, repetition_context_size=20,
        presence_penalty=0.0, presence_context_size=20, frequency_penalty=0.0,
        frequency_context_size=20, max_tokens=64, num_draft_tokens=0, logprobs=False,
        top_logprobs=-1, seed=None, chat_template_kwargs=None, request_id="x",
        system_fingerprint="x", created=0,
        object_type="chat.completion.chunk" if stream else "chat.completion",
    )  # fmt: skip
    for name, value in fields.items():
        setattr(handler, name, value)
    handler.wfile = io.BytesIO()
    handler.response_generator = _ReplayedGeneration(ctx, responses)  # type: ignore[assignment]
    handler.handle_completion(MlxRequest("chat", "", [], TOOLS, None), [])
    raw = handler.wfile.getvalue().decode()
    if not stream:
        return [json.loads(raw)]
    events = [line[len("data: ") :] for line in raw.splitlines() if line.startswith("data: ")]
    return [json.loads(e) for e in events if e != "[DONE]"]


def worker_answer(
    tool_chat_model: LoadedModel, prompt: list[int], answer: str, finish: str, stream: bool
) -> list[dict[str, Any]]:
    """The worker's response objects for the same tokens, built as its handler builds them."""
    tokenizer = tool_chat_model.tokenizer
    markers = tokenizer.output_markers(prompt)
    assert markers is not None
    output = ChatOutput(markers, TOOLS, streaming=stream)
    text = CompletionText(tokenizer, (), 0)
    builder = ResponseBuilder(CHAT, "m")
    tokens = tokenizer.encode(answer)
    if not stream:
        output.add("".join(text.add(t) for t in tokens) + text.finish())
        output.end(finish)
        delta = output.take()
        reason = output.finish_reason(finish)
        return [
            builder.complete(
                delta.content, reason, None, len(prompt), len(tokens),
                reasoning=delta.reasoning, tool_calls=delta.tool_calls,
            )
        ]  # fmt: skip
    chunks = []
    for token in tokens:
        output.add(text.add(token))
        if not output.in_tool_call and (delta := output.take()):
            chunks.append(
                builder.chunk(delta.content, reasoning=delta.reasoning, tool_calls=delta.tool_calls)
            )
    output.add(text.finish())
    output.end(finish)
    delta = output.take()
    reason = output.finish_reason(finish)
    chunks.append(
        builder.chunk(delta.content, reason, reasoning=delta.reasoning, tool_calls=delta.tool_calls)
    )
    return chunks


def answer_parts(responses: list[dict[str, Any]]) -> dict[str, Any]:
    """What a client reads from responses (whole or streamed): content, reasoning, tool calls
    (their random ids apart) and finish reason."""
    key = "delta" if responses[0]["object"] == "chat.completion.chunk" else "message"
    parts: dict[str, Any] = {"content": "", "reasoning": "", "tool_calls": []}
    for response in responses:
        (choice,) = response["choices"]
        message = choice[key]
        parts["content"] += message.get("content") or ""
        parts["reasoning"] += message.get("reasoning", "")
        if "reasoning_content" in message:
            assert message["reasoning_content"] == message["reasoning"]
        for call in message.get("tool_calls", []):
            assert call.pop("id")
            parts["tool_calls"].append(call)
        if choice["finish_reason"]:
            parts["finish_reason"] = choice["finish_reason"]
    if key == "message":
        parts["null_content"] = responses[0]["choices"][0]["message"]["content"] is None
    return parts


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("case", sorted(ANSWERS))
def test_an_answer_splits_as_mlx_lm_server_splits_it(
    case: str, stream: bool, tool_chat_dir: Path, tool_chat_model: LoadedModel
) -> None:
    answer, finish = ANSWERS[case]
    prompt = worker_prompt(tool_chat_model, {"messages": TOOL_CONVERSATION, "tools": TOOLS})
    expected = answer_parts(mlx_server_answer(tool_chat_dir, prompt, answer, finish, stream))
    assert answer_parts(worker_answer(tool_chat_model, prompt, answer, finish, stream)) == expected


def test_the_split_answers_name_what_they_found(
    tool_chat_dir: Path, tool_chat_model: LoadedModel
) -> None:
    """The premise of the parity test: the reference really finds reasoning and calls."""
    prompt = worker_prompt(tool_chat_model, {"messages": TOOL_CONVERSATION, "tools": TOOLS})
    whole = worker_answer(tool_chat_model, prompt, REASONING_THEN_CALL, "stop", False)[0]
    assert whole["choices"][0]["finish_reason"] == "tool_calls"
    message = whole["choices"][0]["message"]
    assert message["reasoning_content"] == "plan it"
    assert message["content"] == "Let me check."
    (call,) = message["tool_calls"]
    assert call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    streamed = worker_answer(tool_chat_model, prompt, REASONING_THEN_CALL, "stop", True)
    calls = [c for chunk in streamed for c in chunk["choices"][0]["delta"].get("tool_calls", [])]
    assert [c["index"] for c in calls] == [0]


def test_a_thinking_answer_is_reasoning_over_http(stack: ServingStack, tool_chat_dir: Path) -> None:
    """The template opens ``<think>`` (enable_thinking, on by default for a thinking tokenizer):
    the whole answer is reasoning, content null; switched off, it is content."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX_TOKENS}
    model = str(tool_chat_dir)
    thinking = stack.complete(model, body, "/v1/chat/completions")
    assert thinking.status == 200, thinking
    message = thinking.body["choices"][0]["message"]
    plain_body = {**body, "chat_template_kwargs": {"enable_thinking": False}}
    plain = stack.complete(model, plain_body, "/v1/chat/completions").body
    assert message["content"] is None
    assert message["reasoning_content"] == message["reasoning"]
    assert "</think>" not in message["reasoning"] and message["reasoning"]
    assert plain["choices"][0]["message"].get("reasoning") is None
    assert plain["choices"][0]["message"]["content"]

    events = stream_events(stack.url(model), "/v1/chat/completions", {**body, "stream": True})
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning"]
    assert all("content" not in d for d in deltas)


@pytest.mark.parametrize(
    ("field", "value"),
    [("draft_model", "some/draft"), ("adapters", "some/adapter")],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_fields_the_worker_cannot_honour_are_refused_by_name(
    field: str, value: Any, path: str, stack: ServingStack
) -> None:
    body: dict[str, Any] = {"max_tokens": 2, field: value}
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    body.update({"prompt": "hi"} if path == "/v1/completions" else chat)
    before = stack.worker_stats("builtin:llama")["requests"]
    reply = stack.complete("builtin:llama", body, path)
    assert reply.status == 400, reply
    assert reply.body["error"]["param"] == field
    assert reply.body["error"]["message"].startswith(f"{field}: ")
    assert stack.worker_stats("builtin:llama")["requests"] == before  # nothing ran
    null = stack.complete("builtin:llama", {"prompt": "hi", "max_tokens": 2, field: None})
    assert null.status == 200, null  # null is mlx_lm.server's "not given"


def test_a_streamed_thinking_answer_reports_every_token(
    stack: ServingStack, tool_chat_dir: Path
) -> None:
    """With ``return_token_ids`` every token's chunk is sent, split or not: the ids streamed are
    the whole answer's, and so is the reasoning."""
    body = {
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": MAX_TOKENS,
        "return_token_ids": True,
    }
    whole = stack.complete(str(tool_chat_dir), body, "/v1/chat/completions").body["choices"][0]
    events = stream_events(stack.url(str(tool_chat_dir)), "/v1/chat/completions", body)
    choices = [e["choices"][0] for e in events if e["choices"]]
    assert [t for c in choices for t in c["token_ids"]] == whole["token_ids"]
    assert (
        "".join(c["delta"].get("reasoning", "") for c in choices) == whole["message"]["reasoning"]
    )
    assert choices[-1]["finish_reason"] == whole["finish_reason"] == "length"
