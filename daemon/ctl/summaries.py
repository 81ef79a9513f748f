"""Totals vqpoolctl derives from the admin replies (per model, per stream)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vqpool.daemon.ctl.render import human_bytes
from vqpool.shared.kv_formats import is_format, parse_format


def per_model(sessions: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """What the sessions of each model hold and do: ``{model: {sessions, blocks, bytes,
    bytes_total, formats, running, queued, prompt_cache}}`` with ``blocks`` and ``bytes`` per
    stream, ``formats`` per block format (``{format: {blocks, bytes}}``), and
    the requests running and queued as the workers last reported them (None when none of the
    model's workers reports them); ``prompt_cache`` sums the workers' prompt-cache reports
    (:data:`~vqpool.shared.protocol.PROMPT_CACHE_COUNTERS`; its bytes are part of
    ``bytes_total``; None when none reports one), models in name order."""
    models: dict[str, dict[str, Any]] = {}
    for session in sessions:
        model = models.setdefault(
            session["model"],
            {
                "sessions": 0,
                "blocks": {},
                "bytes": {},
                "bytes_total": 0,
                "formats": {},
                "running": None,
                "queued": None,
                "prompt_cache": None,
            },
        )
        model["sessions"] += 1
        for count in ("running", "queued"):
            if session.get(count) is not None:
                model[count] = (model[count] or 0) + session[count]
        for stream, n in session["blocks"].items():
            model["blocks"][stream] = model["blocks"].get(stream, 0) + n
        for stream, n in session["bytes"].items():
            model["bytes"][stream] = model["bytes"].get(stream, 0) + n
        model["bytes_total"] += session["bytes_total"]
        for fmt, held in session.get("formats", {}).items():  # (a daemon before formats: none)
            total = model["formats"].setdefault(fmt, {"blocks": 0, "bytes": 0})
            total["blocks"] += held["blocks"]
            total["bytes"] += held["bytes"]
        cache = session.get("prompt_cache")
        if cache is not None:
            total = model["prompt_cache"] or dict.fromkeys(cache, 0)
            model["prompt_cache"] = {k: total.get(k, 0) + n for k, n in cache.items()}
    return dict(sorted(models.items()))


def formats_text(formats: dict[str, dict[str, int]]) -> str:
    """Blocks and bytes held per block format, in short: "q4g64 120 blk 1.9 MiB, bf16 8 blk
    512.0 KiB" ("-" when none)."""
    return (
        ", ".join(
            f"{fmt} {held['blocks']} blk {human_bytes(held['bytes'])}"
            for fmt, held in sorted(formats.items())
        )
        or "-"
    )


def shows_formats(formats: Iterable[dict[str, dict[str, int]]]) -> bool:
    """Whether the text views show blocks per format: some model holds blocks of a quantized
    format, or of more than one (else every block is in its model's one full-precision format,
    and the blocks and bytes columns say it all)."""
    return any(
        len(held) > 1 or any(is_format(fmt) and parse_format(fmt) is not None for fmt in held)
        for held in formats
    )


def in_use(stats: dict[str, Any]) -> dict[str, int]:
    """Blocks in use per stream, from the admin ``stats`` reply."""
    return {s: counts["total"] - counts["free"] for s, counts in stats["streams"].items()}


def pool_line(stats: dict[str, Any]) -> str:
    """One line on the pool's shape now."""
    config = stats["config"]
    streams = "+".join(stats["streams"])
    if not config["grow_on_exhaustion"]:
        grow = "no growth"
    elif config["max_blocks"] is None:
        grow = "grows without cap"
    else:
        grow = f"grows up to {config['max_blocks']}"
    return (
        f"{stats['stats']['n_blocks']} blocks x {config['block_size']} tokens, "
        f"streams {streams}, {grow}; lease {stats['lease_s']:g}s"
    )
