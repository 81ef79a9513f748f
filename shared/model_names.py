"""Which model a name given by a person means: one rule for vqpoolctl, the daemon's admin ops and
anything that routes by model name.

Model names are Hugging Face ids (``mlx-community/Llama-3.2-3B-Instruct-4bit``), local paths
(``/models/a/llama``) or built-in names (``builtin:llama``). Tables show them by a short label:
their last path parts, as few as tell them apart (``vqpool.daemon.ctl.labels``). A name given
means:

- a known model of exactly that name; else
- the one known model whose last path parts are the given name's (``Llama-3.2-3B-Instruct-4bit``,
  ``a/llama``): a label, or any longer tail of the full name;
- several such models: ambiguous, refused naming them all;
- none: no known model (the caller says what that means: refuse, or create it when asked to).
"""

from __future__ import annotations

from collections.abc import Iterable


def name_parts(name: str) -> list[str]:
    """The path parts of a model name (``org/name`` -> ``["org", "name"]``)."""
    return name.rstrip("/").split("/")


def tail_matches(given: str, known: Iterable[str]) -> list[str]:
    """The known names, other than ``given`` itself, that end with ``given``'s path parts."""
    parts = name_parts(given)
    n = len(parts)
    found = []
    for name in known:
        other = name_parts(name)
        if name != given and len(other) > n and other[-n:] == parts:
            found.append(name)
    return sorted(found)


def resolve_model(given: str, known: Iterable[str]) -> str | None:
    """The full name of the one known model ``given`` names, or None if it names none.

    Raises:
        ValueError: ``given`` is the tail of several known names (the message names them).
    """
    known = set(known)
    if given in known:
        return given
    found = tail_matches(given, known)
    if len(found) > 1:
        raise ValueError(
            f"model {given!r} is ambiguous: it ends the names of {', '.join(map(repr, found))}: "
            "give one in full"
        )
    return found[0] if found else None
