"""Budget settings as an operator writes them: the TOML ``[models."NAME"]`` tables and the
fields of ``vqpoolctl model set NAME --reserve 2GiB --limit 6GiB --weight 2``.

Sizes are ints (bytes) or strings with units (``"2GiB"``, see ``shared/byte_sizes.py``); a
limit of ``"none"`` (or None over the wire) means no limit of the model's own. The result is
:class:`~vqpool.daemon.budget.types.ModelSettings`, which validates the combination.

    [models."mlx-community/Llama-3.2-3B-Instruct-4bit"]
    reserve = "2GiB"
    limit = "6GiB"
    weight = 2
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from vqpool.daemon.budget.types import DEFAULT_SETTINGS, ModelSettings
from vqpool.shared.byte_sizes import parse_bytes

MODEL_FIELDS = ("reserve", "limit", "weight")


def model_settings(
    fields: Mapping[str, Any], base: ModelSettings = DEFAULT_SETTINGS, *, where: str = "model"
) -> ModelSettings:
    """``base`` with the given ``fields`` changed (the others kept), e.g. for ``model set NAME
    --reserve 2GiB`` pass the model's current settings as ``base``.

    Args:
        fields: Any of ``reserve`` (size), ``limit`` (size, or None / "none" for no limit) and
            ``weight`` (number).
        base: The settings the unchanged fields come from.
        where: What the fields belong to, for error messages (``models."llama"`` in a file).

    Raises:
        ValueError: An unknown field, a bad size or weight, or a bad combination (reserve over
            limit), naming ``where``.
    """
    unknown = sorted(set(fields) - set(MODEL_FIELDS))
    if unknown:
        raise ValueError(f"{where}: unknown setting(s) {unknown} (known: {list(MODEL_FIELDS)})")
    changes: dict[str, Any] = {}
    try:
        if "reserve" in fields:
            changes["reserve"] = parse_bytes(fields["reserve"], what="reserve", allow_zero=True)
        if "limit" in fields:
            limit = fields["limit"]
            none = limit is None or (isinstance(limit, str) and limit.strip().lower() == "none")
            changes["limit"] = None if none else parse_bytes(limit, what="limit", allow_zero=True)
        if "weight" in fields:
            weight = fields["weight"]
            if isinstance(weight, str):
                try:
                    weight = float(weight)
                except ValueError:
                    raise ValueError(f"weight must be a number, got {weight!r}") from None
            changes["weight"] = weight
        return replace(base, **changes)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def models_from_toml(table: Any, where: str = "[models]") -> dict[str, ModelSettings]:
    """The ``[models]`` table of a settings file: one sub-table per model name.

    Raises:
        ValueError: Not a table of tables, or a bad model entry (see :func:`model_settings`).
            Whether the reserves fit the budget is checked by ``BudgetLedger``.
    """
    if not isinstance(table, Mapping):
        raise ValueError(f"{where} must be a table of models, got {table!r}")
    models = {}
    for name, fields in table.items():
        entry = f'models."{name}"'
        if not isinstance(fields, Mapping):
            raise ValueError(f"{entry} must be a table (reserve, limit, weight), got {fields!r}")
        models[name] = model_settings(fields, where=entry)
    return models
