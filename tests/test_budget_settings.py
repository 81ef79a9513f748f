"""Budget settings from TOML tables and vqpoolctl fields (daemon/budget/settings.py)."""

from __future__ import annotations

import tomllib
from typing import Any

import pytest
from vqpool.daemon.budget.ledger import ModelSettings
from vqpool.daemon.budget.settings import model_settings, models_from_toml

GiB = 2**30


def test_models_from_a_toml_file() -> None:
    text = """
    [models."mlx-community/Llama-3.2-3B-Instruct-4bit"]
    reserve = "2GiB"
    limit = "6GiB"
    weight = 2

    [models.qwen]
    weight = 0.5

    [models.tiny]
    reserve = 1048576
    """
    models = models_from_toml(tomllib.loads(text)["models"])
    assert models == {
        "mlx-community/Llama-3.2-3B-Instruct-4bit": ModelSettings(2 * GiB, 6 * GiB, 2),
        "qwen": ModelSettings(weight=0.5),
        "tiny": ModelSettings(reserve=2**20),
    }


def test_partial_update_keeps_the_other_fields() -> None:
    base = ModelSettings(2 * GiB, 6 * GiB, 2)
    assert model_settings({"reserve": "1GiB"}, base) == ModelSettings(GiB, 6 * GiB, 2)
    assert model_settings({"limit": "none"}, base) == ModelSettings(2 * GiB, None, 2)
    assert model_settings({"limit": None}, base).limit is None
    assert model_settings({"weight": "3"}, base).weight == 3.0
    assert model_settings({}, base) == base


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"reserv": "1GiB"}, r"llama: unknown setting\(s\) \['reserv'\]"),
        ({"reserve": "-1GiB"}, "llama: reserve must not be negative"),
        ({"reserve": "lots"}, "llama: reserve 'lots': not a size"),
        ({"limit": "8XB"}, "llama: limit '8XB': unknown unit"),
        ({"weight": "heavy"}, "llama: weight must be a number, got 'heavy'"),
        ({"weight": 0}, r"llama: weight must be in \[0.001, 1000\]"),
        ({"reserve": "2GiB", "limit": "1GiB"}, "llama: reserve 2 GiB is over the limit 1 GiB"),
    ],
)
def test_bad_fields_name_where_they_are(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        model_settings(fields, where="llama")


def test_bad_tables() -> None:
    with pytest.raises(ValueError, match=r"\[models\] must be a table of models"):
        models_from_toml(["llama"])
    with pytest.raises(ValueError, match=r'models\."llama" must be a table'):
        models_from_toml({"llama": "2GiB"})
    with pytest.raises(ValueError, match=r'models\."llama": unknown setting'):
        models_from_toml({"llama": {"floor": 1}})
