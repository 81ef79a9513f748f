"""The package's imports have no cycle and keep its layers.

Every module of the packages that pyproject's ``[tool.setuptools.package-dir]`` maps is read
with ``ast``, and every import counts: at the top, inside functions, and under
``if TYPE_CHECKING:`` (a cycle hidden there is still a cycle in the design). An edge goes to
the module the statement names: ``from a.b import c`` is an edge to ``a.b.c`` when that is a
module or a package, else to ``a.b``. The layers:

- ``vqpool.daemon`` never imports ``vqpool.worker``, nor the worker the daemon;
- ``vqpool.shared`` imports neither;
- ``vqpool.daemon.ctl`` (vqpoolctl) imports nothing of ``vqpool.daemon`` outside itself;
- only ``vqpool.worker.testing`` itself imports ``vqpool.worker.testing`` (development helpers).

Run as a script (``python tests/test_layering.py``) it prints what it finds.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TESTING_PACKAGE = "vqpool.worker.testing"

# (importer, imported, rule): no module of the first package may import one of the second.
FORBIDDEN = (
    ("vqpool.daemon", "vqpool.worker", "the daemon never imports the worker"),
    ("vqpool.worker", "vqpool.daemon", "the worker never imports the daemon"),
    ("vqpool.shared", "vqpool.daemon", "shared imports neither the daemon nor the worker"),
    ("vqpool.shared", "vqpool.worker", "shared imports neither the daemon nor the worker"),
)

MAX_CYCLES_SHOWN = 20  # per strongly connected set of modules


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    is_package: bool


def package_dirs(root: Path) -> dict[str, Path]:
    """pyproject's package-dir: each top package and its folder."""
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {package: root / folder for package, folder in setuptools["package-dir"].items()}


def walk_modules(root: Path) -> dict[str, Module]:
    """Every module under the folders pyproject's package-dir maps, by dotted name."""
    modules: dict[str, Module] = {}
    for package, folder in package_dirs(root).items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            name = ".".join((package, *(parts[:-1] if is_package else parts)))
            modules[name] = Module(name, path, is_package)
    return modules


def import_graph(root: Path) -> dict[str, dict[str, str]]:
    """importer -> imported -> where the first statement importing it is ("path:line"), for
    every import between modules of the packages."""
    modules = walk_modules(root)
    roots = tuple(package_dirs(root))

    def exists(name: str) -> bool:  # a module, or a folder holding modules
        return name in modules or any(m.startswith(name + ".") for m in modules)

    def internal(name: str) -> bool:
        return any(name == r or name.startswith(r + ".") for r in roots)

    graph: dict[str, dict[str, str]] = {name: {} for name in modules}
    for module in modules.values():
        tree = ast.parse(module.path.read_text(), str(module.path))
        statements = [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]
        for node in sorted(statements, key=lambda n: n.lineno):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                targets = []
                base = node.module or ""
                if node.level:
                    package = module.name.split(".")
                    if not module.is_package:
                        package.pop()
                    package = package[: len(package) - (node.level - 1)]
                    base = ".".join([*package, base] if base else package)
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    targets.append(submodule if exists(submodule) else base)
            where = f"{module.path.relative_to(root)}:{node.lineno}"
            for target in targets:
                if target != module.name and internal(target):
                    graph[module.name].setdefault(target, where)
    return graph


