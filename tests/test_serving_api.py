"""vqpool-worker over HTTP: two workers on different built-in models, one real vqpoold.

Greedy output is checked token for token against mlx-lm's own ``generate_step`` run in this
process with a stock cache; usage counts, streaming, chat, the info routes, and malformed
requests (4xx with a JSON error, the worker keeps serving) are checked on the live workers.
"""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from serving_harness import ServingStack
from vqpool.shared.protocol import session_label
from vqpool.worker.models.tiny_models import build_tiny_model
from vqpool.worker.models.tokenizer import ByteTokenizer
from vqpool.worker.testing.http_client import request_json, stream_events

LLAMA = "builtin:llama"
QWEN3 = "builtin:qwen3"


@pytest.fixture(scope="module")
def stack() -> Iterator[ServingStack]:
    serving = ServingStack([LLAMA, QWEN3], worker_args=["--max-concurrent", "3"]).start()
    yield serving
    serving.stop()


def stock_greedy_tokens(name: str, prompt: list[int], n: int) -> list[int]:
    """What mlx-lm generates in-process with its stock KV cache."""
    model, _ = build_tiny_model(name, seed=0)
    steps = generate_step(mx.array(prompt), model, max_tokens=n)
    return [int(token) for token, _ in steps]


def test_two_models_serve_concurrent_requests(stack: ServingStack) -> None:
    prompts = [f"request {i}: the pool is shared by two models" for i in range(8)]
    jobs = [(LLAMA if i % 2 else QWEN3, p, 24 + i) for i, p in enumerate(prompts)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        replies = list(
            pool.map(
                lambda job: stack.complete(job[0], {"prompt": job[1], "max_tokens": job[2]}),
                jobs,
            )
        )
    for (model, prompt, max_tokens), reply in zip(jobs, replies, strict=True):
        assert reply.status == 200, reply
        body = reply.body
        assert body["model"] == model
        assert body["object"] == "text_completion"
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"] == {
            "prompt_tokens": len(prompt.encode()),
            "completion_tokens": max_tokens,
            "total_tokens": len(prompt.encode()) + max_tokens,
            "prompt_tokens_details": {"cached_tokens": 0},  # no two prompts share a block
        }
    for model in (LLAMA, QWEN3):
        stats = stack.worker_stats(model)
        assert stats["pooled"] and stats["peak_blocks"] > 0 and stats["peak_bytes"] > 0
    stack.wait_for_no_blocks()


@pytest.mark.parametrize("model", [LLAMA, QWEN3])
def test_greedy_tokens_equal_stock_mlx_lm_generation(stack: ServingStack, model: str) -> None:
    # 70 prompt + 90 generated tokens cross several 16-slot block boundaries.
    prompt = ByteTokenizer().encode("vqpool greedy identity check " * 3)[:70]
    expected = stock_greedy_tokens(model.removeprefix("builtin:"), prompt, 90)
    reply = stack.complete(
        model,
        {"prompt": prompt, "max_tokens": 90, "temperature": 0, "return_token_ids": True},
    )
    assert reply.status == 200, reply
    choice = reply.body["choices"][0]
    assert choice["token_ids"] == expected
    assert choice["text"] == ByteTokenizer().decode(expected)
    # The same prompt as text, streamed: the same tokens, chunk by chunk.
    text = "vqpool greedy identity check " * 3
    events = list(
        stream_events(
            stack.url(model),
            "/v1/completions",
            {"prompt": text[:70], "max_tokens": 90, "return_token_ids": True},
        )
    )
    streamed = [t for e in events for t in e["choices"][0].get("token_ids", [])]
    assert streamed == expected
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_streamed_text_equals_the_complete_response(stack: ServingStack) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 40}
    whole = stack.complete(LLAMA, body).body["choices"][0]["text"]
    events = list(stream_events(stack.url(LLAMA), "/v1/completions", body))
    assert "".join(e["choices"][0]["text"] for e in events) == whole


def test_chat_completions_use_the_byte_chat_template(stack: ServingStack) -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hello"}]},
    ]
    reply = stack.complete(
        QWEN3, {"messages": messages, "max_tokens": 12}, path="/v1/chat/completions"
    )
    assert reply.status == 200, reply
    body = reply.body
    template = "<|system|>\nbe brief\n<|user|>\nhello\n<|assistant|>\n"
    assert body["object"] == "chat.completion"
    assert body["usage"]["prompt_tokens"] == len(template.encode())
    assert body["choices"][0]["message"]["role"] == "assistant"
    events = list(
        stream_events(
            stack.url(QWEN3),
            "/v1/chat/completions",
            {"messages": messages, "max_tokens": 12, "stream_options": {"include_usage": True}},
        )
    )
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 12
    streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert streamed == body["choices"][0]["message"]["content"]


