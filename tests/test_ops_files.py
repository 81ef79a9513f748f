"""The service files shipped in docs/ are valid and start vqpoold, vqpool-worker and vqpool serve
with options they accept."""

from __future__ import annotations

import configparser
import plistlib
import re
import shlex
from pathlib import Path

from vqpool.daemon.__main__ import build_parser
from vqpool.daemon.front.cli import build_parser as build_serve_parser
from vqpool.worker.serve import build_parser as build_worker_parser

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_launchd_plist() -> None:
    with open(DOCS / "launchd" / "com.vqpool.vqpoold.plist", "rb") as f:
        plist = plistlib.load(f)
    assert plist["Label"] == "com.vqpool.vqpoold"
    program, *args = plist["ProgramArguments"]
    assert program.endswith("/vqpoold")
    options = vars(build_parser().parse_args(args))  # exits (fails the test) on a bad option
    assert options["metrics_port"] == 9464
    assert plist["RunAtLoad"] is True
    assert plist["KeepAlive"] == {"SuccessfulExit": False}  # restart after a crash only
    assert plist["StandardErrorPath"].endswith("/Library/Logs/vqpoold.log")
    assert plist["ProcessType"] == "Interactive"


def test_launchd_plist_of_vqpool_serve() -> None:
    with open(DOCS / "launchd" / "com.vqpool.serve.plist", "rb") as f:
        plist = plistlib.load(f)
    assert plist["Label"] == "com.vqpool.serve"
    program, *args = plist["ProgramArguments"]
    assert program.endswith("/vqpool")
    options = vars(build_serve_parser().parse_args(args))  # exits (fails) on a bad option
    assert options["command"] == "serve" and options["port"] == 8080
    assert options["config"].endswith("/vqpool.toml")
    assert plist["KeepAlive"] == {"SuccessfulExit": False}
    assert plist["StandardErrorPath"].endswith("/Library/Logs/vqpool-serve.log")


def _systemd_unit(name: str) -> configparser.ConfigParser:
    unit = configparser.ConfigParser(interpolation=None, strict=True)
    unit.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    assert unit.read(DOCS / "systemd" / name), name
    return unit


def _systemd_exec_words(command: str, env: dict[str, str]) -> list[str]:
    """ExecStart's words with the environment substituted as systemd does: ``${VAR}`` as one
    word, a word that is only ``$VAR`` split into words (none when empty)."""
    words: list[str] = []
    for word in shlex.split(command):
        whole = re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", word)
        if whole:
            words.extend(env.get(whole.group(1), "").split())
        else:
            words.append(re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda m: env[m.group(1)], word))
    return words


def _env_file(path: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, sep, value = line.partition("=")
            assert sep and re.fullmatch(r"[A-Z_][A-Z0-9_]*", key), line
            env[key] = value
    return env


def test_systemd_user_unit() -> None:
    unit = _systemd_unit("vqpoold.service")
    service = unit["Service"]
    program, *args = shlex.split(service["ExecStart"])
    assert program.endswith("/vqpoold")
    build_parser().parse_args(args)
    assert service["Type"] == "simple"  # vqpoold stays in the foreground
    assert service["Restart"] == "on-failure"
    assert service["KillSignal"] == "SIGTERM"
    assert unit["Install"]["WantedBy"] == "default.target"


def test_systemd_worker_template_unit_serves_the_model_its_environment_file_names() -> None:
    unit = _systemd_unit("vqpool-worker@.service")
    assert unit["Unit"]["Wants"] == "vqpoold.service"
    assert unit["Unit"]["After"] == "vqpoold.service"
    service = unit["Service"]
    assert service["EnvironmentFile"] == "%h/.config/vqpool/worker-%i.env"  # one per instance
    env = _env_file(DOCS / "systemd" / "vqpool-worker-example.env")
    program, *args = _systemd_exec_words(service["ExecStart"], env)
    assert program.endswith("/vqpool-worker")
    options = build_worker_parser().parse_args(args)  # exits (fails the test) on a bad option
    assert options.model == env["VQPOOL_MODEL"]
    assert options.port == int(env["VQPOOL_PORT"])
    assert options.max_concurrent == 4  # VQPOOL_WORKER_ARGS reached the worker, word by word
    # With no extra options the command line still parses.
    bare = _systemd_exec_words(service["ExecStart"], {**env, "VQPOOL_WORKER_ARGS": ""})
    assert build_worker_parser().parse_args(bare[1:]).model == env["VQPOOL_MODEL"]
    assert service["Type"] == "simple"
    assert service["Restart"] == "on-failure"  # no daemon yet (exit 1): tried again
    assert service["RestartPreventExitStatus"] == "2"  # bad options or model: not retried
    assert service["KillSignal"] == "SIGTERM"
    assert unit["Install"]["WantedBy"] == "default.target"


def test_launchd_worker_plist_serves_one_model() -> None:
    path = DOCS / "launchd" / "com.vqpool.worker.example.plist"
    with open(path, "rb") as f:
        plist = plistlib.load(f)
    assert plist["Label"] == path.stem == "com.vqpool.worker.example"
    program, *args = plist["ProgramArguments"]
    assert program.endswith("/vqpool-worker")
    options = build_worker_parser().parse_args(args)
    assert options.model.endswith("/models/example") and options.port == 8081
    assert plist["RunAtLoad"] is True
    assert plist["KeepAlive"] == {"SuccessfulExit": False}
    assert plist["StandardErrorPath"].endswith("/Library/Logs/vqpool-worker.example.log")
    assert plist["ProcessType"] == "Interactive"


def test_operations_guide_covers_the_essentials() -> None:
    guide = (DOCS / "operations.md").read_text()
    for needle in (
        "launchd/com.vqpool.vqpoold.plist",
        "systemd/vqpoold.service",
        "launchd/com.vqpool.worker.example.plist",
        "systemd/vqpool-worker@.service",
        "systemd/vqpool-worker-example.env",
        "$XDG_RUNTIME_DIR/vqpool",
        "vqpoolctl shrink",
        "--metrics-port",
        "### Exit codes",
    ):
        assert needle in guide, needle
