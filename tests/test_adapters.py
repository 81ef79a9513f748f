"""LoRA adapters: ``vqpool-worker --adapter-path DIR`` applies them as ``mlx_lm.server`` does
(mlx-lm's own loader), and a request's ``adapters`` may name them but not switch to others,
through real worker processes on a real vqpoold.

The adapter directory is written here the way mlx-lm's trainer writes one: LoRA layers put on
the model by mlx-lm's ``linear_to_lora_layers``, their trainable parameters (random, so the
adapters change the output) saved to ``adapters.safetensors`` beside ``adapter_config.json``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import pytest
from front_harness import FrontDoor
from mlx.utils import tree_flatten, tree_map
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.tuner.utils import linear_to_lora_layers
from serving_harness import ServingStack, greedy_token_ids
from vqpool.worker.testing.http_client import request_json
from vqpool.worker.testing.launch import ProcessExitedError, WorkerProcess
from vqpool.worker.testing.model_dirs import write_model_dir

PROMPTS = ["hello how are you", "the quick brown fox"]
MAX_TOKENS = 24
LORA_CONFIG = {
    "fine_tune_type": "lora",
    "num_layers": 2,
    "lora_parameters": {"rank": 4, "scale": 20.0, "dropout": 0.0},
}


def write_adapters(model_dir: Path, path: Path, seed: int = 8) -> Path:
    """An mlx-lm adapter directory for ``model_dir``'s model, with random LoRA weights."""
    model, _ = load(str(model_dir))
    model.freeze()
    linear_to_lora_layers(model, LORA_CONFIG["num_layers"], LORA_CONFIG["lora_parameters"])
    mx.random.seed(seed)
    trainable = tree_map(lambda a: mx.random.normal(a.shape) * 0.05, model.trainable_parameters())
    model.update(trainable)
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(
        str(path / "adapters.safetensors"), dict(tree_flatten(model.trainable_parameters()))
    )
    (path / "adapter_config.json").write_text(json.dumps(LORA_CONFIG))
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("adapters")
    model = write_model_dir(base / "model", "qwen2", seed=3)
    return {"model": model, "adapters": write_adapters(model, base / "lora")}


@pytest.fixture(scope="module")
def stack(dirs: dict[str, Path]) -> Iterator[ServingStack]:
    serving = ServingStack([str(dirs["model"])]).start()
    yield serving
    serving.stop()


def _reference(model_dir: Path, prompt: str, adapter_path: Path | None) -> list[int]:
    """mlx-lm's own greedy tokens, the model loaded with ``load(path, adapter_path=...)``."""
    model, tokenizer = load(
        str(model_dir), adapter_path=None if adapter_path is None else str(adapter_path)
    )
    tokens = mx.array(tokenizer.encode(prompt))
    made: list[int] = []
    for token, _ in generate_step(tokens, model, max_tokens=MAX_TOKENS):
        made.append(int(token))
        if made[-1] in tokenizer.eos_token_ids:  # where the worker stops, as stream_generate
            break
    return made


def test_adapters_change_the_output_as_mlx_lm_applies_them(
    dirs: dict[str, Path], stack: ServingStack
) -> None:
    model_dir = str(dirs["model"])
    worker = stack.start_worker(model_dir, ["--adapter-path", str(dirs["adapters"])], name="lora")
    try:
        for prompt in PROMPTS:
            with_adapters = _reference(dirs["model"], prompt, dirs["adapters"])
            # The premise: the adapters change the tokens, and no EOS cuts the answer short.
            assert with_adapters != _reference(dirs["model"], prompt, None)
            assert len(with_adapters) == MAX_TOKENS
            assert greedy_token_ids(worker.url, prompt, MAX_TOKENS) == with_adapters
            # Naming the worker's own adapters is what the worker does anyway.
            assert (
                greedy_token_ids(worker.url, prompt, MAX_TOKENS, adapters=str(dirs["adapters"]))
                == with_adapters
            )
            assert greedy_token_ids(stack.url(model_dir), prompt, MAX_TOKENS) == _reference(
                dirs["model"], prompt, None
            )
        other = request_json(
            worker.url,
            "POST",
            "/v1/completions",
            {"prompt": "hi", "max_tokens": 2, "adapters": "other/lora"},
        )
        assert other.status == 400, other
        assert other.body["error"]["param"] == "adapters"
        message = other.body["error"]["message"]
        assert "this worker's adapters are" in message and "--adapter-path" in message
    finally:
        worker.stop()
    stack.wait_for_no_blocks()


def test_adapters_per_request_are_refused_with_what_to_do_instead(
    dirs: dict[str, Path], stack: ServingStack
) -> None:
    """mlx_lm.server reloads its model with a request's adapters; a batched worker would change
    the weights under its other running requests, so it refuses and says what to do."""
    url = stack.url(str(dirs["model"]))
    before = request_json(url, "GET", "/v1/stats").body["requests"]
    for path in ("/v1/completions", "/v1/chat/completions"):
        body: dict[str, object] = {"max_tokens": 2, "adapters": str(dirs["adapters"])}
        body.update(
            {"prompt": "hi"}
            if path == "/v1/completions"
            else {"messages": [{"role": "user", "content": "hi"}]}
        )
        reply = request_json(url, "POST", path, body)
        assert reply.status == 400, reply
        assert reply.body["error"]["param"] == "adapters"
        message = reply.body["error"]["message"]
        assert message.startswith("adapters: this worker serves its model without adapters")
        assert "start a worker with --adapter-path" in message
    assert request_json(url, "GET", "/v1/stats").body["requests"] == before


@pytest.mark.parametrize("missing", ["adapter_config.json", "adapters.safetensors"])
def test_an_adapter_directory_mlx_lm_cannot_read_stops_the_worker_with_one_line(
    missing: str, dirs: dict[str, Path], tmp_path: Path
) -> None:
    broken = tmp_path / "lora"
    broken.mkdir()
    for name in ("adapter_config.json", "adapters.safetensors"):
        if name != missing:
            (broken / name).write_bytes((dirs["adapters"] / name).read_bytes())
    worker = WorkerProcess(
        str(dirs["model"]), tmp_path / "w.log", no_pool=True, args=["--adapter-path", str(broken)]
    )
    with pytest.raises(ProcessExitedError) as failed:
        worker.start()
    assert failed.value.status == 2
    assert f"--adapter-path {broken}: no {missing} there" in failed.value.last_line


def test_vqpool_serve_serves_adapters_as_a_model_of_their_own(dirs: dict[str, Path]) -> None:
    """What the 400 tells a client to do: the adapters as a model entry of the front door
    (``adapter_path``), beside the model without them, each named per request."""
    config = (
        f'[models."base"]\npath = "{dirs["model"]}"\n\n'
        f'[models."tuned"]\npath = "{dirs["model"]}"\nadapter_path = "{dirs["adapters"]}"\n'
    )
    with FrontDoor(config=config) as front:
        for name, adapters in (("tuned", dirs["adapters"]), ("base", None)):
            body = {"model": name, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS}
            reply = front.post("/v1/completions", {**body, "return_token_ids": True})
            assert reply.status == 200, reply
            expected = _reference(dirs["model"], PROMPTS[0], adapters)
            assert reply.body["choices"][0]["token_ids"] == expected
            # Known before the load (the adapters' safetensors header beside the model's),
            # exactly what the loaded worker charges.
            charged = {r["model"]: r["weights"] for r in front.admin("model_list")["models"]}
            assert front.row(name)["weights_bytes"] == charged[name] > 0
        assert front.row("tuned")["weights_bytes"] > front.row("base")["weights_bytes"]
