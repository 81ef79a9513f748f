"""Real model directories through the real loading path: ``vqpool-worker --model DIR`` loads a
Hugging Face-format directory with ``mlx_lm.load`` (config, safetensors, tokenizer.json, chat
template), and its chat, completions and streamed answers are the ones ``mlx_lm.generate`` gives
on the same directory (greedy, same prompt). The directories are built offline by
:mod:`vqpool.worker.testing.model_dirs`; ``scripts/demo --model DIR --model DIR`` runs on them too.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import remove_tree, short_tmpdir
from serving_harness import ServingStack
from test_serving_demo import run_demo
from vqpool.worker.testing.http_client import stream_events
from vqpool.worker.testing.model_dirs import write_model_dir

ARCHS = ("llama", "qwen3")
MAX_TOKENS = 24
PROMPTS = ["A key-value cache keeps", "Two models on one machine"]
CHAT = [{"role": "user", "content": "Say hello in five words."}]


@pytest.fixture(scope="module")
def model_dirs() -> Iterator[dict[str, Path]]:
    base = short_tmpdir("vqm")
    yield {arch: write_model_dir(base / arch, arch) for arch in ARCHS}
    remove_tree(base)


@pytest.fixture(scope="module")
def stack(model_dirs: dict[str, Path]) -> Iterator[ServingStack]:
    serving = ServingStack([str(d) for d in model_dirs.values()]).start()
    yield serving
    serving.stop()


def _reference(model_dir: Path, prompt: str | None, messages: list[Any] | None) -> str:
    """What mlx_lm.generate answers on ``model_dir`` (greedy) to a prompt or a chat."""
    from mlx_lm import generate, load

    model, tokenizer = load(str(model_dir))
    if messages is not None:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert prompt is not None
    text: str = generate(model, tokenizer, prompt, max_tokens=MAX_TOKENS)
    return text


def test_model_dir_has_the_files_of_a_downloaded_model(model_dirs: dict[str, Path]) -> None:
    for path in model_dirs.values():
        names = {p.name for p in path.iterdir()}
        assert names == {
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
        }


@pytest.mark.parametrize("arch", ARCHS)
def test_completions_match_mlx_lm_generate(
    arch: str, model_dirs: dict[str, Path], stack: ServingStack
) -> None:
    model = str(model_dirs[arch])
    for prompt in PROMPTS:
        expected = _reference(model_dirs[arch], prompt, None)
        assert expected
        reply = stack.complete(model, {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS})
        assert reply.status == 200, reply
        assert reply.body["choices"][0]["text"] == expected
        events = stream_events(
            stack.url(model),
            "/v1/completions",
            {"prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True},
        )
        assert "".join(e["choices"][0]["text"] for e in events) == expected
    stack.wait_for_no_blocks()


@pytest.mark.parametrize("arch", ARCHS)
def test_chat_matches_mlx_lm_generate(
    arch: str, model_dirs: dict[str, Path], stack: ServingStack
) -> None:
    model = str(model_dirs[arch])
    expected = _reference(model_dirs[arch], None, CHAT)
    assert expected  # a chat that ends at once would compare nothing
    reply = stack.complete(
        model, {"messages": CHAT, "max_tokens": MAX_TOKENS}, "/v1/chat/completions"
    )
    assert reply.status == 200, reply
    assert reply.body["choices"][0]["message"]["content"] == expected
    events = stream_events(
        stack.url(model),
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": MAX_TOKENS, "stream": True},
    )
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    assert streamed == expected
    stack.wait_for_no_blocks()


def test_demo_runs_on_model_dirs(model_dirs: dict[str, Path]) -> None:
    llama, qwen3 = (str(model_dirs[arch]) for arch in ARCHS)
    done = run_demo("--model", llama, "--model", qwen3, "--short", "--duration", "3", timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "blocks in use after the load: 0; audit: ok" in done.stdout
    # The per-model table comes before the front door's view, whose rows name the models too.
    per_model = done.stdout.split("The front door's view")[0]
    rows = {line.split()[0]: line.split() for line in per_model.splitlines() if "/" in line}
    for model in (llama, qwen3):
        assert int(rows[model][1]) > 0  # requests answered
