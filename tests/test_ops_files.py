"""The service files shipped in docs/ are valid and start vqpoold with options it accepts."""

from __future__ import annotations

import configparser
import plistlib
import shlex
from pathlib import Path

from vqpool.daemon.__main__ import build_parser

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


def test_systemd_user_unit() -> None:
    unit = configparser.ConfigParser(interpolation=None, strict=True)
    unit.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    unit.read(DOCS / "systemd" / "vqpoold.service")
    service = unit["Service"]
    program, *args = shlex.split(service["ExecStart"])
    assert program.endswith("/vqpoold")
    build_parser().parse_args(args)
    assert service["Type"] == "simple"  # vqpoold stays in the foreground
    assert service["Restart"] == "on-failure"
    assert service["KillSignal"] == "SIGTERM"
    assert unit["Install"]["WantedBy"] == "default.target"


def test_operations_guide_covers_the_essentials() -> None:
    guide = (DOCS / "operations.md").read_text()
    for needle in (
        "launchd/com.vqpool.vqpoold.plist",
        "systemd/vqpoold.service",
        "$XDG_RUNTIME_DIR/vqpool",
        "vqpoolctl shrink",
        "--metrics-port",
        "### Exit codes",
    ):
        assert needle in guide, needle
