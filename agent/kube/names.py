"""Kubernetes object names as the API server accepts them, and the one way a name enters a URL path.

lightkube joins a request path from the names it is given without escaping them, so a node name of
`gpu-0/../gpu-1` addressed another node. Every name the agent puts in a path goes through `url_segment`: it must
be a valid object name (RFC 1123 subdomain: at most 253 characters of lower-case letters, digits, `-` and `.`,
starting and ending alphanumeric; namespaces are RFC 1123 labels of at most 63 without dots) and is then
percent-escaped, which for a valid name changes nothing but leaves no way to smuggle a path through.
"""

from __future__ import annotations

import re
from urllib.parse import quote

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


def url_segment(name: str, *, namespace: bool = False) -> str:
    """`name` escaped for one URL path segment; ValueError when it is not a valid object (or namespace) name."""
    if not (is_label(name) if namespace else is_subdomain(name)):
        raise ValueError(f"{'namespace' if namespace else 'object name'} {name[:80]!r} is not a valid Kubernetes "
                         f"name; refusing to put it in a request path")
    return quote(name, safe="")
