"""The one way a name enters an API request path.

lightkube joins a request path from the names it is given without escaping them, so a node name of
`gpu-0/../gpu-1` addressed another node. Every name the agent puts in a path goes through `url_segment`: it must
be a valid object name (`agent.config.names`) and is then percent-escaped, which for a valid name changes
nothing but leaves no way to smuggle a path through.
"""

from __future__ import annotations

from urllib.parse import quote

from agent.config.names import check_node_name, is_label, is_subdomain

__all__ = ["check_node_name", "url_segment"]


def url_segment(name: str, *, namespace: bool = False) -> str:
    """`name` escaped for one URL path segment; ValueError when it is not a valid object (or namespace) name."""
    if not (is_label(name) if namespace else is_subdomain(name)):
        raise ValueError(f"{'namespace' if namespace else 'object name'} {name[:80]!r} is not a valid Kubernetes "
                         f"name; refusing to put it in a request path")
    return quote(name, safe="")
