"""A chat answer's text split as ``mlx_lm.server`` splits it: reasoning, tool calls and content.

For a tokenizer that marks thinking or tool calls (mlx-lm's ``TokenizerWrapper``:
``has_thinking``/``think_start``/``think_end``, ``has_tool_calling``/``tool_call_start``/
``tool_call_end``/``tool_parser``), the answer's text goes through mlx-lm's own
``TextStateMachine`` (``make_text_state_machine``), which strips the markers: text in the
"reasoning" state is the reasoning, text in the "tool" state one tool call's text, parsed by the
tokenizer's tool parser and shaped by ``mlx_lm.server``'s ``ToolCallFormatter``; the rest is the
content. The answer starts in the state the prompt leaves it in (a prompt ending inside
``<think>`` starts in reasoning), as ``mlx_lm.server`` decides it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vqpool.worker.models.tokenizer import OutputMarkers

REASONING = "reasoning"
TOOL = "tool"
NORMAL = "normal"


@dataclass
class ChatDelta:
    """What a chat answer gained since the last :meth:`ChatOutput.take`."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


class ChatOutput:
    """Splits one chat answer's text, piece by piece (see the module docstring).

    Args:
        markers: The tokenizer's state machine, initial state and tool parser.
        tools: The request's ``tools`` (given to the tool parser, as mlx_lm.server does).
        streaming: Tool calls carry their ``index`` (the stream's shape).
    """

    def __init__(self, markers: OutputMarkers, tools: Any, *, streaming: bool) -> None:
        from mlx_lm.generate import TextStateMachine
        from mlx_lm.server import ToolCallFormatter

        self._machine = TextStateMachine
        self._state = markers.machine.make_state(markers.initial_state)
        self._current: str | None = markers.initial_state
        self._format_calls = ToolCallFormatter(markers.tool_parser, tools, streaming)
        self._tool_text = ""
        self._done_calls: list[str] = []
        self._pending = ChatDelta()
        self.made_tool_call = False

    @property
    def in_tool_call(self) -> bool:
        """Inside a tool call's text (mlx_lm.server sends no chunk then)."""
        return self._current == TOOL

    def add(self, text: str) -> None:
        """Take the next piece of the answer's text."""
        self._state, segments = self._machine.split(self._state, text)
        self._collect(segments)

    def end(self, finish_reason: str) -> None:
        """The answer ended: text held back as a possible marker is dropped when it ended on a
        stop (EOS or a stop string), kept when it ran out of tokens; a tool call's text still
        open is a call (mlx_lm.server's rule: its parser decides whether it parses)."""
        if finish_reason == "stop":
            self._state, current = self._machine.discard(self._state)
            self._collect([(current, "")])
        else:
            self._state, held, current = self._machine.flush(self._state)
            self._collect([(current, held)])
        if self._current == TOOL and self._tool_text:
            self._close_call()

    def finish_reason(self, finish_reason: str) -> str:
        """``tool_calls`` for an answer that stopped after calling a tool, as mlx_lm.server."""
        return "tool_calls" if finish_reason == "stop" and self.made_tool_call else finish_reason

    def take(self) -> ChatDelta:
        """What the answer gained since the last call: content, reasoning, parsed tool calls."""
        delta, self._pending = self._pending, ChatDelta()
        delta.tool_calls = self._format_calls(self._done_calls)
        self._done_calls = []
        return delta

    def _collect(self, segments: list[tuple[str | None, str]]) -> None:
        for state, text in segments:
            if state == REASONING:
                self._pending.reasoning += text
            elif state == TOOL:
                self._tool_text += text
            elif state == NORMAL:
                if self._current == TOOL:
                    self._close_call()
                self._pending.content += text
            self._current = state

    def _close_call(self) -> None:
        self._done_calls.append(self._tool_text)
        self._tool_text = ""
        self.made_tool_call = True