def strongly_connected(graph: Mapping[str, Mapping[str, str]]) -> list[list[str]]:
    """The sets of two or more modules that import each other, each sorted (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, {}):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            members = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.append(member)
                if member == node:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def simple_cycles(
    graph: Mapping[str, Mapping[str, str]], members: list[str]
) -> Iterator[list[str]]:
    """Each cycle through ``members`` once, starting at its smallest module."""
    inside = set(members)

    def extend(path: list[str]) -> Iterator[list[str]]:
        start = path[0]
        for target in sorted(graph.get(path[-1], {})):
            if target == start:
                yield [*path, start]
            elif target in inside and target > start and target not in path:
                yield from extend([*path, target])

    for start in members:
        yield from extend([start])


def problems(root: Path = ROOT) -> tuple[list[str], list[str]]:
    """(the import cycles, the layer violations), each as readable lines."""
    graph = import_graph(root)
    cycles: list[str] = []
    for members in strongly_connected(graph):
        cycles.append(f"import cycle among {', '.join(members)}:")
        for n, cycle in enumerate(simple_cycles(graph, members)):
            if n == MAX_CYCLES_SHOWN:
                cycles.append("    ... and more")
                break
            steps = [graph[a][b] for a, b in pairwise(cycle)]
            cycles.append(f"    {' -> '.join(cycle)}   ({', '.join(steps)})")

    def within(name: str, package: str) -> bool:
        return name == package or name.startswith(package + ".")

    violations: list[str] = []
    for source, edges in sorted(graph.items()):
        for target, where in sorted(edges.items()):
            rules = [rule for a, b, rule in FORBIDDEN if within(source, a) and within(target, b)]
            if within(source, "vqpool.daemon.ctl") and (
                within(target, "vqpool.daemon") and not within(target, "vqpool.daemon.ctl")
            ):
                rules.append("vqpoolctl (vqpool.daemon.ctl) imports only shared and itself")
            if within(target, TESTING_PACKAGE) and not within(source, TESTING_PACKAGE):
                rules.append(f"only development helpers import {TESTING_PACKAGE}")
            violations += [f"{source} imports {target} ({where}): {rule}" for rule in rules]
    return cycles, violations


def test_the_walk_covers_every_package() -> None:
    modules = walk_modules(ROOT)
    assert {"vqpool.shared", "vqpool.daemon", "vqpool.worker"} <= modules.keys()
    assert "vqpool.shared.allocator.block_pool_allocator" in modules


def test_no_import_cycle() -> None:
    cycles, _ = problems()
    assert not cycles, "\n" + "\n".join(cycles)


def test_no_layer_violation() -> None:
    _, violations = problems()
    assert not violations, "\n" + "\n".join(violations)


def write_tree(root: Path, files: dict[str, str]) -> None:
    (root / "pyproject.toml").write_text(
        "[tool.setuptools.package-dir]\n"
        '"vqpool.shared" = "shared"\n"vqpool.daemon" = "daemon"\n"vqpool.worker" = "worker"\n'
    )
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_walker_finds_a_cycle_behind_type_checking_and_in_a_function(tmp_path: Path) -> None:
    write_tree(
        tmp_path,
        {
            "shared/__init__.py": "",
            "shared/a.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n"
                "    from vqpool.shared.b import B\n"
            ),
            "shared/b.py": "def late():\n    from . import a\n",
            "shared/c.py": "import vqpool.shared.a\n",
        },
    )
    cycle = "vqpool.shared.a -> vqpool.shared.b -> vqpool.shared.a"
    where = "(shared/a.py:3, shared/b.py:2)"  # the TYPE_CHECKING import, the function's
    assert problems(tmp_path) == (
        ["import cycle among vqpool.shared.a, vqpool.shared.b:", f"    {cycle}   {where}"],
        [],
    )


def test_the_walker_finds_each_layer_violation(tmp_path: Path) -> None:
    write_tree(
        tmp_path,
        {
            "shared/__init__.py": "",
            "shared/config.py": "from vqpool.worker import client\n",
            "daemon/__init__.py": "",
            "daemon/commands.py": "from vqpool.worker.client import PoolClient\n",
            "daemon/ctl/__init__.py": "",
            "daemon/ctl/options.py": "from vqpool.daemon import commands\nfrom . import cli\n",
            "daemon/ctl/cli.py": "from ..ctl import options\nfrom .. import VERSION\n",
            "worker/__init__.py": "",
            "worker/client.py": "from vqpool.daemon.commands import HELP\n",
            "worker/testing/__init__.py": "from vqpool.worker.testing.launch import start\n",
            "worker/testing/launch.py": "from vqpool.worker import client\n",
            "worker/serve.py": "from .testing import launch\n",
        },
    )
    cycles, violations = problems(tmp_path)
    assert cycles == [
        "import cycle among vqpool.daemon.commands, vqpool.worker.client:",
        "    vqpool.daemon.commands -> vqpool.worker.client -> vqpool.daemon.commands   "
        "(daemon/commands.py:1, worker/client.py:1)",
        "import cycle among vqpool.daemon.ctl.cli, vqpool.daemon.ctl.options:",
        "    vqpool.daemon.ctl.cli -> vqpool.daemon.ctl.options -> vqpool.daemon.ctl.cli   "
        "(daemon/ctl/cli.py:1, daemon/ctl/options.py:2)",
    ]
    assert violations == [
        "vqpool.daemon.commands imports vqpool.worker.client (daemon/commands.py:1): "
        "the daemon never imports the worker",
        "vqpool.daemon.ctl.cli imports vqpool.daemon (daemon/ctl/cli.py:2): "
        "vqpoolctl (vqpool.daemon.ctl) imports only shared and itself",
        "vqpool.daemon.ctl.options imports vqpool.daemon.commands (daemon/ctl/options.py:1): "
        "vqpoolctl (vqpool.daemon.ctl) imports only shared and itself",
        "vqpool.shared.config imports vqpool.worker.client (shared/config.py:1): "
        "shared imports neither the daemon nor the worker",
        "vqpool.worker.client imports vqpool.daemon.commands (worker/client.py:1): "
        "the worker never imports the daemon",
        "vqpool.worker.serve imports vqpool.worker.testing.launch (worker/serve.py:1): "
        f"only development helpers import {TESTING_PACKAGE}",
    ]


if __name__ == "__main__":
    found_cycles, found_violations = problems()
    for line in [*found_cycles, *found_violations]:
        print(line)
    if not found_cycles and not found_violations:
        print("no import cycle, no layer violation")
    sys.exit(1 if found_cycles or found_violations else 0)
