"""The worker as a drop-in for ``mlx_lm.server``: stop sequences (whole and streamed), logprobs,
``--served-model-name``, usage once per stream, 405 for a route's other method, and the
``openai`` Python client (the one users run) against a live worker and daemon."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from serving_harness import ServingStack
from vqpool.worker.models.tiny_models import build_tiny_model
from vqpool.worker.testing.http_client import request_json, stream_events

LLAMA = "builtin:llama"
NAMED = "tiny-chat"
PROMPT = "The pool hands out blocks of sixteen tokens"


@pytest.fixture(scope="module")
def stack() -> Iterator[ServingStack]:
    serving = ServingStack([LLAMA]).start()
    serving.workers[NAMED] = serving.start_worker(
        LLAMA, ["--served-model-name", NAMED], name="named"
    )
    yield serving
    serving.stop()


def greedy_text(stack: ServingStack, n: int = 40) -> tuple[str, list[int]]:
    reply = stack.complete(LLAMA, {"prompt": PROMPT, "max_tokens": n, "return_token_ids": True})
    assert reply.status == 200, reply
    choice = reply.body["choices"][0]
    return choice["text"], choice["token_ids"]


def stop_inside(text: str) -> str:
    """A two-character piece of ``text`` first seen past its start (no replacement char)."""
    for i in range(4, len(text) - 2):
        piece = text[i : i + 2]
        if "\ufffd" not in piece and text.find(piece) >= 2:
            return piece
    raise AssertionError(f"no usable stop string in {text!r}")


def streamed_text(events: list[dict[str, Any]]) -> str:
    return "".join(e["choices"][0].get("text", "") for e in events if e["choices"])


def test_stop_ends_a_completion_before_the_stop_string(stack: ServingStack) -> None:
    text, ids = greedy_text(stack)
    stop = stop_inside(text)
    expected = text[: text.find(stop)]
    for stop_field in (stop, [stop, "\x00never"]):
        reply = stack.complete(LLAMA, {"prompt": PROMPT, "max_tokens": 40, "stop": stop_field})
        assert reply.status == 200, reply
        choice = reply.body["choices"][0]
        assert choice["text"] == expected and choice["finish_reason"] == "stop"
        assert 0 < reply.body["usage"]["completion_tokens"] < len(ids)
    # Streamed: text that may begin the stop string is held back, never sent and then cut.
    events = list(
        stream_events(
            stack.url(LLAMA),
            "/v1/completions",
            {"prompt": PROMPT, "max_tokens": 40, "stop": [stop]},
        )
    )
    assert streamed_text(events) == expected
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    # A stop string that never completes: everything held back comes out at the end.
    never = text[-1] + "\x00"
    events = list(
        stream_events(
            stack.url(LLAMA), "/v1/completions", {"prompt": PROMPT, "max_tokens": 40, "stop": never}
        )
    )
    assert streamed_text(events) == text
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    stack.wait_for_no_blocks()


def test_stop_in_chat_completions(stack: ServingStack) -> None:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 30}
    whole = request_json(stack.url(LLAMA), "POST", "/v1/chat/completions", body).body
    text = whole["choices"][0]["message"]["content"]
    stop = stop_inside(text)
    reply = request_json(stack.url(LLAMA), "POST", "/v1/chat/completions", {**body, "stop": stop})
    choice = reply.body["choices"][0]
    assert choice["message"]["content"] == text[: text.find(stop)]
    assert choice["finish_reason"] == "stop"
    events = list(stream_events(stack.url(LLAMA), "/v1/chat/completions", {**body, "stop": stop}))
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert content == text[: text.find(stop)]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def stock_logprobs(prompt: list[int], n: int) -> list[mx.array]:
    model, _ = build_tiny_model("llama", seed=0)
    return [logprobs for _, logprobs in generate_step(mx.array(prompt), model, max_tokens=n)]


def test_logprobs_and_top_logprobs(stack: ServingStack) -> None:
    prompt = list(PROMPT.encode())
    body = {"prompt": prompt, "max_tokens": 6, "logprobs": True, "top_logprobs": 3}
    reply = stack.complete(LLAMA, {**body, "return_token_ids": True})
    assert reply.status == 200, reply
    choice = reply.body["choices"][0]
    content = choice["logprobs"]["content"]
    assert [entry["id"] for entry in content] == choice["token_ids"]
    expected = stock_logprobs(prompt, 6)
    for entry, stock in zip(content, expected, strict=True):
        assert entry["logprob"] == pytest.approx(stock[entry["id"]].item(), abs=1e-4)
        top = entry["top_logprobs"]
        assert len(top) == 3 and top[0]["id"] == entry["id"]  # greedy: the top token
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert all(isinstance(t["token"], str) for t in top)
    # logprobs alone: one entry per token, no alternatives; streamed, spread over the chunks.
    chat = request_json(
        stack.url(LLAMA),
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "logprobs": True},
    ).body
    entries = chat["choices"][0]["logprobs"]["content"]
    assert len(entries) == 5 and all(e["logprob"] <= 0 and e["top_logprobs"] == [] for e in entries)
    events = list(stream_events(stack.url(LLAMA), "/v1/completions", body))
    streamed = [
        e for ev in events for e in (ev["choices"][0].get("logprobs") or {}).get("content", [])
    ]
    assert [e["id"] for e in streamed] == choice["token_ids"]
    for bad in ({"logprobs": "yes"}, {"top_logprobs": 99}, {"top_logprobs": 1.5}):
        assert stack.complete(LLAMA, {"prompt": "x", **bad}).status == 400, bad


def test_served_model_name_is_listed_and_accepted(stack: ServingStack) -> None:
    url = stack.url(NAMED)
    models = request_json(url, "GET", "/v1/models").body
    assert [m["id"] for m in models["data"]] == [NAMED]
    reply = request_json(
        url, "POST", "/v1/completions", {"model": NAMED, "prompt": "x", "max_tokens": 2}
    )
    assert reply.status == 200 and reply.body["model"] == NAMED
    assert (
        request_json(url, "POST", "/v1/completions", {"model": "other", "prompt": "x"}).status
        == 404
    )
    assert request_json(url, "GET", "/health").body["model"] == NAMED
    sessions = {s["model"] for s in stack.daemon.admin("sessions")}
    assert NAMED in sessions


def test_usage_comes_once_per_stream_and_only_when_asked(stack: ServingStack) -> None:
    body = {"prompt": PROMPT, "max_tokens": 8}
    plain = list(stream_events(stack.url(LLAMA), "/v1/completions", body))
    assert not [e for e in plain if "usage" in e]
    with_usage = list(
        stream_events(
            stack.url(LLAMA),
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 8,
                "stream_options": {"include_usage": True},
            },
        )
    )
    assert [e for e in with_usage if "usage" in e] == [with_usage[-1]]
    assert with_usage[-1]["choices"] == []
    assert with_usage[-1]["usage"]["completion_tokens"] == 8
    assert with_usage[-2]["choices"][0]["finish_reason"] == "length"


def test_a_route_called_with_the_other_method_gets_405_with_allow(stack: ServingStack) -> None:
    url = stack.url(LLAMA)
    for method, path, allow in [
        ("GET", "/v1/completions", "POST"),
        ("GET", "/v1/chat/completions", "POST"),
        ("POST", "/health", "GET"),
        ("POST", "/v1/models", "GET"),
        ("DELETE", "/v1/completions", "POST"),
    ]:
        reply = request_json(url, method, path, {} if method != "GET" else None)
        assert reply.status == 405, (method, path, reply)
        assert reply.headers["allow"] == allow
        assert reply.body["error"]["message"]
    assert request_json(url, "GET", "/nothing").status == 404
    assert request_json(url, "POST", "/nothing", {}).status == 404


def test_the_openai_client_drives_the_worker(stack: ServingStack) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=stack.url(NAMED) + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == [NAMED]
    messages = [{"role": "user", "content": "hello"}]
    chat = client.chat.completions.create(model=NAMED, messages=messages, max_tokens=12)
    text = chat.choices[0].message.content
    assert chat.usage.completion_tokens == 12 and chat.choices[0].finish_reason == "length"
    chunks = list(
        client.chat.completions.create(
            model=NAMED,
            messages=messages,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.usage.completion_tokens for c in chunks if c.usage] == [12]
    stop = stop_inside(text)
    stopped = client.chat.completions.create(
        model=NAMED, messages=messages, max_tokens=12, stop=[stop]
    )
    assert stopped.choices[0].message.content == text[: text.find(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    completion = client.completions.create(model=NAMED, prompt=PROMPT, max_tokens=10, stop=stop)
    assert completion.choices[0].finish_reason in ("stop", "length")
    streamed = list(
        client.completions.create(
            model=NAMED,
            prompt=PROMPT,
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert [c.usage.total_tokens for c in streamed if c.usage] == [len(PROMPT) + 10]
    stack.wait_for_no_blocks()


def test_a_request_naming_the_models_short_label_is_served(stack: ServingStack) -> None:
    # vqpoolctl shows a model by its last path parts; a request naming that label is served
    # (the same rule as the admin commands), another model's label is still a 404.
    full = "org/tiny-labelled"
    worker = stack.start_worker(LLAMA, ["--served-model-name", full], name="labelled")
    try:
        for name in (full, "tiny-labelled"):
            body = {"model": name, "prompt": "x", "max_tokens": 2}
            reply = request_json(worker.url, "POST", "/v1/completions", body)
            assert reply.status == 200 and reply.body["model"] == full, reply
        for name in ("labelled", "org", "other/tiny-labelled"):
            body = {"model": name, "prompt": "x", "max_tokens": 2}
            assert request_json(worker.url, "POST", "/v1/completions", body).status == 404
    finally:
        worker.stop()
