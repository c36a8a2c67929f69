"""The migration's step 2 as a JSON patch: keep an old device plugin's DaemonSet off the nodes that switch.

A merge patch of `affinity` replaces the whole object: on a Helm-installed NVIDIA plugin the chart's three
GPU-node terms became one `NotIn` term, and the old plugin spread to every unlabelled node, CPU-only ones
included. Node-selector terms are ORed and the expressions of one term ANDed, so the exclusion must be *added to
every existing term*; where the DaemonSet has no required node affinity yet, one term with the exclusion alone
says the same. The patch is computed from the live object (`kubectl get -o json`) and only adds: every original
term and expression stays as it was.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

DROPIN_LABEL = "gpunodeagent.io/drop-in"
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
_LABEL_KEY = re.compile(rf"^(?:{_DNS_LABEL}(?:\.{_DNS_LABEL})*/)?[A-Za-z0-9](?:[-A-Za-z0-9_.]{{0,61}}[A-Za-z0-9])?$")
_REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"


class DropinPatchError(ValueError):
    """The input is not a DaemonSet the patch can be computed for."""


def is_label_key(key: str) -> bool:
    """A Kubernetes label key: an optional DNS-subdomain prefix and a name of at most 63 characters."""
    prefix, _, _name = key.rpartition("/")
    return len(prefix) <= 253 and _LABEL_KEY.match(key) is not None


def exclusion(label: str = DROPIN_LABEL) -> dict[str, Any]:
    """The expression that keeps a pod off nodes labelled `<label>=true`."""
    return {"key": label, "operator": "NotIn", "values": ["true"]}


def _obj(parent: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any] | None:
    value = parent.get(key)
    if value is not None and not isinstance(value, Mapping):
        raise DropinPatchError(f"{where}/{key} is not an object")
    return value


def exclusion_patch(daemonset: Mapping[str, Any], label: str = DROPIN_LABEL) -> list[dict[str, Any]]:
    """JSON patch (RFC 6902) operations that add the exclusion to each node-selector term of `daemonset`'s pod
    template (or create the required node affinity with it); [] when every term already has it."""
    if not isinstance(daemonset, Mapping) or daemonset.get("kind") != "DaemonSet":
        raise DropinPatchError("expected a DaemonSet object (kubectl get daemonset NAME -o json)")
    expression = exclusion(label)
    spec = _obj(daemonset, "spec", "")
    template = _obj(spec or {}, "template", "/spec")
    pod = _obj(template or {}, "spec", "/spec/template")
    if pod is None:
        raise DropinPatchError("the DaemonSet has no /spec/template/spec")
    base = "/spec/template/spec"
    affinity = _obj(pod, "affinity", base)
    if affinity is None:
        return [{"op": "add", "path": f"{base}/affinity",
                 "value": {"nodeAffinity": {_REQUIRED: {"nodeSelectorTerms": [{"matchExpressions": [expression]}]}}}}]
    node = _obj(affinity, "nodeAffinity", f"{base}/affinity")
    if node is None:
        return [{"op": "add", "path": f"{base}/affinity/nodeAffinity",
                 "value": {_REQUIRED: {"nodeSelectorTerms": [{"matchExpressions": [expression]}]}}}]
    at = f"{base}/affinity/nodeAffinity/{_REQUIRED}"
    required = _obj(node, _REQUIRED, f"{base}/affinity/nodeAffinity")
    terms = required.get("nodeSelectorTerms") if required is not None else None
    if not terms:  # none: the exclusion alone (an empty term list would match no node at all)
        return [{"op": "add", "path": at, "value": {"nodeSelectorTerms": [{"matchExpressions": [expression]}]}}]
    if not isinstance(terms, list):
        raise DropinPatchError(f"{at}/nodeSelectorTerms is not a list")
    ops: list[dict[str, Any]] = []
    for index, term in enumerate(terms):
        if not isinstance(term, Mapping):
            raise DropinPatchError(f"{at}/nodeSelectorTerms/{index} is not an object")
        expressions = term.get("matchExpressions")
        if expressions is None:
            ops.append({"op": "add", "path": f"{at}/nodeSelectorTerms/{index}/matchExpressions",
                        "value": [expression]})
        elif not isinstance(expressions, list):
            raise DropinPatchError(f"{at}/nodeSelectorTerms/{index}/matchExpressions is not a list")
        elif expression not in expressions:
            ops.append({"op": "add", "path": f"{at}/nodeSelectorTerms/{index}/matchExpressions/-",
                        "value": expression})
    return ops
