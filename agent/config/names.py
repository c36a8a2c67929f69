"""Kubernetes object names as the API server accepts them (RFC 1123), for the config and the API port alike.

A node name is a subdomain: at most 253 characters of lower-case letters, digits, `-` and `.`, starting and
ending alphanumeric; a namespace is a label of at most 63 without dots. The config refuses a node name that is
not one (exit 2); `agent.kube.names.url_segment` refuses any such name before it reaches a request path.
"""

from __future__ import annotations

import re

_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def is_subdomain(name: str) -> bool:
    """A valid RFC 1123 subdomain (node, pod, lease and event names)."""
    return len(name) <= 253 and _SUBDOMAIN.fullmatch(name) is not None


def is_label(name: str) -> bool:
    """A valid RFC 1123 label (namespace names)."""
    return len(name) <= 63 and _LABEL.fullmatch(name) is not None


def check_node_name(name: str) -> str:
    """The name when it is a valid Kubernetes node name; ValueError saying why otherwise."""
    if not is_subdomain(name):
        raise ValueError(f"{name!r} is not a valid Kubernetes node name (lower-case letters, digits, '-' and '.', "
                         f"at most 253, starting and ending with a letter or digit)")
    return name
