"""A request's generated tokens turned into the text it answers with: stop strings and logprobs.

:class:`StopScanner` finds a request's ``stop`` strings in the decoded text and holds back the
tail that could still become one, so a streamed answer never sends text it must take back (as
``mlx_lm.server`` does). The match is on text, not on token ids: a stop string may tokenize
differently inside generated text than alone. :class:`CompletionText` feeds token events through
the tokenizer's streaming decoder and the scanner, and collects what the response reports per
token (ids, logprobs) until the text is sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vqpool.worker.models.tokenizer import ServingTokenizer
from vqpool.worker.sched.scheduler import ScoredToken


class StopScanner:
    """Finds the first of ``stops`` in a text that arrives piece by piece."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stops)
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The part of ``text`` (after what was held back) that is safe to send now.

        Once a stop string completes, that is the text before it, :attr:`stopped` is True and
        the rest is dropped.
        """
        if not self._stops:
            return text
        buffer = self._held + text
        hits = [i for i in (buffer.find(stop) for stop in self._stops) if i >= 0]
        if hits:
            self._held = ""
            self.stopped = True
            return buffer[: min(hits)]
        keep = self._partial_tail(buffer)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """What is held back, once no more text comes."""
        held, self._held = self._held, ""
        return held

    def _partial_tail(self, buffer: str) -> int:
        """Length of the longest tail of ``buffer`` that begins some stop string."""
        for n in range(min(len(buffer), max(len(s) for s in self._stops) - 1), 0, -1):
            tail = buffer[-n:]
            if any(stop.startswith(tail) for stop in self._stops):
                return n
        return 0


class CompletionText:
    """The text, token ids and logprobs of one request, as its token events arrive.

    Args:
        tokenizer: Decodes the tokens.
        stops: The request's stop strings (none: the text runs to the end of generation).
        top_logprobs: Alternatives reported per token (0: none).
        reports_tokens: The response reports per token (ids or logprobs), so a streamed
            token is worth a chunk even when its text is held back.
    """

    def __init__(
        self,
        tokenizer: ServingTokenizer,
        stops: Sequence[str],
        top_logprobs: int,
        *,
        reports_tokens: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self.reports_tokens = reports_tokens
        self._decoder = tokenizer.text_stream()
        self._scanner = StopScanner(stops)
        self._top_logprobs = top_logprobs
        self.n_tokens = 0
        self.token_ids: list[int] = []
        self.logprobs: list[dict[str, Any]] = []
        self._sent_ids = 0
        self._sent_logprobs = 0
        self.stopped_text = ""
        """Once :attr:`stopped`: the last text :meth:`add` returned (before the stop string)."""

    @property
    def stopped(self) -> bool:
        """A stop string completed: the request is over."""
        return self._scanner.stopped

    def add(self, event: int | ScoredToken) -> str:
        """Take one generated token; the text now safe to send (see :class:`StopScanner`)."""
        token = event.token if isinstance(event, ScoredToken) else event
        self.n_tokens += 1
        self.token_ids.append(token)
        if isinstance(event, ScoredToken):
            self.logprobs.append(self._logprob_entry(event))
        if token not in self._tokenizer.eos_token_ids:  # EOS ends the text, as in mlx-lm
            self._decoder.add_token(token)
        piece = self._scanner.feed(self._decoder.last_segment)
        if self._scanner.stopped:
            self.stopped_text = piece
        return piece

    def finish(self) -> str:
        """The text still held back when generation ended without a stop string."""
        self._decoder.finalize()
        return self._scanner.feed(self._decoder.last_segment) + self._scanner.flush()

    def take_token_ids(self) -> list[int]:
        """The ids not reported in an earlier chunk."""
        ids = self.token_ids[self._sent_ids :]
        self._sent_ids = len(self.token_ids)
        return ids

    def take_logprobs(self) -> list[dict[str, Any]]:
        """The logprob entries not reported in an earlier chunk."""
        entries = self.logprobs[self._sent_logprobs :]
        self._sent_logprobs = len(self.logprobs)
        return entries

    def _logprob_entry(self, scored: ScoredToken) -> dict[str, Any]:
        text = self._tokenizer.token_text
        return {
            "id": scored.token,
            "token": text(scored.token),
            "logprob": scored.logprob,
            "top_logprobs": [
                {"id": token, "token": text(token), "logprob": logprob}
                for token, logprob in scored.top[: self._top_logprobs]
            ],
        }
