"""Field selectors as the Kubernetes API server reads them, for the API double (tests/fakes/apiserver.py).

A selector is comma-separated terms that must all hold, each `field=value`, `field==value` or `field!=value`
(k8s.io/apimachinery/pkg/fields/selector.go); a field the kind does not support is 400 BadRequest. Values are
compared as strings, booleans as true/false. Escaped commas and equal signs are not handled: the agent's
selectors carry object names, which cannot contain them.
"""

from __future__ import annotations

from typing import Any

# Fields the API server lets a field selector name, per kind: every kind has metadata.name and metadata.namespace
# (https://kubernetes.io/docs/concepts/overview/working-with-objects/field-selectors/, "List of supported fields")
SELECTABLE: dict[str, dict[str, tuple[str, ...]]] = {
    "Pod": {"metadata.name": ("metadata", "name"), "metadata.namespace": ("metadata", "namespace"),
            "spec.nodeName": ("spec", "nodeName"), "spec.restartPolicy": ("spec", "restartPolicy"),
            "spec.schedulerName": ("spec", "schedulerName"),
            "spec.serviceAccountName": ("spec", "serviceAccountName"), "spec.hostNetwork": ("spec", "hostNetwork"),
            "status.phase": ("status", "phase"), "status.podIP": ("status", "podIP"),
            "status.nominatedNodeName": ("status", "nominatedNodeName")},
    "Node": {"metadata.name": ("metadata", "name"), "metadata.namespace": ("metadata", "namespace"),
             "spec.unschedulable": ("spec", "unschedulable")},
}


class SelectorError(ValueError):
    """A field selector the API server would answer 400 BadRequest."""


def field_selector(selector: str, kind: str) -> list[tuple[str, bool, str]]:
    """(field, equal, value) terms of a field selector, all of which must hold; `SelectorError` for a field the
    kind does not support or a term without an operator (k8s.io/apimachinery/pkg/fields/selector.go splits on
    unescaped commas and takes `!=`, `==` or `=`; escaped values are not needed by the agent's names)."""
    terms: list[tuple[str, bool, str]] = []
    for term in filter(None, selector.split(",")):
        for op in ("!=", "==", "="):
            field_name, found, value = term.partition(op)
            if found:
                break
        else:
            raise SelectorError(f"invalid selector: {term!r}; can't understand {term!r}")
        if field_name not in SELECTABLE[kind]:
            known = ", ".join(f'"{f}"' for f in SELECTABLE[kind])
            raise SelectorError(f'"{field_name}" is not a known field selector: only {known}')
        terms.append((field_name, op != "!=", value))
    return terms


def field_value(obj: dict[str, Any], kind: str, field_name: str) -> str:
    """The field as a selector compares it: a string, booleans as true/false, absent as ""."""
    value: Any = obj
    for part in SELECTABLE[kind][field_name]:
        value = value.get(part) if isinstance(value, dict) else None
    if isinstance(value, bool):
        return "true" if value else "false"
    return "" if value is None else str(value)
