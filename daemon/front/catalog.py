"""Which models the front door serves: the ``[models."NAME"]`` tables and ``--model PATH``, and
which model a request's ``model`` names.

A table's serving keys (the daemon reads the budget keys of the same table)::

    [models."llama"]
    path = "mlx-community/Llama-3.2-3B-Instruct-4bit"   # a directory, a hub id or builtin:NAME
    aliases = ["llama3", "default"]
    keep_alive = "10m"                                   # seconds, "30s", "5m", "1h"; -1: never
    pinned = false                                       # never unloaded for being idle
    max_concurrent = 8                                   # any vqpool-worker option, as its flag

A table without ``path`` has budget settings only and is not served. ``--model PATH`` serves
``PATH`` under its own name with the defaults. Names resolve by one rule
(:mod:`vqpool.shared.model_names`): the exact name, else an alias, else the short label (the last
path parts) of one name.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from vqpool.shared.kv_formats import DEFAULT_GROUP_SIZE, quantized_format
from vqpool.shared.kv_sequence import DEFAULT_PREFILL_STEP_SIZE, SequenceQuantization
from vqpool.shared.model_names import resolve_model

DEFAULT_KEEP_ALIVE = 300.0
"""Seconds an idle model stays loaded (Ollama's default, five minutes)."""
NEVER = math.inf

BUDGET_FIELDS = ("reserve", "limit", "weight")
SERVE_FIELDS = ("path", "aliases", "keep_alive", "pinned")
WORKER_OPTIONS: dict[str, tuple[type, ...]] = {
    "max_concurrent": (int,),
    "prefill_step_size": (int,),
    "queue_timeout": (int, float),
    "max_queue": (int,),
    "reserve_mode": (str,),
    "growth_wait": (int, float),
    "prompt_cache_bytes": (int, str),
    "kv_disk_bytes": (int, str),
    "kv_disk_dir": (str,),
    "mlx_cache_limit": (int, str),
    "max_tokens": (int,),
    "max_tokens_limit": (int,),
    "seed": (int,),
    "pool_timeout": (int, float),
    "log_level": (str,),
    "adapter_path": (str,),
    "draft_model": (str,),
    "num_draft_tokens": (int,),
    "kv_bits": (int,),
    "kv_group_size": (int,),
    "quantized_kv_start": (int,),
}
"""The ``vqpool-worker`` options a model's table may set (as the flag without dashes; the
worker's ``--reserve`` is ``reserve_mode`` here, since ``reserve`` is the model's byte reserve).
The worker checks their values when it starts; a bad one fails the load with its reason."""
_WORKER_FLAGS = {"reserve_mode": "--reserve"}

MAX_MODELS = 256
MAX_ALIASES = 32
MAX_NAME_CHARS = 512

_DURATION = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_keep_alive(value: Any, what: str = "keep_alive") -> float:
    """Seconds from a number of seconds or a duration (``"30s"``, ``"5m"``, ``"1h"``); any
    negative value means never (``math.inf``), 0 means right after the last request.

    Raises:
        ValueError: Not a number or a duration, naming ``what``.
    """
    if isinstance(value, bool):
        raise ValueError(f"{what} must be seconds or a duration such as '5m', got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and (match := _DURATION.match(value)):
        seconds = float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    else:
        raise ValueError(
            f"{what} must be seconds or a duration such as '30s', '5m' or '1h' (-1: never), "
            f"got {value!r}"
        )
    if math.isnan(seconds):
        raise ValueError(f"{what} must be a number, got {value!r}")
    return NEVER if seconds < 0 else seconds


@dataclass(frozen=True)
class ModelEntry:
    """One model the front door serves.

    Attributes:
        name: The id clients send and see (the daemon's model name).
        path: What the worker loads: a directory, a hub id or ``builtin:NAME``.
        aliases: Other names that route to it.
        keep_alive: Seconds it stays loaded after its last request ends (``math.inf``: always).
        pinned: Never unloaded for being idle or to make room.
        worker_args: Extra ``vqpool-worker`` arguments.
    """

    name: str
    path: str
    aliases: tuple[str, ...] = ()
    keep_alive: float = DEFAULT_KEEP_ALIVE
    pinned: bool = False
    worker_args: tuple[str, ...] = field(default=())

    def worker_option(self, flag: str) -> str | None:
        """The value ``worker_args`` gives ``flag`` (e.g. ``"--draft-model"``), or None."""
        pairs = zip(self.worker_args[::2], self.worker_args[1::2], strict=True)
        return next((value for name, value in pairs if name == flag), None)

    def kv_quantization(self) -> tuple[int, int] | None:
        """``(bits, group_size)`` its worker quantizes KV to (``kv_bits``), or None: full
        precision."""
        bits = self.worker_option("--kv-bits")
        if bits is None:
            return None
        return int(bits), int(self.worker_option("--kv-group-size") or DEFAULT_GROUP_SIZE)

    def sequence_quantization(self) -> SequenceQuantization | None:
        """How its quantizing worker holds a sequence's blocks (``quantized_kv_start``,
        ``prefill_step_size``), or None: full precision."""
        if self.worker_option("--kv-bits") is None:
            return None
        start = int(self.worker_option("--quantized-kv-start") or 0)
        step = self.worker_option("--prefill-step-size")
        return SequenceQuantization.of(
            start, DEFAULT_PREFILL_STEP_SIZE if step is None else int(step)
        )

    def kv_format(self) -> str | None:
        """The block format tag of its quantized KV (``q4g64``...), or None: full precision."""
        quantization = self.kv_quantization()
        return None if quantization is None else quantized_format(*quantization)


def entry_from_table(name: str, table: Mapping[str, Any], keep_alive: float) -> ModelEntry | None:
    """The entry a ``[models."NAME"]`` table describes, or None when it has no ``path`` (budget
    settings only).

    Raises:
        ValueError: An unknown key or a wrongly typed value, naming the table.
    """
    where = f'models."{name}"'
    if not name or len(name) > MAX_NAME_CHARS:
        raise ValueError(f"{where}: a model name must be 1..{MAX_NAME_CHARS} characters")
    known = set(BUDGET_FIELDS) | set(SERVE_FIELDS) | set(WORKER_OPTIONS)
    unknown = sorted(set(table) - known)
    if unknown:
        raise ValueError(f"{where}: unknown setting(s) {unknown} (known: {sorted(known)})")
    if "path" not in table:
        extra = sorted(set(table) - set(BUDGET_FIELDS))
        if extra:
            raise ValueError(f"{where}: {extra} need a path (what the worker loads)")
        return None
    path = table["path"]
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"{where}: path must be a directory, a hub id or builtin:NAME")
    aliases = table.get("aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(a, str) and a for a in aliases):
        raise ValueError(f"{where}: aliases must be a list of names")
    if len(aliases) > MAX_ALIASES:
        raise ValueError(f"{where}: at most {MAX_ALIASES} aliases")
    pinned = table.get("pinned", False)
    if not isinstance(pinned, bool):
        raise ValueError(f"{where}: pinned must be true or false")
    if "keep_alive" in table:
        keep_alive = parse_keep_alive(table["keep_alive"], f"{where}: keep_alive")
    args: list[str] = []
    for key, types in WORKER_OPTIONS.items():
        if key not in table:
            continue
        value = table[key]
        if isinstance(value, bool) or not isinstance(value, types):
            names = " or ".join(t.__name__ for t in types)
            raise ValueError(f"{where}: {key} must be {names}, got {value!r}")
        args += [_WORKER_FLAGS.get(key, "--" + key.replace("_", "-")), str(value)]
    if "kv_bits" in table or "kv_group_size" in table:
        if "kv_bits" not in table:
            raise ValueError(f"{where}: kv_group_size needs kv_bits (the KV is not quantized)")
        try:  # priced by the load's KV minimum before any worker checks it
            quantized_format(table["kv_bits"], table.get("kv_group_size", DEFAULT_GROUP_SIZE))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    for key, least in (("quantized_kv_start", 0), ("prefill_step_size", 1)):
        if table.get(key, least) < least:  # they price the load's KV minimum too
            raise ValueError(f"{where}: {key} must be >= {least}, got {table[key]}")
    return ModelEntry(name, path, tuple(aliases), keep_alive, pinned, tuple(args))


def budget_tables(models_table: Mapping[str, Any]) -> dict[str, Any]:
    """The budget part of each ``[models."NAME"]`` table, for the daemon (the serving keys are
    checked by the front door; any other key stays for the daemon to refuse)."""
    serving = set(SERVE_FIELDS) | set(WORKER_OPTIONS)
    return {
        name: {k: v for k, v in table.items() if k not in serving}
        if isinstance(table, Mapping)
        else table
        for name, table in models_table.items()
    }


class Catalog:
    """The served models and the names that reach them.

    Raises:
        ValueError: No model, too many, or a name or alias that two models share.
    """

    def __init__(self, entries: Sequence[ModelEntry]) -> None:
        if not entries:
            raise ValueError(
                "no model to serve: pass --model PATH or give a config file whose "
                '[models."NAME"] tables have a path'
            )
        if len(entries) > MAX_MODELS:
            raise ValueError(f"at most {MAX_MODELS} models")
        self.entries = {e.name: e for e in entries}
        if len(self.entries) != len(entries):
            raise ValueError("a model is named twice")
        self._aliases: dict[str, str] = {}
        for entry in entries:
            for alias in entry.aliases:
                owner = self._aliases.setdefault(alias, entry.name)
                if alias in self.entries or owner != entry.name:
                    raise ValueError(f"alias {alias!r} of {entry.name!r} names another model too")

    @property
    def names(self) -> list[str]:
        return list(self.entries)

    def resolve(self, given: str) -> ModelEntry | None:
        """The model ``given`` names (exact name, alias, or label), None if none.

        Raises:
            ValueError: ``given`` is the label of several models (the message names them).
        """
        if given in self.entries:
            return self.entries[given]
        if given in self._aliases:
            return self.entries[self._aliases[given]]
        name = resolve_model(given, self.entries)
        return None if name is None else self.entries[name]


def catalog_from_config(
    models_table: Mapping[str, Any],
    model_paths: Sequence[str],
    keep_alive: float,
    worker_defaults: Mapping[str, str] | None = None,
) -> Catalog:
    """The catalog of a settings file's ``[models]`` tables plus the ``--model`` paths;
    ``worker_defaults`` (flag -> value, e.g. ``[serve]``'s ``kv_disk_bytes``) go to every
    model's worker whose table does not set the flag.

    Raises:
        ValueError: A bad table, or no model at all.
    """
    entries = []
    for name, table in models_table.items():
        if not isinstance(table, Mapping):
            raise ValueError(f'models."{name}" must be a table, got {table!r}')
        entry = entry_from_table(name, table, keep_alive)
        if entry is not None:
            entries.append(entry)
    served = {e.name for e in entries}
    for path in model_paths:  # a model with a table of budget settings only is served too
        if path not in served:
            served.add(path)
            entries.append(ModelEntry(path, path, keep_alive=keep_alive))
    for i, entry in enumerate(entries):
        extra = [
            arg
            for flag, value in (worker_defaults or {}).items()
            if entry.worker_option(flag) is None
            for arg in (flag, value)
        ]
        if extra:
            entries[i] = replace(entry, worker_args=entry.worker_args + tuple(extra))
    return Catalog(entries)
