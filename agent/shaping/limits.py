"""A pod's internet limits: its annotations, else its namespace's default, per direction.

Values are quantities in bits per second (`agent.config.shaping.parse_bandwidth`). Each direction stands
alone: an invalid annotation leaves that direction unshaped (and is reported); it never falls back to the
default, which would silently apply a limit the pod's owner tried to change. A value is refused in bounded
time whatever its text (`1e999999` is refused by its exponent, before any arithmetic).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from agent.config.fields import PROJECT_DOMAIN
from agent.config.shaping import DIRECTIONS, Limits, parse_bandwidth

EGRESS_ANNOTATION = f"{PROJECT_DOMAIN}/internet-egress-bandwidth"
INGRESS_ANNOTATION = f"{PROJECT_DOMAIN}/internet-ingress-bandwidth"
ANNOTATIONS = {"egress": EGRESS_ANNOTATION, "ingress": INGRESS_ANNOTATION}


@dataclass(frozen=True)
class Problem:
    """An annotation whose value cannot be used (that direction runs unshaped)."""

    direction: str
    annotation: str
    value: str
    reason: str


def resolve(namespace: str, annotations: Mapping[str, str],
            defaults: Mapping[str, Limits]) -> tuple[Limits, tuple[Problem, ...]]:
    """The pod's limits: per direction its annotation if present (invalid: unshaped + a Problem), else the
    namespace default."""
    base = defaults.get(namespace, Limits())
    values: dict[str, int | None] = {}
    problems: list[Problem] = []
    for direction in DIRECTIONS:
        key = ANNOTATIONS[direction]
        if key not in annotations:
            values[direction] = base.get(direction)
            continue
        try:
            values[direction] = parse_bandwidth(annotations[key])
        except (ValueError, ArithmeticError, TypeError) as exc:  # this pod's value only; never the whole sync
            values[direction] = None
            problems.append(Problem(direction, key, str(annotations[key])[:64], str(exc)))
    return Limits(**values), tuple(problems)
