"""What vqpoolctl shows of the front door (``vqpool serve``) on the run directory: its answer on
the control socket, and its models' rows as text, for ``ps``, ``status`` and ``watch``."""

from __future__ import annotations

import argparse
from typing import Any
from urllib.parse import urlsplit

from vqpool.daemon.ctl.budgets import labelled_lines
from vqpool.daemon.ctl.context import Ctl
from vqpool.daemon.ctl.exits import CtlError
from vqpool.daemon.ctl.labels import model_labels
from vqpool.daemon.ctl.options import add_json, positive_float
from vqpool.daemon.ctl.render import duration, ellipsis, fit_fields, human_bytes, percent, table
from vqpool.shared.errors import VqpoolError
from vqpool.shared.front_client import FrontDoorNotRunning

LABEL_WIDTH = 40
"""Widest model label in the front door's tables (as in the budget table)."""


def add_model_arguments(
    parser: argparse.ArgumentParser, verb: str, wait: float, waits_for: str
) -> None:
    """MODEL, ``--wait`` (default ``wait`` seconds, for ``waits_for``) and ``--json``: the
    arguments of ``load`` and ``unload``."""
    parser.add_argument("model", metavar="MODEL", help=f"the model to {verb} (as `ps` names it)")
    parser.add_argument(
        "--wait",
        type=positive_float,
        default=wait,
        metavar="SECONDS",
        help=f"how long to wait for {waits_for} (default {wait:g})",
    )
    add_json(parser)


def front_door_or_none(ctl: Ctl) -> dict[str, Any] | None:
    """The front door's answer to ``GET /models``, or None when no ``vqpool serve`` answers
    on the run directory (``status`` and ``watch`` then show what they always did)."""
    try:
        return ctl.front_door().models()
    except FrontDoorNotRunning:
        return None


def labels_of(answer: dict[str, Any]) -> dict[str, str]:
    """A short distinct label per served model, as the other tables label models."""
    return model_labels([row["name"] for row in answer["models"]], LABEL_WIDTH, ellipsis())


def header_fields(answer: dict[str, Any]) -> list[str]:
    """What to say of the front door itself: where it serves, its pid, how many models may be
    loaded at once."""
    cap = answer["max_loaded"]
    loaded = "no cap on models loaded" if cap is None else f"at most {cap} models loaded"
    return [f"vqpool serve on {answer['url']}", f"pid {answer['pid']}", loaded]


def header(answer: dict[str, Any]) -> str:
    return ", ".join(header_fields(answer))


def port(row: dict[str, Any]) -> int | None:
    """The port the model's worker serves on (None while it has none)."""
    return None if row["url"] is None else urlsplit(row["url"]).port


def keep_alive_left(row: dict[str, Any]) -> str:
    """How long an idle loaded model stays: "pinned", "forever", the time left; "-" otherwise."""
    if row["state"] != "loaded":
        return "-"
    if row["pinned"]:
        return "pinned"
    if row["keep_alive_s"] is None:
        return "forever"
    left = row["keep_alive_left_s"]
    return "-" if left is None else duration(left)


def weights(row: dict[str, Any]) -> str:
    """The model's weights in bytes as known before it loads; "?" when unknown."""
    n = row.get("weights_bytes")
    return "?" if n is None else human_bytes(n)


def ledger_memory(ctl: Ctl, answer: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """What vqpoold counts for each served model, by name: ``weights`` (its workers' charge when
    loaded, else the estimate before loading; None when unknown), ``kv_held`` (KV bytes its
    sessions hold, its prompt cache's among them), ``overhead`` (its workers' declared overhead,
    charged beside the weights; the front door's figure before loading), ``cached`` (its prompt
    cache's bytes), ``measured`` (its processes' memory as their heartbeats report it, None
    before any report) and ``share`` (weights, overhead and KV held over the budget, None
    without a budget). Empty when vqpoold does not
    answer."""
    try:
        listed = ctl.call("model_list")
        sessions = ctl.call("sessions")
    except (CtlError, VqpoolError):
        return {}
    budget = listed["budget"]["budget"]
    rows = {m["model"]: m for m in listed["models"]}
    memory = {}
    for row in answer["models"]:
        name = row["name"]
        daemon_row = rows.get(name, {})
        weights = daemon_row.get("weights") if daemon_row.get("sessions") else None
        overhead = daemon_row.get("overhead", 0) if weights is not None else None
        if weights is None:
            weights = row.get("weights_bytes")
        if overhead is None:
            overhead = row.get("overhead_bytes") or 0
        held = daemon_row.get("held", 0)
        measured = (daemon_row.get("memory") or {}).get("measured")
        cached = sum(
            (s.get("prompt_cache") or {}).get("bytes", 0) for s in sessions if s["model"] == name
        )
        loaded = row["state"] != "not_loaded" or held > 0
        charged = ((weights or 0) + overhead if loaded else 0) + held
        memory[name] = {
            "weights": weights,
            "overhead": overhead,
            "kv_held": held,
            "cached": cached,
            "measured": measured,
            "share": None if not budget else charged / budget,
        }
    return memory


def memory_cells(memory: dict[str, Any] | None) -> list[str]:
    """KV HELD, CACHED, MEASURED and SHARE of a model's :func:`ledger_memory` ("-" unknown)."""
    if memory is None:
        return ["-"] * 4
    measured, share = memory["measured"], memory["share"]
    return [
        human_bytes(memory["kv_held"]),
        human_bytes(memory["cached"]),
        "-" if measured is None else human_bytes(measured),
        "-" if share is None else percent(share),
    ]


def idle(row: dict[str, Any]) -> str:
    return "-" if row["idle_s"] is None else duration(row["idle_s"])


def models_table(answer: dict[str, Any]) -> str:
    """The front door and its models' state and requests, for ``status``."""
    labels = labels_of(answer)
    rows = [
        [labels[row["name"]], row["state"], row["running"], row["queued"]]
        for row in answer["models"]
    ]
    return header(answer) + "\n" + table(["MODEL", "STATE", "RUNNING", "QUEUED"], rows)


def model_lines(answer: dict[str, Any], width: int) -> list[str]:
    """The front door and one line per model (state, requests), for ``watch``: lines of at
    most ``width`` columns."""
    labels = model_labels(
        [row["name"] for row in answer["models"]], max(12, width // 3), ellipsis()
    )
    label_width = max((len(label) for label in labels.values()), default=0)
    state_width = max((len(row["state"]) for row in answer["models"]), default=0)
    lines = fit_fields(header_fields(answer), width, ", ")
    for row in answer["models"]:
        state = f"{row['state']:<{state_width}}"
        fields = [state, f"running {row['running']}, queued {row['queued']}"]
        lines += labelled_lines(labels[row["name"]], label_width, fields, width)
    return lines
