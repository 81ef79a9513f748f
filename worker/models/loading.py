"""What ``vqpool-worker --model MODEL`` loads: a Hugging Face model, or a built-in tiny one.

* ``builtin:NAME``: a tiny random-weight model from :mod:`vqpool.worker.models.tiny_models`
  (fixed seed, fp32, built offline in well under a second) with the :class:`ByteTokenizer`.
  Only the tiny configs with a 256-token vocabulary qualify, so every byte is a token. They
  differ in architecture and KV layout: ``llama`` (2 KV heads of 16), ``qwen2`` (4 KV heads of
  16, q/k/v biases), ``qwen3`` (1 KV head of 32, q/k norms).
* anything else: a Hugging Face id or local path, loaded with ``mlx_lm.load`` exactly as
  ``mlx_lm.server`` does (weights downloaded to the Hugging Face cache on first use).

``--adapter-path DIR`` applies adapters with mlx-lm's own loader (``load(spec, adapter_path=DIR)``,
as ``mlx_lm.server --adapter-path``); ``--draft-model`` is loaded the same way as ``--model``.

A ``--model`` that is not a model (a directory without ``config.json``, a path that does not
exist, an id the hub or its cache does not have) is a ValueError of one line saying what to pass,
not mlx-lm's or the hub's own error.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import mlx.nn as nn
from vqpool.shared.tiny_configs import BUILTIN_PREFIX, BYTE_VOCAB, builtin_names
from vqpool.worker.models.tiny_models import build_tiny_model
from vqpool.worker.models.tokenizer import ByteTokenizer, HFTokenizer, ServingTokenizer


@dataclass
class LoadedModel:
    """A model ready to serve.

    Attributes:
        name: The id clients use (``builtin:llama``, ``mlx-community/...``): the ``--model``
            argument as given.
        model: The mlx-lm model.
        tokenizer: Its tokenizer.
        vocab_size: Valid token ids are ``0 .. vocab_size - 1`` (prompts given as ids are checked
            against it).
    """

    name: str
    model: nn.Module
    tokenizer: ServingTokenizer
    vocab_size: int


WHAT_TO_PASS = (
    "pass an mlx-lm model directory (with config.json and *.safetensors), a Hugging Face id "
    "(org/name) or builtin:NAME"
)


def model_spec_problem(spec: str, option: str = "--model") -> str | None:
    """Why ``spec`` (given as ``option``) cannot name a model, found without loading anything
    (None: it may)."""
    if spec.startswith(BUILTIN_PREFIX):
        if spec.removeprefix(BUILTIN_PREFIX) in builtin_names():
            return None
        return (
            f"unknown built-in model {spec!r}; choose one of "
            f"{[BUILTIN_PREFIX + n for n in builtin_names()]}"
        )
    path = os.path.expanduser(spec)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return None
        return f"{option} {spec}: the directory has no config.json; {WHAT_TO_PASS}"
    if os.path.exists(path):
        return f"{option} {spec}: not a directory; {WHAT_TO_PASS}"
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(spec)
    except HFValidationError:
        return f"{option} {spec}: no such directory, and not a Hugging Face id; {WHAT_TO_PASS}"
    if spec.startswith((".", "/", "~")):
        return f"{option} {spec}: no such directory; {WHAT_TO_PASS}"
    return None


def load_model(
    spec: str, seed: int = 0, *, adapter_path: str | None = None, option: str = "--model"
) -> LoadedModel:
    """Load ``spec`` (see the module docstring); ``seed`` draws a built-in's weights;
    ``adapter_path``: LoRA (or DoRA, or full) adapters applied with mlx-lm's own loader, as
    ``mlx_lm.load(spec, adapter_path=...)`` and so ``mlx_lm.server --adapter-path`` apply them.

    Raises:
        ValueError: ``spec`` names no model (see :func:`model_spec_problem`), or a Hugging Face
            id the hub (or, offline, its cache) does not have, or adapters that do not load.
    """
    problem = model_spec_problem(spec, option)
    if problem is not None:
        raise ValueError(problem)
    if spec.startswith(BUILTIN_PREFIX):
        model, _ = build_tiny_model(spec.removeprefix(BUILTIN_PREFIX), seed=seed)
        if adapter_path is not None:
            model = _with_adapters(model, adapter_path)
        return LoadedModel(spec, model, ByteTokenizer(), BYTE_VOCAB)
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    from mlx_lm import load

    if adapter_path is not None:
        _check_adapter_dir(adapter_path)
    try:
        loaded: Any = load(spec, adapter_path=adapter_path)
    except (LocalEntryNotFoundError, HfHubHTTPError) as exc:
        offline = isinstance(exc, LocalEntryNotFoundError)
        where = (
            "the Hugging Face cache (offline, or the hub unreachable)"
            if offline
            else "the Hugging Face hub"
        )
        raise ValueError(f"{option} {spec}: not found in {where}; {WHAT_TO_PASS}") from None
    except ValueError as exc:  # mlx-lm's adapter loader: weights that do not fit the model
        if adapter_path is None:
            raise
        raise ValueError(f"--adapter-path {adapter_path}: {exc}") from None
    model, wrapper = loaded[0], loaded[1]
    if adapter_path is not None:
        _evaluate(model)
    args = getattr(model, "args", None)
    vocab_size = int(getattr(args, "vocab_size", 0) or len(wrapper))
    return LoadedModel(spec, model, HFTokenizer(wrapper), vocab_size)


def adapter_dir_problem(adapter_path: str) -> str | None:
    """Why ``adapter_path`` is no mlx-lm adapter directory (mlx-lm's loader raises a bare
    FileNotFoundError), or None."""
    for name in ("adapter_config.json", "adapters.safetensors"):
        if not os.path.isfile(os.path.join(os.path.expanduser(adapter_path), name)):
            return (
                f"--adapter-path {adapter_path}: no {name} there (an mlx-lm adapter directory "
                "has adapter_config.json and adapters.safetensors)"
            )
    return None


def _check_adapter_dir(adapter_path: str) -> None:
    problem = adapter_dir_problem(adapter_path)
    if problem is not None:
        raise ValueError(problem)


def _with_adapters(model: nn.Module, adapter_path: str) -> nn.Module:
    """``model`` with the adapters applied by mlx-lm's loader (as ``mlx_lm.load`` does)."""
    from mlx_lm.utils import load_adapters

    _check_adapter_dir(adapter_path)
    try:
        model = load_adapters(model, os.path.expanduser(adapter_path))
    except ValueError as exc:
        raise ValueError(f"--adapter-path {adapter_path}: {exc}") from None
    model.eval()
    _evaluate(model)
    return model


def _evaluate(model: nn.Module) -> None:
    """Compute the adapter layers' weights here: mlx-lm leaves them lazy, on this thread's
    stream, which the generation thread cannot evaluate."""
    import mlx.core as mx

    mx.eval(model.parameters())
