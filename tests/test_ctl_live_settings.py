"""Settings made live (`vqpoolctl budget`, `vqpoolctl model set`) outlive a vqpoold restart:
kept in the run directory (0600, replaced atomically), loaded at start on top of the config
file's, and `model list` says which come from where. A corrupt file is set aside with a warning
and the daemon starts with the config file's settings. A real vqpoold, restarted on the same run
directory, driven through the real vqpoolctl."""

from __future__ import annotations

import json
import signal
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ctl_harness import ctl_json, run_ctl
from daemon_harness import AgentProcess
from vqpool.worker.testing.launch import DaemonProcess

StartDaemon = Callable[..., DaemonProcess]
StartWorker = Callable[[Path, str], AgentProcess]

KIB = 1024
MIB = 1024 * KIB
SETTINGS_FILE = "live-settings.json"


def _config(run_dir: Path) -> Path:
    """A config file beside the run directory: model "cfg" with a reserve and a weight."""
    path = run_dir.parent / "vqpoold.toml"
    path.write_text('[models."cfg"]\nreserve = "64KiB"\nweight = 2\n')
    return path


def _models(run_dir: Path) -> dict[str, dict[str, Any]]:
    return {v["model"]: v for v in ctl_json(run_dir, "model", "list")["models"]}


def test_live_settings_survive_a_restart_and_model_list_says_where_they_come_from(
    start_daemon: StartDaemon, start_worker: StartWorker, run_dir: Path
) -> None:
    options = ("--n-blocks", "64", "--budget", "8MiB", "--config", str(_config(run_dir)))
    daemon = start_daemon(*options, run_dir=run_dir)
    start_worker(run_dir, "alpha")
    for args in (
        ["budget", "4MiB"],
        ["model", "set", "cfg", "--limit", "2MiB"],
        ["model", "set", "alpha", "--reserve", "128KiB", "--weight", "3"],
    ):
        result = run_ctl(run_dir, *args)
        assert result.returncode == 0, (args, result.stderr)
    path = run_dir / SETTINGS_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    before = _models(run_dir)

    for sig in (signal.SIGKILL, signal.SIGTERM):  # a crash and a clean stop alike
        daemon.stop(sig)
        daemon = start_daemon(*options, run_dir=run_dir)
        assert ctl_json(run_dir, "budget")["budget"] == 4 * MIB
        models = _models(run_dir)
        for name in ("cfg", "alpha"):
            got, want = models[name], before[name]
            assert [got[k] for k in ("reserve", "limit", "weight")] == [
                want[k] for k in ("reserve", "limit", "weight")
            ]
        assert models["cfg"]["settings_from"] == {
            "reserve": "config",
            "limit": "live",
            "weight": "config",
        }
        assert models["alpha"]["settings_from"] == {
            "reserve": "live",
            "limit": "default",
            "weight": "live",
        }
        assert "live settings" in daemon.log() and str(path) in daemon.log()

    text = run_ctl(run_dir, "model", "list").stdout
    cfg_line = next(line for line in text.splitlines() if line.startswith("cfg "))
    assert "live: limit; config: reserve, weight" in cfg_line
    alpha_line = next(line for line in text.splitlines() if line.startswith("alpha "))
    assert "live: reserve, weight" in alpha_line
    saved = json.loads(path.read_text())
    assert saved["budget"] == 4 * MIB
    assert saved["models"] == {
        "cfg": {"limit": 2 * MIB},
        "alpha": {"reserve": 128 * KIB, "weight": 3.0},
    }
    # model unset: back to the config file's settings, in the daemon and in the file.
    assert run_ctl(run_dir, "model", "unset", "cfg").returncode == 0
    cfg = _models(run_dir)["cfg"]
    assert cfg["limit"] is None and set(cfg["settings_from"].values()) == {"config"}
    assert list(json.loads(path.read_text())["models"]) == ["alpha"]


def test_a_corrupt_live_settings_file_is_set_aside_and_the_config_file_rules(
    start_daemon: StartDaemon, run_dir: Path
) -> None:
    options = ("--n-blocks", "64", "--budget", "8MiB", "--config", str(_config(run_dir)))
    for garbage in (
        "{not json",
        json.dumps({"version": 1, "budget": "lots", "models": {}}),
        json.dumps({"version": 1, "budget": None, "models": {"cfg": {"reserve": 64 * MIB}}}),
    ):
        run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        (run_dir / SETTINGS_FILE).write_text(garbage)
        daemon = start_daemon(*options, run_dir=run_dir)
        assert ctl_json(run_dir, "budget")["budget"] == 8 * MIB
        cfg = _models(run_dir)["cfg"]
        assert (cfg["reserve"], cfg["limit"], cfg["weight"]) == (64 * KIB, None, 2)
        assert set(cfg["settings_from"].values()) <= {"config", "default"}
        log = daemon.log()
        assert "WARNING" in log and SETTINGS_FILE in log and "config file" in log, log
        assert not (run_dir / SETTINGS_FILE).exists()
        assert (run_dir / f"{SETTINGS_FILE}.bad").read_text() == garbage
        # The next live change writes a fresh file.
        assert run_ctl(run_dir, "model", "set", "cfg", "--weight", "5").returncode == 0
        assert json.loads((run_dir / SETTINGS_FILE).read_text())["models"] == {
            "cfg": {"weight": 5.0}
        }
        daemon.stop()
        (run_dir / SETTINGS_FILE).unlink()


def test_live_settings_are_kept_for_a_bounded_number_of_models(
    start_daemon: StartDaemon, run_dir: Path
) -> None:
    from vqpool.daemon.budget.live_settings import MAX_LIVE_MODELS

    daemon = start_daemon("--n-blocks", "64", run_dir=run_dir)
    for i in range(MAX_LIVE_MODELS - 1):
        daemon.admin("model_set", model=f"m{i}", weight=2.0, create=True)
    daemon.admin("model_set", model="plain", create=True)  # created with no setting of its own
    result = run_ctl(run_dir, "model", "set", "one-too-many", "--weight", "2", "--create")
    assert result.returncode == 4
    assert f"at most {MAX_LIVE_MODELS} models" in result.stderr
    assert "model unset" in result.stderr or "remove" in result.stderr
    assert "one-too-many" not in _models(run_dir)
    saved = json.loads((run_dir / SETTINGS_FILE).read_text())
    assert len(saved["models"]) == MAX_LIVE_MODELS
    # A model that already has live settings may still change them.
    assert daemon.admin("model_set", model="m0", weight=3.0)["weight"] == 3.0
    # All of them come back after a restart (a full file is a good file).
    daemon.stop(signal.SIGKILL)
    daemon = start_daemon("--n-blocks", "64", run_dir=run_dir)
    models = _models(run_dir)
    assert len(models) == MAX_LIVE_MODELS and models["m0"]["weight"] == 3.0
    assert models["plain"]["configured"] and models["plain"]["weight"] == 1
    assert "ignoring" not in daemon.log()
