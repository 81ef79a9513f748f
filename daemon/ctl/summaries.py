"""Totals vqpoolctl derives from the admin replies (per model, per stream)."""

from __future__ import annotations

from typing import Any


def per_model(sessions: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """What the sessions of each model hold and do: ``{model: {sessions, blocks, bytes,
    bytes_total, running, queued, prompt_cache}}`` with ``blocks`` and ``bytes`` per stream, and
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
        cache = session.get("prompt_cache")
        if cache is not None:
            total = model["prompt_cache"] or dict.fromkeys(cache, 0)
            model["prompt_cache"] = {k: total.get(k, 0) + n for k, n in cache.items()}
    return dict(sorted(models.items()))


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
