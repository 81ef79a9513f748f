"""The OpenAI-style request and response shapes of the worker's HTTP API (no I/O here).

Requests follow what ``mlx_lm.server`` accepts: ``/v1/completions`` takes ``prompt`` (a string,
or a list of token ids), ``/v1/chat/completions`` takes ``messages``; both take ``max_tokens``
(or ``max_completion_tokens``), ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``stop`` (a
string or a list of strings), ``logprobs`` (bool; for completions also OpenAI's legacy count of
alternatives), ``top_logprobs`` (0-20), ``stream``, ``stream_options.include_usage`` and
``model`` (if given, one of the names the worker serves under); and mlx_lm.server's sampling
fields with its limits: ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``
(each with its ``*_context_size``), ``logit_bias``, ``xtc_probability``, ``xtc_threshold`` and
``seed`` (per request, even inside a batch: see ``worker/sched/sampling.py``), and
``num_draft_tokens`` (0 to :data:`~vqpool.worker.defaults.MAX_NUM_DRAFT_TOKENS`). ``n`` > 1 is
refused with 400 rather than ignored, and so are a ``draft_model`` or ``adapters`` other than
the worker's own (:class:`ServedOptions`): mlx_lm.server reloads its one model for them, which
would change the model under the other requests of the batch. Other unknown fields are
ignored, as OpenAI clients send many.

Chat messages reach the model's chat template as ``mlx_lm.server`` gives them: every key of a
message (``tool_calls``, ``tool_call_id``, ``name``...), ``content: null`` as empty text, a tool
call's JSON-string ``arguments`` parsed into an object, with the request's ``tools`` and
``chat_template_kwargs`` (e.g. ``{"enable_thinking": false}``). The built-in models' fixed
template has no place for those: a request with them is refused naming the field. A chat
answer of a tokenizer that marks thinking or tool calls is split as mlx_lm.server splits it
(:mod:`~vqpool.worker.api.chat_output`): ``reasoning`` (also as ``reasoning_content``),
``tool_calls`` (streamed whole, each with its ``index``; ``finish_reason`` "tool_calls") and the
content (null when only reasoning or calls came).

Responses are mlx-lm's server shapes: a choice ended by a stop string has ``finish_reason``
"stop" and its text ends before the stop string; with ``logprobs`` a choice carries ``logprobs:
{"content": [{id, token, logprob, top_logprobs: [{id, token, logprob}, ...]}, ...]}`` (streamed,
each chunk carries the entries of its tokens). A stream carries ``usage`` only with
``stream_options.include_usage``, once, in a last chunk with ``choices: []`` (as OpenAI).
Additions: a choice that ended for a reason the ``finish_reason`` alone does not tell (the KV
pool ran out of blocks) carries ``finish_detail``; ``return_token_ids: true`` (vLLM's name) adds
the generated ids as ``token_ids`` to the choice (to each chunk when streaming), since byte-level
text of a random model is lossy. ``usage.prompt_tokens_details.cached_tokens`` counts the prompt
tokens the worker's prompt cache gave (as OpenAI's; 0 on a miss or without a cache).
"""

from __future__ import annotations

import json
import math
import reprlib
import time
import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from vqpool.shared.api_error import ApiError
from vqpool.shared.model_names import tail_matches
from vqpool.worker.defaults import DEFAULT_NUM_DRAFT_TOKENS, MAX_NUM_DRAFT_TOKENS
from vqpool.worker.models.loading import LoadedModel
from vqpool.worker.models.tokenizer import ChatPrompt
from vqpool.worker.sched.sampling import SamplingParams

TEXT = "text"
CHAT = "chat"


@dataclass(frozen=True)
class CompletionRequest:
    """A validated completion request."""

    kind: str
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool = False
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    tools: list[Any] | None = None
    """The chat's ``tools`` (the tool parser is given them, as in mlx_lm.server)."""
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS
    """Draft tokens per round (used by a worker with a draft model)."""


_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxlong, _SHOWN.maxother = 2, 40, 40, 40


def _shown(value: Any) -> str:
    """``value`` as an error message shows it: short whatever the client sent."""
    return _SHOWN.repr(value)


DEFAULT_PENALTY_CONTEXT = 20
"""Tokens a penalty looks back at unless the request says (``mlx_lm.server``'s default)."""
MAX_SEED = 2**64 - 1
"""The largest seed ``mx.random.key`` takes."""


