"""How an op is declared: its name, what it does, and its arguments with their checks and help.

Worker ops (:mod:`vqpool.shared.protocol.worker_ops`) and admin ops
(:mod:`vqpool.shared.protocol.admin_ops`) are declared the same way; the daemon checks a
request's arguments against its op's declaration (:func:`parse_args`) and ``vqpoolctl`` takes
the help of an argument from it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from vqpool.shared.errors import BadRequestError
from vqpool.shared.protocol.checks import short_repr


@dataclass(frozen=True, slots=True)
class Field:
    """One argument of an op: its name, its check, whether it is required, and its help."""

    name: str
    check: Callable[[Any, str], Any]
    required: bool = True
    default: Any = None
    help: str = ""


@dataclass(frozen=True, slots=True)
class OpSpec:
    """One op of the protocol.

    Attributes:
        name: The op's name on the wire (the envelope's ``op``).
        help: What the op does and answers, for people.
        params: Its arguments, checked by :func:`parse_args`.
    """

    name: str
    help: str
    params: tuple[Field, ...] = ()

    def param(self, name: str) -> Field:
        """The argument called ``name``."""
        for field in self.params:
            if field.name == name:
                return field
        raise KeyError(f"op {self.name!r} has no argument {name!r}")


def op_table(*ops: OpSpec) -> dict[str, OpSpec]:
    """``ops`` by name (each name once)."""
    table = {op.name: op for op in ops}
    if len(table) != len(ops):
        raise ValueError("an op is declared twice")
    return table


def args_of(ops: Iterable[OpSpec]) -> dict[str, tuple[Field, ...]]:
    """Each op's arguments, by op name."""
    return {op.name: op.params for op in ops}


_Step = tuple[str, Callable[[Any, str], Any], bool, Any, str]

MAX_KEPT_STEPS = 256
"""Ops whose steps :func:`_make_steps` keeps (far more than the protocol has)."""

_kept_steps: dict[str, tuple[tuple[Field, ...], tuple[_Step, ...]]] = {}
"""By op: the schema and its steps (parse_args uses them while it is given that schema)."""


def _make_steps(op: str, schema: tuple[Field, ...]) -> tuple[_Step, ...]:
    """``schema`` as (name, check, required, default, name in errors) tuples, kept for the next
    request of ``op``: every request's arguments are checked with them."""
    steps = tuple((f.name, f.check, f.required, f.default, f"{op}.{f.name}") for f in schema)
    if len(_kept_steps) < MAX_KEPT_STEPS:
        _kept_steps[op] = (schema, steps)
    return steps


def parse_args(op: str, args: Any, schema: tuple[Field, ...]) -> dict[str, Any]:
    """``args`` checked against ``schema``: every required field present, no unknown field.

    Raises:
        BadRequestError: A missing, unknown or malformed argument.
    """
    if type(args) is not dict:
        raise BadRequestError(f"{op}: args must be a map, got {short_repr(args)}")
    parsed: dict[str, Any] = {}
    n_known = 0
    kept = _kept_steps.get(op)
    steps = kept[1] if kept is not None and kept[0] is schema else _make_steps(op, schema)
    for name, check, required, default, label in steps:
        if name in args:
            parsed[name] = check(args[name], label)
            n_known += 1
        elif required:
            raise BadRequestError(f"{op}: missing argument {name!r}")
        else:
            parsed[name] = default
    if len(args) != n_known:
        unknown = sorted(str(k) for k in args.keys() - {f.name for f in schema})
        raise BadRequestError(f"{op}: unknown argument(s) {unknown}")
    return parsed
