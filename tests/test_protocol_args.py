"""parse_args, for every op of both sockets, answers as a plain field by field check in the
schema's order does: the same parsed args, the same first error (its steps are kept per op and
its checks inlined for speed; this pins what they must not change)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from vqpool.shared.errors import BadRequestError
from vqpool.shared.protocol import ADMIN_ARGS, WORKER_ARGS, Field, parse_args

# Values of every kind a msgpack request can carry: each field's check takes some, refuses others.
VALUES: tuple[Any, ...] = (
    0,
    1,
    7,
    -1,
    1 << 63,
    0.5,
    True,
    None,
    "",
    "k",
    "fp16",
    "x" * 300,
    [],
    [1, 2],
    [["k", 1, 2, "fp16"]],
    [["k", "1", 2, "fp16"]],
    {},
    {"k": 4096},
)


def field_by_field(op: str, args: Any, schema: tuple[Field, ...]) -> dict[str, Any]:
    """The reference: each field in the schema's order, then the unknown ones."""
    if type(args) is not dict:
        raise BadRequestError(f"{op}: args must be a map, got {args!r}")
    parsed: dict[str, Any] = {}
    for field in schema:
        if field.name in args:
            parsed[field.name] = field.check(args[field.name], f"{op}.{field.name}")
        elif field.required:
            raise BadRequestError(f"{op}: missing argument {field.name!r}")
        else:
            parsed[field.name] = field.default
    unknown = sorted(set(args) - {f.name for f in schema})
    if unknown:
        raise BadRequestError(f"{op}: unknown argument(s) {unknown}")
    return parsed


def outcome(parse: Any, op: str, args: dict[str, Any], schema: tuple[Field, ...]) -> Any:
    try:
        return ("ok", parse(op, args, schema))
    except BadRequestError as exc:
        return ("error", str(exc))


def cases(schema: tuple[Field, ...]) -> list[dict[str, Any]]:
    """Arguments for ``schema``: each value in each field with the others absent or given a
    value their check takes, every required field left out in turn, and an unknown field."""
    good: dict[str, Any] = {}
    for field in schema:
        for value in VALUES:
            try:
                field.check(value, field.name)
            except BadRequestError:
                continue
            good[field.name] = value
            break
    found: list[dict[str, Any]] = [dict(good), {}, {**good, "bogus": 1}]
    for field, value in itertools.product(schema, VALUES):
        found.append({field.name: value})
        found.append({**good, field.name: value})
        found.append({**good, field.name: value, "bogus": 1})
    for field in schema:
        if field.required:
            found.append({k: v for k, v in good.items() if k != field.name})
            found.append({**{k: v for k, v in good.items() if k != field.name}, "zzz": 1})
    # The given order must not matter: the same fields listed the other way round.
    found += [dict(reversed(list(args.items()))) for args in list(found)]
    return found


@pytest.mark.parametrize(
    ("op", "schema"), sorted([*WORKER_ARGS.items(), *ADMIN_ARGS.items()], key=lambda e: e[0])
)
def test_parse_args_answers_as_a_field_by_field_check(op: str, schema: tuple[Field, ...]) -> None:
    for args in cases(schema):
        for _ in range(2):  # the first request of an op makes its kept steps, the next reuses them
            assert outcome(parse_args, op, args, schema) == outcome(
                field_by_field, op, args, schema
            ), args