def _number(body: Mapping[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise ApiError(
            400, f"{name} must be a number in [{lo:g}, {hi:g}], got {_shown(value)}", param=name
        )
    return float(value)


def _integer(body: Mapping[str, Any], name: str, default: int, lo: int, hi: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ApiError(
            400, f"{name} must be an integer in [{lo}, {hi}], got {_shown(value)}", param=name
        )
    return value


def _is_finite_number(value: Any) -> bool:
    """A JSON number (not a bool) a float holds: no infinity, NaN or 400-digit integer."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _penalty(body: Mapping[str, Any], name: str, *, at_least_zero: bool = False) -> float:
    """A penalty as ``mlx_lm.server`` takes it: any finite number (the repetition penalty, a
    factor: at least 0); absent is 0, off."""
    value = body.get(name)
    if value is None:
        return 0.0
    if not _is_finite_number(value) or (at_least_zero and value < 0):
        wanted = "a number >= 0" if at_least_zero else "a finite number"
        raise ApiError(400, f"{name} must be {wanted}, got {_shown(value)}", param=name)
    return float(value)


def _context_size(body: Mapping[str, Any], name: str) -> int:
    value = body.get(name)
    if value is None:
        return DEFAULT_PENALTY_CONTEXT
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ApiError(400, f"{name} must be an integer >= 0, got {_shown(value)}", param=name)
    return value


def _logit_bias(body: Mapping[str, Any], vocab_size: int) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as ``mlx_lm.server`` reads it (token id keys, as strings in JSON, to
    added logits), each id checked against the vocabulary."""
    value = body.get("logit_bias")
    if value is None:
        return ()
    problem = f"logit_bias must map token ids in [0, {vocab_size}) to finite numbers"
    if not isinstance(value, dict):
        raise ApiError(400, f"{problem}, got {_shown(value)}", param="logit_bias")
    bias: dict[int, float] = {}
    for key, added in value.items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if not 0 <= token < vocab_size or not _is_finite_number(added):
            raise ApiError(
                400, f"{problem}, got {_shown(key)}: {_shown(added)}", param="logit_bias"
            )
        bias[token] = float(added)
    return tuple(bias.items())


def _seed(body: Mapping[str, Any]) -> int | None:
    value = body.get("seed")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEED:
        raise ApiError(
            400, f"seed must be an integer in [0, {MAX_SEED}], got {_shown(value)}", param="seed"
        )
    return value


def _sampling(body: Mapping[str, Any], model: LoadedModel) -> SamplingParams:
    """The request's sampling, validated as ``mlx_lm.server`` validates it."""
    xtc_probability = _number(body, "xtc_probability", 0.0, 0.0, 1.0)
    return SamplingParams(
        temperature=_number(body, "temperature", 0.0, 0.0, 100.0),
        top_p=_number(body, "top_p", 0.0, 0.0, 1.0),
        top_k=_integer(body, "top_k", 0, 0, model.vocab_size),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        repetition_penalty=_penalty(body, "repetition_penalty", at_least_zero=True),
        repetition_context_size=_context_size(body, "repetition_context_size"),
        presence_penalty=_penalty(body, "presence_penalty"),
        presence_context_size=_context_size(body, "presence_context_size"),
        frequency_penalty=_penalty(body, "frequency_penalty"),
        frequency_context_size=_context_size(body, "frequency_context_size"),
        logit_bias=_logit_bias(body, model.vocab_size),
        xtc_probability=xtc_probability,
        # mlx_lm.server lets a threshold up to 1 through, then its sampler fails above 0.5.
        xtc_threshold=_number(body, "xtc_threshold", 0.1, 0.0, 0.5),
        # As mlx_lm.server: XTC never removes the newline or an EOS token.
        xtc_special_tokens=(
            tuple([*model.tokenizer.encode("\n"), *sorted(model.tokenizer.eos_token_ids)])
            if xtc_probability > 0.0
            else ()
        ),
        seed=_seed(body),
    )


MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20


def _stop_strings(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOP_STRINGS
        or not all(isinstance(s, str) for s in stops)
    ):
        raise ApiError(
            400,
            f"stop must be a string or a list of at most {MAX_STOP_STRINGS} strings",
            param="stop",
        )
    return tuple(s for s in stops if s)


def _logprobs(body: Mapping[str, Any], kind: str) -> tuple[bool, int]:
    """``(logprobs wanted, alternatives per token)`` of the request."""
    wanted = body.get("logprobs")
    top = body.get("top_logprobs")
    if kind == TEXT and type(wanted) is int and top is None:
        top = wanted  # the legacy completions API: logprobs is the number of alternatives
        wanted = True
    if wanted is not None and not isinstance(wanted, bool):
        raise ApiError(
            400, f"logprobs must be true or false, got {_shown(wanted)}", param="logprobs"
        )
    if top is None or top == -1:  # mlx_lm.server's "none"
        top = 0
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ApiError(
            400,
            f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {_shown(top)}",
            param="top_logprobs",
        )
    return bool(wanted) or top > 0, top


def _token_ids(value: list[Any], vocab_size: int) -> list[int]:
    if not all(type(t) is int and 0 <= t < vocab_size for t in value):
        raise ApiError(
            400, f"a token id prompt must be integers in [0, {vocab_size})", param="prompt"
        )
    return list(value)


def _prompt_tokens(body: Mapping[str, Any], model: LoadedModel) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one, as the OpenAI client may send
    if isinstance(prompt, str) and prompt:
        return model.tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt:
        return _token_ids(prompt, model.vocab_size)
    raise ApiError(
        400, "prompt must be a non-empty string or a non-empty list of token ids", param="prompt"
    )


def _message_content(content: Any) -> str:
    """A message's content as mlx_lm.server gives it to the template: text parts joined, no
    content (an assistant message that only calls tools) empty."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise ApiError(
        400, "message content must be a string, null or a list of text parts", param="messages"
    )


def _tool_calls(calls: Any) -> list[Any]:
    """An assistant message's ``tool_calls`` as mlx_lm.server gives them to the template: a
    function's ``arguments`` sent as a JSON string are parsed into their object."""
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise ApiError(400, "a message's tool_calls must be a list of objects", param="messages")
    parsed = []
    for call in calls:
        function = call.get("function")
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                arguments = json.loads(function["arguments"]) if function["arguments"] else ""
            except json.JSONDecodeError:
                raise ApiError(
                    400,
                    f"tool call arguments must be JSON, got {_shown(function['arguments'])}",
                    param="messages",
                ) from None
            call = {**call, "function": {**function, "arguments": arguments}}
        parsed.append(call)
    return parsed


def _template_arguments(
    body: Mapping[str, Any], model: LoadedModel
) -> tuple[list[Any] | None, dict[str, Any]]:
    """The request's ``tools`` and ``chat_template_kwargs``, for the chat template."""
    tools = body.get("tools") or None
    if tools is not None and not isinstance(tools, list):
        raise ApiError(400, "tools must be a list of tool definitions", param="tools")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ApiError(400, "chat_template_kwargs must be an object", param="chat_template_kwargs")
    if not model.tokenizer.takes_template_arguments:
        for name, value in (("tools", tools), ("chat_template_kwargs", kwargs)):
            if value:
                raise ApiError(400, f"{model.name}'s chat template takes no {name}", param=name)
    return tools, kwargs


def _chat_tokens(
    body: Mapping[str, Any], model: LoadedModel, tools: list[Any] | None, kwargs: dict[str, Any]
) -> list[int]:
    """The chat prompt, rendered as mlx_lm.server renders it: each message with all its keys
    (``tool_calls``, ``tool_call_id``, ``name``...), ``tools`` and ``chat_template_kwargs``."""
    if not model.tokenizer.has_chat_template:
        raise ApiError(
            400,
            f"{model.name} has no chat template; use /v1/completions",
            param="messages",
        )
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    parsed = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, "each message needs a string role", param="messages")
        rendered = {**message, "content": _message_content(message.get("content"))}
        if message.get("tool_calls"):
            if not model.tokenizer.takes_template_arguments:
                raise ApiError(
                    400, f"{model.name}'s chat template takes no tool_calls", param="messages"
                )
            rendered["tool_calls"] = _tool_calls(message["tool_calls"])
        parsed.append(rendered)
    try:
        return model.tokenizer.apply_chat_template(ChatPrompt(parsed, tools, kwargs))
    except Exception as exc:  # the model's own template refused these messages (jinja raise)
        raise ApiError(
            400, f"the chat template cannot render this request: {exc}", param="messages"
        ) from None


@dataclass(frozen=True)
class ServedOptions:
    """What the worker was started with that a request may name: its draft model and its
    adapters, under every name a request may give them (as typed, resolved path)."""

    draft_names: tuple[str, ...] = ()
    """``--draft-model``'s names; empty: no draft model."""
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS
    adapter_names: tuple[str, ...] = ()
    """``--adapter-path``'s names; empty: no adapters."""


def _num_draft_tokens(body: Mapping[str, Any], options: ServedOptions) -> int:
    """The request's draft tokens per round. ``draft_model`` may name the worker's own draft
    model: mlx_lm.server loads another one per request (reloading the model with it), which
    here would swap the model under the requests running with it. Without a draft model
    ``num_draft_tokens`` is checked and unused, as in mlx_lm.server."""
    requested = body.get("draft_model")
    if requested is not None and requested not in options.draft_names:
        if not options.draft_names:
            why = "this worker has no draft model"
            instead = f"start vqpool-worker with --draft-model {_shown(requested)}"
        else:
            why = f"this worker's draft model is {options.draft_names[0]!r}"
            instead = "send that name, or none, or start another worker with --draft-model"
        raise ApiError(
            400,
            f"draft_model: {why}, and a draft model per request would reload the model under "
            f"the requests running on it; {instead}",
            param="draft_model",
        )
    return _integer(body, "num_draft_tokens", options.num_draft_tokens, 0, MAX_NUM_DRAFT_TOKENS)


def _check_adapters(body: Mapping[str, Any], options: ServedOptions) -> None:
    """A request's ``adapters`` may name the worker's own (``--adapter-path``): mlx_lm.server
    reloads the model with other adapters per request, which here would change the weights
    under the requests running with them."""
    requested = body.get("adapters")
    if requested is None or requested in options.adapter_names:
        return
    why = (
        "this worker serves its model without adapters"
        if not options.adapter_names
        else f"this worker's adapters are {options.adapter_names[0]!r}"
    )
    raise ApiError(
        400,
        f"adapters: {why}, and switching adapters per request would change the weights under "
        "the requests running on the same model; start a worker with --adapter-path "
        f"{_shown(requested)} (with vqpool serve: a model entry with adapter_path) and name "
        "that model instead",
        param="adapters",
    )


def _names_this_model(requested: Any, names: Collection[str]) -> bool:
    """Whether a request's ``model`` names the model served here: one of its names, or the
    short label ``vqpoolctl`` shows for it (the same rule as the admin commands: see
    ``vqpool.shared.model_names``; every name here is the one model, so no tail is ambiguous)."""
    if not isinstance(requested, str):
        return False
    return requested in names or bool(tail_matches(requested, names))


def parse_completion(
    body: Any,
    kind: str,
    model: LoadedModel,
    *,
    default_max_tokens: int,
    max_tokens_limit: int,
    served_names: Collection[str] = (),
    options: ServedOptions = ServedOptions(),
) -> CompletionRequest:
    """Validate a request body for ``kind`` (TEXT or CHAT) and tokenize its prompt.

    ``served_names`` are the model ids a request may name (none: only ``model.name``);
    ``options`` the draft model and adapters a request may name.

    Raises:
        ApiError: 400 for a malformed request, 404 for another model's id.
    """
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    names = served_names or (model.name,)
    requested = body.get("model")
    if requested is not None and not _names_this_model(requested, names):
        raise ApiError(
            404,
            f"model {_shown(requested)} is not served here; this worker serves "
            f"{next(iter(names))!r}",
            kind="model_not_found",
            param="model",
        )
    _check_adapters(body, options)
    num_draft_tokens = _num_draft_tokens(body, options)
    if body.get("n", 1) != 1:
        raise ApiError(400, "n must be 1 (one choice per request)", param="n")
    stop = _stop_strings(body)
    logprobs, top_logprobs = _logprobs(body, kind)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be true or false", param="stream")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict) or not isinstance(
        stream_options.get("include_usage", False), bool
    ):
        raise ApiError(400, "stream_options must be {include_usage: bool}", param="stream_options")
    return_token_ids = body.get("return_token_ids", False)
    if not isinstance(return_token_ids, bool):
        raise ApiError(400, "return_token_ids must be true or false", param="return_token_ids")
    max_tokens_name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = _integer(body, max_tokens_name, default_max_tokens, 1, max_tokens_limit)
    sampling = _sampling(body, model)
    tools: list[Any] | None = None
    if kind == TEXT:
        prompt = _prompt_tokens(body, model)
    else:
        tools, template_kwargs = _template_arguments(body, model)
        prompt = _chat_tokens(body, model, tools, template_kwargs)
    return CompletionRequest(
        kind,
        prompt,
        max_tokens,
        sampling,
        stream,
        bool(stream_options.get("include_usage", False)),
        return_token_ids,
        stop,
        logprobs,
        top_logprobs,
        tools,
        num_draft_tokens,
    )


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage map; ``cached_tokens``: prompt tokens the prompt cache gave."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class ResponseBuilder:
    """Builds the response objects of one request (one id and creation time for all chunks)."""

    def __init__(self, kind: str, model_name: str) -> None:
        self.kind = kind
        self.model_name = model_name
        self.id = f"{'chatcmpl' if kind == CHAT else 'cmpl'}-{uuid.uuid4()}"
        self.created = int(time.time())
        self._sent_role = False

    def _envelope(self, obj: str, choice: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model_name,
            "choices": [{"index": 0, **choice}],
        }

    @staticmethod
    def _chat_parts(reasoning: str, tool_calls: list[dict[str, Any]] | None) -> dict[str, Any]:
        """A message's (or delta's) reasoning and tool calls, when it has them. The reasoning
        goes under both names clients read: ``reasoning`` (mlx_lm.server's) and
        ``reasoning_content`` (DeepSeek's and vLLM's)."""
        parts: dict[str, Any] = {}
        if reasoning:
            parts["reasoning_content"] = parts["reasoning"] = reasoning
        if tool_calls:
            parts["tool_calls"] = tool_calls
        return parts

    @staticmethod
    def _ending(
        finish_reason: str | None,
        detail: str | None,
        token_ids: list[int] | None,
        logprobs: list[dict[str, Any]] | None,
    ) -> dict[str, Any]:
        ending: dict[str, Any] = {"finish_reason": finish_reason}
        if detail:
            ending["finish_detail"] = detail
        if token_ids is not None:
            ending["token_ids"] = token_ids
        if logprobs is not None:
            ending["logprobs"] = {"content": logprobs}
        return ending

    def complete(
        self,
        text: str,
        finish_reason: str,
        detail: str | None,
        n_prompt: int,
        n_completion: int,
        token_ids: list[int] | None = None,
        logprobs: list[dict[str, Any]] | None = None,
        cached_tokens: int = 0,
        reasoning: str = "",
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """The whole response of a non-streaming request (``logprobs``: its entries, if asked;
        ``reasoning``, ``tool_calls``: a chat answer's, split off its text)."""
        ending = self._ending(finish_reason, detail, token_ids, logprobs)
        if self.kind == CHAT:
            extra = self._chat_parts(reasoning, tool_calls)
            # No text beside reasoning or tool calls: content null (mlx_lm.server, OpenAI).
            content = text if text or not extra else None
            message = {"role": "assistant", "content": content, **extra}
            choice = {"message": message, **ending}
            response = self._envelope("chat.completion", choice)
        else:
            response = self._envelope("text_completion", {"text": text, "logprobs": None, **ending})
        response["usage"] = usage(n_prompt, n_completion, cached_tokens)
        return response

    def chunk(
        self,
        text: str,
        finish_reason: str | None = None,
        detail: str | None = None,
        token_ids: list[int] | None = None,
        logprobs: list[dict[str, Any]] | None = None,
        reasoning: str = "",
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """One streamed chunk: a piece of text (a chat's also reasoning and whole tool calls,
        each with its ``index``), or (with ``finish_reason``) the last one."""
        ending = self._ending(finish_reason, detail, token_ids, logprobs)
        if self.kind == CHAT:
            delta: dict[str, Any] = {"content": text} if text else {}
            delta.update(self._chat_parts(reasoning, tool_calls))
            if not self._sent_role:
                delta["role"] = "assistant"
                self._sent_role = True
            return self._envelope("chat.completion.chunk", {"delta": delta, **ending})
        return self._envelope("text_completion", {"text": text, "logprobs": None, **ending})

    def usage_chunk(
        self, n_prompt: int, n_completion: int, cached_tokens: int = 0
    ) -> dict[str, Any]:
        """The extra chunk of ``stream_options.include_usage``: no choices, only usage."""
        obj = "chat.completion.chunk" if self.kind == CHAT else "text_completion"
        response = self._envelope(obj, {})
        response["choices"] = []
        response["usage"] = usage(n_prompt, n_completion, cached_tokens)
        return response
