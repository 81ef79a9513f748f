"""The wheel holds every subpackage (an unlisted one works editable but is left out of a wheel)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = {"shared": "vqpool/shared", "daemon": "vqpool/daemon", "worker": "vqpool/worker"}


def test_wheel_contains_every_module_and_command(tmp_path: Path) -> None:
    # Build from a copy: building in the checkout would touch build/, where the strict editable
    # install keeps its links.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", *PACKAGE_DIRS):
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(path, src / name)
    out = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "-o", str(out), str(src)],
        check=True,
        capture_output=True,
    )
    (wheel,) = out.glob("vqpool-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder, package in PACKAGE_DIRS.items():
        for module in (ROOT / folder).rglob("*.py"):
            inside = f"{package}/{module.relative_to(ROOT / folder).as_posix()}"
            assert inside in names, f"{inside} is missing from the wheel"
        assert f"{package}/py.typed" in names
    assert not any(n.startswith("vqpool/__init__") for n in names), "vqpool must stay a namespace"
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    for command in (
        "vqpoold = vqpool.daemon.__main__:main",
        "vqpoolctl = vqpool.daemon.ctl.cli:main",
        "vqpool-worker = vqpool.worker.serve:main",
    ):
        assert command in text, f"{command!r} is missing from the entry points"
