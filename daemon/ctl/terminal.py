"""The terminal side of `vqpoolctl watch`: full-screen redraws and single-key input.

Plain ANSI escapes and termios, no curses: the view is a list of lines redrawn in place on the
alternate screen; stdin is put in cbreak mode (no echo, keys arrive one by one, Ctrl-C still
raises KeyboardInterrupt) and restored on the way out, whatever ends the view.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import termios
import time
import tty
from types import TracebackType
from typing import Any, TextIO

_ENTER = "\x1b[?1049h\x1b[?25l"  # alternate screen, hide the cursor
_LEAVE = "\x1b[?25h\x1b[?1049l"  # show the cursor, back to the normal screen
_HOME = "\x1b[H"
_CLEAR_LINE_END = "\x1b[K"
_CLEAR_BELOW = "\x1b[J"

QUIT_KEYS = frozenset("qQ")


class Terminal:
    """A full-screen view on ``out`` reading keys from ``keys`` (context manager)."""

    def __init__(self, out: TextIO, keys: TextIO) -> None:
        self._out = out
        self._keys_fd: int | None = None
        with contextlib.suppress(AttributeError, OSError, ValueError):
            if keys.isatty():
                self._keys_fd = keys.fileno()
        self._saved: list[Any] | None = None

    def __enter__(self) -> Terminal:
        if self._keys_fd is not None:
            self._saved = termios.tcgetattr(self._keys_fd)
            tty.setcbreak(self._keys_fd)
        self._out.write(_ENTER)
        self._out.flush()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._out.write(_LEAVE)
        self._out.flush()
        if self._keys_fd is not None and self._saved is not None:
            termios.tcsetattr(self._keys_fd, termios.TCSADRAIN, self._saved)

    def size(self) -> tuple[int, int]:
        """(columns, lines) of the terminal now.

        Asked of the terminal itself first: a live view must follow resizes, which a COLUMNS
        variable exported at some point does not.
        """
        try:
            columns, lines = os.get_terminal_size(self._out.fileno())
        except (AttributeError, OSError, ValueError):
            columns, lines = shutil.get_terminal_size((100, 30))
        return columns, lines

    def draw(self, lines: list[str]) -> None:
        """Replace the screen's content with ``lines`` (cut to the terminal's size)."""
        columns, height = self.size()
        shown = [line[:columns] for line in lines[:height]]
        self._out.write(_HOME + "".join(f"{line}{_CLEAR_LINE_END}\n" for line in shown[:-1]))
        if shown:
            self._out.write(shown[-1] + _CLEAR_LINE_END)
        self._out.write(_CLEAR_BELOW)
        self._out.flush()

    def wait_for_quit(self, seconds: float) -> bool:
        """Wait up to ``seconds``; True as soon as a quit key is pressed."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if self._keys_fd is None:
                time.sleep(left)
                return False
            ready, _, _ = select.select([self._keys_fd], [], [], left)
            if ready:
                data = os.read(self._keys_fd, 64)
                if not data:  # input closed: only Ctrl-C can end the view now
                    self._keys_fd = None
                    continue
                if QUIT_KEYS.intersection(data.decode(errors="replace")):
                    return True
        return False
