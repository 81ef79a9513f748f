"""Tokenizers as the serving worker sees them: encode, chat template, streaming decode, EOS.

Two kinds behind one small interface (:class:`ServingTokenizer`):

* :class:`ByteTokenizer` for the built-in tiny models (vocabulary of 256): token id = one UTF-8
  byte, no special tokens, no EOS (generation runs to ``max_tokens``). Its chat template is a
  trivial one, documented here because clients see its effect::

      <|system|>\\n{content}\\n<|user|>\\n{content}\\n ... <|assistant|>\\n

  one ``<|role|>`` line per message followed by its content and a newline, then the assistant
  header that the model continues from.
* :class:`HFTokenizer` over mlx-lm's ``TokenizerWrapper`` (what ``mlx_lm.load`` returns), for
  real models: its own chat template, streaming detokenizer and EOS ids.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class ChatPrompt:
    """What a chat template renders: the messages (every key of each), the request's ``tools``
    (None: none) and its extra template arguments (``chat_template_kwargs``)."""

    messages: Sequence[Mapping[str, Any]]
    tools: Sequence[Any] | None = None
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class OutputMarkers:
    """How a tokenizer marks thinking and tool calls in a chat answer (mlx-lm's own objects).

    Attributes:
        machine: mlx-lm's ``TextStateMachine`` over the markers (``make_text_state_machine``).
        initial_state: The state the answer starts in ("normal", or "reasoning" after a prompt
            that ends inside a thinking block).
        tool_parser: The tokenizer's tool-call parser (None: the model calls no tools).
    """

    machine: Any
    initial_state: str
    tool_parser: Callable[[str, Any], Any] | None


class TextStream(Protocol):
    """Turns generated token ids into text pieces as they come (one per request)."""

    def add_token(self, token: int) -> None: ...

    def finalize(self) -> None: ...

    @property
    def last_segment(self) -> str: ...


class ServingTokenizer(Protocol):
    """What the HTTP layer needs from a tokenizer."""

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    @property
    def has_chat_template(self) -> bool: ...

    def encode(self, text: str) -> list[int]: ...

    @property
    def takes_template_arguments(self) -> bool:
        """Whether the chat template can take ``tools``, ``tool_calls`` and extra arguments."""
        ...

    def apply_chat_template(self, chat: ChatPrompt) -> list[int]: ...

    def text_stream(self) -> TextStream: ...

    def output_markers(self, prompt: Sequence[int]) -> OutputMarkers | None:
        """How a chat answer to ``prompt`` marks thinking and tool calls (None: it does not)."""
        ...

    def token_text(self, token: int) -> str:
        """One token's own text (logprobs name their tokens with it)."""
        ...


class ByteTextStream:
    """Incremental UTF-8 decoding: a multi-byte character appears once all its bytes came;
    invalid bytes become U+FFFD."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""

    def add_token(self, token: int) -> None:
        self._pending += self._decoder.decode(bytes((token,)))

    def finalize(self) -> None:
        self._pending += self._decoder.decode(b"", final=True)

    @property
    def last_segment(self) -> str:
        segment, self._pending = self._pending, ""
        return segment


class ByteTokenizer:
    """Byte-level tokenizer for the built-in models: ids 0..255 are the UTF-8 bytes."""

    @property
    def eos_token_ids(self) -> frozenset[int]:
        # Random-weight models have no notion of an end; every request runs to max_tokens.
        return frozenset()

    @property
    def has_chat_template(self) -> bool:
        return True

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, tokens: Sequence[int]) -> str:
        return bytes(tokens).decode("utf-8", errors="replace")

    @property
    def takes_template_arguments(self) -> bool:
        return False  # the fixed template below has no place for tools or switches

    def apply_chat_template(self, chat: ChatPrompt) -> list[int]:
        text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in chat.messages)
        return self.encode(text + "<|assistant|>\n")

    def text_stream(self) -> TextStream:
        return ByteTextStream()

    def output_markers(self, prompt: Sequence[int]) -> OutputMarkers | None:
        return None

    def token_text(self, token: int) -> str:
        return self.decode([token])


class HFTokenizer:
    """A real model's tokenizer (mlx-lm's ``TokenizerWrapper``) behind :class:`ServingTokenizer`.

    Text prompts are encoded as mlx-lm's server does (``tokenizer.encode``, which adds the BOS
    token where the model has one); chat prompts go through the model's own chat template.
    """

    def __init__(self, wrapper: Any) -> None:
        self._wrapper = wrapper

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset(int(t) for t in self._wrapper.eos_token_ids)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._wrapper, "has_chat_template", False))

    def encode(self, text: str) -> list[int]:
        return list(self._wrapper.encode(text))

    @property
    def takes_template_arguments(self) -> bool:
        return True

    def apply_chat_template(self, chat: ChatPrompt) -> list[int]:
        # mlx_lm.server's call: the wrapper itself (which sets the thinking switch the model
        # names, e.g. enable_thinking, unless the request does), tools, then the request's
        # chat_template_kwargs.
        tokens = self._wrapper.apply_chat_template(
            [dict(m) for m in chat.messages],
            add_generation_prompt=True,
            tools=list(chat.tools) if chat.tools else None,
            tokenize=True,
            **dict(chat.template_kwargs),
        )
        if isinstance(tokens, Mapping):  # a BatchEncoding from some transformers versions
            tokens = tokens["input_ids"]
        return [int(t) for t in tokens]

    def text_stream(self) -> TextStream:
        # Each access gives a fresh copy (mlx-lm's TokenizerWrapper), so concurrent requests
        # do not share one detokenizer's state.
        stream: TextStream = self._wrapper.detokenizer
        return stream

    def output_markers(self, prompt: Sequence[int]) -> OutputMarkers | None:
        # mlx_lm.server's choice of the initial state (APIHandler's _tokenize).
        wrapper = self._wrapper
        if not (wrapper.has_thinking or wrapper.has_tool_calling):
            return None
        from mlx_lm.generate import make_text_state_machine

        initial_state = "normal"
        if wrapper.has_thinking:
            tokens = list(prompt)
            if wrapper.rfind_think_start(tokens) > wrapper.rfind_think_end(tokens):
                initial_state = "reasoning"
        initial_state = wrapper.response_initial_state or initial_state
        return OutputMarkers(make_text_state_machine(wrapper), initial_state, wrapper.tool_parser)

    def token_text(self, token: int) -> str:
        # The vocabulary's own spelling, as mlx_lm.server reports it in logprobs.
        return str(self._wrapper.convert_ids_to_tokens(token))
