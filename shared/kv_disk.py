"""Where a model's prompt-cache disk tier (``--kv-disk-bytes``) keeps its entry files, and their
removal: the worker writes them there, the front door removes those of a model it has not loaded
(``vqpoolctl cache drop MODEL --disk``)."""

from __future__ import annotations

import re
from pathlib import Path

ENTRY_SUFFIX = ".kv"
TEMP_SUFFIX = ".tmp"
"""An entry file's name ends with ``ENTRY_SUFFIX``; a write in progress with ``TEMP_SUFFIX``."""


def kv_disk_directory(run_dir: Path, served_name: str, configured: str | None) -> Path:
    """The directory of a model's entry files: ``configured`` (``--kv-disk-dir``) when given,
    else ``RUN_DIR/kv-disk/NAME`` (``served_name`` as one path component)."""
    if configured:
        return Path(configured).expanduser()
    name = re.sub(r"[^A-Za-z0-9._-]", "_", served_name).lstrip(".") or "model"
    return run_dir / "kv-disk" / name


def remove_entry_files(directory: Path) -> tuple[int, int]:
    """Remove the entry files (and unfinished writes) in ``directory``, nothing else: how many
    entries and their bytes. A directory that does not exist holds none. The caller makes sure
    no worker uses the directory."""
    if not directory.is_dir():
        return 0, 0
    entries = n_bytes = 0
    for path in directory.iterdir():
        if not path.name.endswith((ENTRY_SUFFIX, TEMP_SUFFIX)) or not path.is_file():
            continue
        size = path.stat().st_size
        path.unlink(missing_ok=True)
        if path.name.endswith(ENTRY_SUFFIX):
            entries += 1
            n_bytes += size
    return entries, n_bytes