def test_info_routes(stack: ServingStack) -> None:
    url = stack.url(LLAMA)
    models = request_json(url, "GET", "/v1/models").body
    assert [m["id"] for m in models["data"]] == [LLAMA]
    health = request_json(url, "GET", "/health").body
    assert health["status"] == "ok" and health["pool"] == "vqpoold"
    stats = request_json(url, "GET", "/v1/stats").body
    for key in (
        "requests",
        "completion_tokens",
        "tokens_per_s",
        "peak_blocks",
        "peak_bytes",
        "waits",
        "exhaustions",
        "queue_length",
    ):
        assert key in stats
    sessions = {s["model"]: s for s in stack.daemon.admin("sessions")}
    assert set(sessions) == {LLAMA, QWEN3}
    assert session_label(sessions[LLAMA]["sid"]) == health["session"]


def raw_exchange(url: str, data: bytes) -> tuple[int, Any]:
    """Send raw bytes; the status and JSON body of the reply."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


BAD_BODIES: list[tuple[Any, int]] = [
    ([1, 2], 400),
    ({}, 400),
    ({"prompt": ""}, 400),
    ({"prompt": []}, 400),
    ({"prompt": [1, 2, 256]}, 400),
    ({"prompt": [1, "a"]}, 400),
    ({"prompt": "x", "max_tokens": 0}, 400),
    ({"prompt": "x", "max_tokens": "5"}, 400),
    ({"prompt": "x", "max_tokens": True}, 400),
    ({"prompt": "x", "temperature": -1}, 400),
    ({"prompt": "x", "top_p": 2}, 400),
    ({"prompt": "x", "stream": "yes"}, 400),
    ({"prompt": "x", "n": 2}, 400),
    ({"prompt": "x", "stop": 5}, 400),
    ({"prompt": "x", "stop": ["a", 1]}, 400),
    ({"prompt": "x", "logprobs": "yes"}, 400),
    ({"prompt": "x", "model": "someone-else"}, 404),
]


def test_malformed_requests_get_4xx_json_and_the_worker_keeps_serving(
    stack: ServingStack,
) -> None:
    url = stack.url(LLAMA)
    for body, status in BAD_BODIES:
        reply = request_json(url, "POST", "/v1/completions", body)
        assert reply.status == status, (body, reply)
        assert reply.body["error"]["message"], reply
    chat = request_json(url, "POST", "/v1/chat/completions", {"messages": [{"content": "x"}]})
    assert chat.status == 400 and "role" in chat.body["error"]["message"]
    assert request_json(url, "POST", "/v1/nothing", {"prompt": "x"}).status == 404
    assert request_json(url, "GET", "/nothing").status == 404
    assert request_json(url, "PUT", "/v1/completions", {"prompt": "x"}).status == 405
    cases = [
        (b"POST /v1/completions HTTP/1.0\r\n\r\n", 411),
        (b"POST /v1/completions HTTP/1.0\r\nContent-Length: x\r\n\r\n", 400),
        (b"POST /v1/completions HTTP/1.0\r\nContent-Length: 99999999999\r\n\r\n", 413),
        (b"POST /v1/completions HTTP/1.0\r\nContent-Length: 4\r\n\r\n\xff\xfe{}", 400),
        (b"GARBAGE\r\n\r\n", 400),
        (b"BREW /pot HTTP/1.0\r\n\r\n", 501),
    ]
    for data, status in cases:
        got, body = raw_exchange(url, data)
        assert got == status, (data, body)
        assert "message" in body["error"]
    # A client that sends headers and vanishes without the body.
    conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=5)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Length", "100")
    conn.endheaders()
    conn.close()
    ok = stack.complete(LLAMA, {"prompt": "still serving", "max_tokens": 4})
    assert ok.status == 200 and ok.body["usage"]["completion_tokens"] == 4
    stack.wait_for_no_blocks()


def test_bodies_that_crash_the_json_parser_get_a_400_json_and_the_worker_keeps_serving(
    stack: ServingStack,
) -> None:
    url = stack.url(LLAMA)
    bodies = [
        b"[" * 100_000 + b"]" * 100_000,  # nests past the interpreter's recursion limit
        b'{"prompt": "x", "stop": ' + b"[" * 5_000 + b"]" * 5_000 + b"}",
        b'{"prompt": "x", "max_tokens": ' + b"9" * 5_000 + b"}",  # past int's 4,300 digits
        # Parsed, then refused: the message shows the value cut short, not its whole repr.
        b'{"prompt": "x", "temperature": ' + b"[" * 900 + b"]" * 900 + b"}",
        b'{"prompt": "x", "max_tokens": "' + b"9" * 100_000 + b'"}',
    ]
    for data in bodies:
        head = f"POST /v1/completions HTTP/1.0\r\nContent-Length: {len(data)}\r\n\r\n"
        got, body = raw_exchange(url, head.encode() + data)
        assert got == 400, (data[:40], body)
        assert len(body["error"]["message"]) < 300, body  # no echo of the body
    ok = stack.complete(LLAMA, {"prompt": "still serving", "max_tokens": 4})
    assert ok.status == 200 and ok.body["usage"]["completion_tokens"] == 4
    stack.wait_for_no_blocks()
