"""Short labels for model names that stay distinct: what ``vqpoolctl watch`` shows per model.

Model names are Hugging Face ids (``mlx-community/Llama-3.2-3B-Instruct-4bit``), local paths or
built-in names. Cutting them to a column from the right makes ``...-3B-...`` and ``...-1B-...``
the same; these labels drop the leading path parts that all names do not need (the org or the
directories) and, if still too long, elide the middle while keeping the characters where each
label first differs from the others. A label that is not elided names its model wherever a model
name is given (:mod:`vqpool.shared.model_names`).
"""

from __future__ import annotations

from collections.abc import Collection

from vqpool.shared.model_names import name_parts


def _shortest_distinct_suffix(parts: list[str], others: list[list[str]]) -> str:
    """The fewest trailing path parts of ``parts`` that no other name ends with."""
    for n in range(1, len(parts)):
        tail = parts[-n:]
        if all(other[-n:] != tail for other in others):
            return "/".join(tail)
    return "/".join(parts)


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def elide(text: str, width: int, keep: int = 0, mark: str = "…") -> str:
    """``text`` in at most ``width`` characters (>= 3): unchanged if it fits, else with its
    middle replaced by ``mark``, keeping ``text[keep]`` (a character that must stay visible)."""
    if len(text) <= width:
        return text
    room = width - len(mark)
    head = max(room // 2, min(keep + 1, room - 1))
    if keep + 1 <= head:
        return text[:head] + mark + text[len(text) - (room - head) :]
    # The character to keep lies beyond any head that fits: show a window that ends on it.
    inner = width - 2 * len(mark)
    return mark + text[keep + 1 - inner : keep + 1] + mark


def model_labels(names: Collection[str], width: int, mark: str = "…") -> dict[str, str]:
    """A distinct label of at most ``width`` characters for each of ``names``."""
    parts = {name: name_parts(name) for name in names}
    short = {
        name: _shortest_distinct_suffix(p, [q for other, q in parts.items() if other != name])
        for name, p in parts.items()
    }
    labels = {}
    for name, label in short.items():
        others = [s for other, s in short.items() if other != name]
        differs_at = max((_common_prefix(label, s) for s in others), default=0)
        # Keep the first differing character and the one after it ("3B", not just "3").
        labels[name] = elide(label, width, min(differs_at + 1, len(label) - 1), mark)
    return labels
