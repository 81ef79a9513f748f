"""What users read (README.md, docs/, vqpoolctl's and vqpool-worker's help) cites nothing they
do not have: no team notes (MEMORY.md, FACTS.md), no issue or finding numbers, no "seed" for
the code vqpool started from. It says the rule itself instead."""

from __future__ import annotations

import re
from pathlib import Path

from ctl_harness import run_ctl_each
from vqpool.worker.serve import build_parser as build_worker_parser

ROOT = Path(__file__).resolve().parent.parent
UNSEEN = re.compile(
    r"MEMORY\.md|FACTS\.md|\bissue \d+|\bthe issue\b|\bfinding \d+|\bthe seed\b|\bseed behaviour",
    re.IGNORECASE,
)


def _unseen(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if UNSEEN.search(line)]


def test_readme_and_docs_cite_nothing_a_user_does_not_have() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    assert len(pages) > 5
    found = {str(page.relative_to(ROOT)): _unseen(page.read_text()) for page in pages}
    assert not {page: lines for page, lines in found.items() if lines}


def test_command_help_cites_nothing_a_user_does_not_have(tmp_path: Path) -> None:
    from vqpool.daemon.ctl.commands import COMMANDS

    results = run_ctl_each(tmp_path, [["help", name] for name in COMMANDS] + [["help"]])
    for result in results:
        assert result.returncode == 0, result.stderr
        assert not _unseen(result.stdout), result.args
    assert not _unseen(build_worker_parser().format_help())
