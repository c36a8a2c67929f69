"""Parsing a config document (YAML, or JSON) without letting a hostile one exhaust memory, time or the stack.

A YAML document is composed, then checked before anything is constructed: its aliases expanded (at most
`MAX_NODES` values: a "billion laughs" file is refused in time proportional to its own size) and its depth (at
most `MAX_DEPTH`). Integers have at most `numbers.MAX_DIGITS` digits; JSON has no NaN/Infinity. The reader of the
file (`agent.config.load.read_file`) bounds its size and turns each refusal into a `ConfigError`.
"""

from __future__ import annotations

import json
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from agent.config.numbers import MAX_DIGITS, NumberError, bounded_float, bounded_int, no_constant, shown

MAX_DEPTH = 16  # the deepest real setting is 7 levels down (devicePlugin.pools[i].selectors.pfNames[j])
MAX_NODES = 100_000  # values in a config file once YAML aliases are expanded; a real config has a few hundred


class Refused(Exception):
    """Raised while parsing: the document is larger or deeper than any config (the message says which)."""


def _children(node: Node) -> list[Node]:
    if isinstance(node, SequenceNode):
        return list(node.value)
    if isinstance(node, MappingNode):
        return [item for pair in node.value for item in pair]
    return []


def _check_expanded(root: Node) -> None:
    """Refuse a composed document whose aliases expand past MAX_NODES values or MAX_DEPTH levels (or refer to
    themselves), before anything is constructed: counted once per distinct node, so a "billion laughs" file is
    refused in time proportional to its own size, not to its expansion. Iterative: no input exhausts the stack."""
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    open_: set[int] = set()
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            kids = _children(node)
            size[key] = 1 + sum(size[id(kid)] for kid in kids)
            depth[key] = 1 + max((depth[id(kid)] for kid in kids), default=0)
            open_.discard(key)
            if size[key] > MAX_NODES:
                raise Refused(f"expands to more than {MAX_NODES} values (YAML aliases)")
            if depth[key] > MAX_DEPTH:
                raise Refused(f"nested more deeply than any config ({MAX_DEPTH} levels)")
            continue
        if key in size:
            continue
        if key in open_:
            raise Refused("a YAML alias refers to a value that contains it")
        open_.add(key)
        stack.append((node, True))
        stack.extend((kid, False) for kid in _children(node))


class _BoundedLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that checks the composed document (aliases expanded, depth) before constructing it, and
    reads integers of at most `numbers.MAX_DIGITS` digits."""

    def compose_document(self) -> Node | None:
        node: Node | None = super().compose_document()  # type: ignore[no-untyped-call]
        if node is not None:
            _check_expanded(node)
        return node

    def construct_yaml_int(self, node: ScalarNode) -> int:
        text = str(node.value).replace("_", "").lstrip("+-")
        if len(text) > MAX_DIGITS:
            raise NumberError(f"{shown(node.value)}: an integer of {len(text)} digits is larger than any setting "
                              f"(at most {MAX_DIGITS} digits)")
        value: int = super().construct_yaml_int(node)  # type: ignore[no-untyped-call]
        return value


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _BoundedLoader.construct_yaml_int)


def parse(text: str, kind: str) -> Any:
    """Parse a config document's text as `kind` ("JSON" or "YAML"), refusing what no config is: `Refused` (too
    large or deep once aliases expand), `numbers.NumberError` (too many digits, NaN/Infinity in JSON), or the
    parser's own error."""
    if kind == "JSON":
        return json.loads(text, parse_int=bounded_int, parse_float=bounded_float, parse_constant=no_constant)
    return yaml.load(text, Loader=_BoundedLoader)  # noqa: S506 - a SafeLoader subclass



def nesting_depth(data: Any) -> int:
    """Nesting depth of parsed data (counted up to MAX_DEPTH + 1), without recursion (so no input can exhaust the
    stack here)."""
    deepest, stack = 0, [(data, 1)]
    while stack:
        item, level = stack.pop()
        deepest = max(deepest, level)
        if level > MAX_DEPTH:
            break
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        stack.extend((child, level + 1) for child in children)
    return deepest
