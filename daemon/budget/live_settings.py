"""Budget settings made live (``vqpoolctl budget SIZE``, ``vqpoolctl model set``), kept in the run
directory so that they outlive a restart.

The file (``live-settings.json``, 0600, replaced atomically: a temporary file written and
fsynced, then renamed over it) holds the budget if it was set live and, per model, only the
fields set live; at start they are laid over the settings of the config file (and the command
line), field by field, so ``model list`` can say where each setting comes from. At most
:data:`MAX_LIVE_MODELS` models have live settings: names cost a client nothing, memory and the
file must not grow with them. A file that cannot be read, is not what this module writes, or
whose settings do not fit the config file's (reserves over the budget) is renamed to
``live-settings.json.bad`` with a warning, and the daemon starts with the config file's
settings: a bad file never keeps vqpoold from starting.

    {"version": 1, "budget": 4194304, "models": {"llama": {"limit": 2097152, "weight": 3.0}}}
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vqpool.daemon.budget.ledger import BudgetLedger
from vqpool.daemon.budget.settings import MODEL_FIELDS, model_settings
from vqpool.daemon.budget.types import DEFAULT_SETTINGS, ModelSettings
from vqpool.shared.byte_sizes import MAX_BYTES

log = logging.getLogger("vqpoold")

LIVE_SETTINGS_FILE = "live-settings.json"
VERSION = 1
MAX_LIVE_MODELS = 128
"""Most models the daemon keeps live settings for (a model set live past it is refused)."""

CONFIG, LIVE, DEFAULT = "config", "live", "default"
"""Where a setting in effect comes from (``model_list``'s ``settings_from``)."""


class LiveSettings:
    """The config file's budget settings and the live changes laid over them.

    Args:
        path: The file live changes are saved to (None: kept in memory only).
        budget: The config file's budget (None: no budget).
        models: The config file's models.
    """

    def __init__(
        self, path: Path | None, budget: int | None, models: Mapping[str, ModelSettings]
    ) -> None:
        self.path = path
        self.config_budget = budget
        self.config_models = dict(models)
        self.budget: int | None = None
        """The budget set live (None: the config file's)."""
        self.models: dict[str, dict[str, Any]] = {}
        """Per model, the fields set live (reserve, limit, weight)."""

    # -- in effect -----------------------------------------------------------------------------

    def effective_budget(self) -> int | None:
        return self.config_budget if self.budget is None else self.budget

    def base(self, model: str) -> ModelSettings:
        """``model``'s settings without its live ones: the config file's, or the defaults."""
        return self.config_models.get(model, DEFAULT_SETTINGS)

    def effective_models(self) -> dict[str, ModelSettings]:
        """Every model with settings of its own (config file or live), as in effect."""
        models = dict(self.config_models)
        for name, fields in self.models.items():
            models[name] = model_settings(fields, self.base(name), where=f"model {name!r}")
        return models

    def settings_from(self, model: str) -> dict[str, str]:
        """Where each of ``model``'s settings comes from: live, the config file or the default."""
        live = self.models.get(model, {})
        configured = CONFIG if model in self.config_models else DEFAULT
        return {field: LIVE if field in live else configured for field in MODEL_FIELDS}

    def known(self, model: str) -> bool:
        """Whether ``model`` has settings of its own (in the config file or live)."""
        return model in self.config_models or model in self.models

    # -- live changes (each saved; call after the ledger accepted it) -------------------------

    def check_room(self, model: str) -> None:
        """Refuse live settings for one model more than :data:`MAX_LIVE_MODELS`.

        Raises:
            ValueError: ``model`` has none yet and the cap is reached (nothing changes).
        """
        if model not in self.models and len(self.models) >= MAX_LIVE_MODELS:
            raise ValueError(
                f"model {model!r}: vqpoold keeps live settings for at most {MAX_LIVE_MODELS} "
                "models; remove some with `vqpoolctl model unset NAME` (or put the settings in "
                "the config file)"
            )

    def set_budget(self, budget: int) -> None:
        self.budget = budget
        self.save()

    def set_model(self, model: str, fields: Mapping[str, Any]) -> None:
        """Record ``fields`` (reserve, limit, weight: as ModelSettings holds them) as set live."""
        self.check_room(model)
        self.models[model] = {**self.models.get(model, {}), **fields}
        self.save()

    def unset_model(self, model: str) -> None:
        """Forget ``model``'s live settings."""
        del self.models[model]
        self.save()

    # -- the file ------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {"version": VERSION, "budget": self.budget, "models": self.models}

    def save(self) -> None:
        """Replace the file with the live settings (a failure is logged: the change holds until
        the daemon stops)."""
        if self.path is None:
            return
        try:
            _replace_file(self.path, json.dumps(self.to_json(), sort_keys=True).encode())
        except OSError as exc:
            log.error(
                "cannot save live settings to %s: %s (they last until a restart)", self.path, exc
            )

    @classmethod
    def load(
        cls,
        run_dir: Path,
        budget: int | None,
        models: Mapping[str, ModelSettings],
    ) -> LiveSettings:
        """The config file's settings with the live ones of ``run_dir``'s file laid over them.

        A file that cannot be used is renamed ``*.bad`` with a warning; the result then has no
        live settings.
        """
        live = cls(run_dir / LIVE_SETTINGS_FILE, budget, models)
        path = live.path
        assert path is not None
        try:
            text = path.read_text()
        except FileNotFoundError:
            return live
        except (OSError, UnicodeDecodeError) as exc:
            return live._set_aside(f"cannot read it: {exc}")
        try:
            live.budget, live.models = _parse(text)
            # The whole combination must be valid, as the ledger will check it.
            effective = live.effective_models()
            budget_now = live.effective_budget()
            BudgetLedger(MAX_BYTES if budget_now is None else budget_now, effective)
        except ValueError as exc:
            live.budget, live.models = None, {}
            return live._set_aside(str(exc))
        if live.budget is not None or live.models:
            log.info(
                "live settings from %s: budget %s, models %s (laid over the config file's)",
                path,
                "as configured" if live.budget is None else live.budget,
                ", ".join(sorted(live.models)) or "none",
            )
        return live

    def _set_aside(self, why: str) -> LiveSettings:
        assert self.path is not None
        bad = self.path.with_name(self.path.name + ".bad")
        try:
            os.replace(self.path, bad)
            kept = f"moved to {bad}"
        except OSError as exc:
            kept = f"could not be moved aside ({exc})"
        log.warning(
            "ignoring live settings file %s (%s): %s; starting with the config file's settings",
            self.path,
            why,
            kept,
        )
        return self


def _parse(text: str) -> tuple[int | None, dict[str, dict[str, Any]]]:
    """The budget and the models' live fields of a file's text.

    Raises:
        ValueError: Not JSON, not this file's shape, a bad value, or too many models.
    """
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("version") != VERSION:
        raise ValueError(f"not a version {VERSION} live settings map")
    budget = data.get("budget")
    if budget is not None and (
        isinstance(budget, bool) or not isinstance(budget, int) or not 0 < budget <= MAX_BYTES
    ):
        raise ValueError(f"budget must be a number of bytes or null, got {budget!r}")
    models = data.get("models")
    if not isinstance(models, dict):
        raise ValueError(f"models must be a map, got {models!r}")
    if len(models) > MAX_LIVE_MODELS:
        raise ValueError(f"{len(models)} models, more than the {MAX_LIVE_MODELS} kept")
    for name, fields in models.items():
        if not isinstance(fields, dict):  # empty: a model created with the default settings
            raise ValueError(f"model {name!r}: settings must be a map")
        model_settings(fields, where=f"model {name!r}")  # checks every field
        if isinstance(fields.get("reserve"), str) or isinstance(fields.get("limit"), str):
            raise ValueError(f"model {name!r}: sizes must be numbers of bytes")
    return budget, models


def _replace_file(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` (0600) so that a crash leaves the old file or the new one."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself
    finally:
        os.close(dir_fd)
