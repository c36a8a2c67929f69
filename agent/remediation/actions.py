"""Writes to the own Node: guarded patches and the agent's NodeCondition, with dry-run kept in memory.

`NodeActions` holds the node as last seen (from GET, the watch, or a patch response) and is the only writer of
the Node. Patches carry the seen resourceVersion; a 409 re-reads the node and raises, so the engine re-decides
from the fresh state rather than overwrite an admin's concurrent change. The condition follows the
node-problem-detector convention (True = problem) and is patched only when it changes or its heartbeat (at
least 5 minutes) is due, which is the agent's whole steady-state write load. With `dry_run` every write is
applied to an in-memory overlay instead, so decisions are not repeated and nothing changes on the cluster.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from agent.clock import Clock
from agent.kube.errors import ApiConflict, ApiError
from agent.kube.model import Condition, NodeView, apply_patch, with_condition, without_condition
from agent.kube.port import NodeApi
from agent.remediation.metrics import ActionCounter
from agent.remediation.state import compose

log = logging.getLogger(__name__)

PatchBuilder = Callable[[NodeView], dict[str, Any] | None]


class NodeActions:
    """The single writer of the Node object."""

    def __init__(self, api: NodeApi, clock: Clock, actions: ActionCounter, *, condition_type: str,
                 heartbeat_seconds: float = 300.0, dry_run: bool = False) -> None:
        self._api = api
        self._clock = clock
        self._actions = actions
        self.condition_type = condition_type
        self._heartbeat = heartbeat_seconds
        self.dry_run = dry_run
        self._overlay: dict[str, Any] = {}
        self._overlay_conditions: dict[str, Condition] = {}
        self._node: NodeView | None = None

    @property
    def node(self) -> NodeView:
        """The node as last seen (with dry-run changes applied)."""
        if self._node is None:
            raise RuntimeError("node not read yet; call refresh() first")
        return self._node

    @property
    def known(self) -> bool:
        """A node has been read."""
        return self._node is not None

    def observe(self, node: NodeView) -> None:
        """Take a newer view of the node (from the watch or a response)."""
        if self.dry_run:
            node = apply_patch(node, self._overlay)
            for overlay in self._overlay_conditions.values():
                node = with_condition(node, overlay)
        self._node = node

    async def refresh(self) -> NodeView:
        """GET the node."""
        self.observe(await self._api.get_node())
        return self.node

    async def apply(self, action: str, build: PatchBuilder) -> bool:
        """Patch the node with what `build` computes from it; False when it computes nothing to do.

        Raises ApiConflict (after re-reading the node) when the node changed since it was seen.
        """
        node = self.node
        patch = build(node)
        if not patch:
            return False
        if self.dry_run:
            self._overlay = compose(self._overlay, patch)
            self._node = apply_patch(node, patch)
            self._actions.count(action, "dry_run")
            log.info("dry-run: would %s node %s: %s", action, node.name, patch)
            return True
        try:
            updated = await self._api.patch_node(patch, node.resource_version)
        except ApiConflict:
            self._actions.count(action, "conflict")
            await self.refresh()
            raise
        except ApiError:
            self._actions.count(action, "failed")
            raise
        self.observe(updated)
        self._actions.count(action, "ok")
        log.info("%s node %s", action, node.name, extra={"action": action})
        return True

    async def remove_condition(self, condition_type: str) -> bool:
        """Remove a condition the agent no longer manages; True when there was one to remove."""
        if condition_type not in self.node.conditions:
            return False
        if self.dry_run:
            self._overlay_conditions.pop(condition_type, None)
            self._node = without_condition(self.node, condition_type)
            self._actions.count("condition_removed", "dry_run")
            log.info("dry-run: would remove condition %s", condition_type)
            return True
        try:
            self.observe(await self._api.remove_node_condition(condition_type))
        except ApiError:
            self._actions.count("condition_removed", "failed")
            raise
        self._actions.count("condition_removed", "ok")
        log.info("removed condition %s, which this configuration no longer sets", condition_type)
        return True

    def condition(self, condition_type: str = "") -> Condition | None:
        """The agent's condition (or its other one, `condition_type`) as it is on the node."""
        return self.node.conditions.get(condition_type or self.condition_type)

    def heartbeat_due_at(self, condition_type: str = "") -> float | None:
        """When the condition's heartbeat is next due; None if there is no condition yet."""
        current = self.condition(condition_type)
        if current is None or current.last_heartbeat is None:
            return None
        return current.last_heartbeat + self._heartbeat

    def condition_differs(self, problem: bool, reason: str, message: str, condition_type: str = "") -> bool:
        """Whether setting this condition would change it (status, reason or message), not only beat its heart."""
        current = self.condition(condition_type or self.condition_type)
        status = "True" if problem else "False"
        return current is None or (current.status, current.reason, current.message) != (status, reason, message)

    async def ensure_condition(self, problem: bool, reason: str, message: str, condition_type: str = "",
                               annotations: Mapping[str, str | None] | None = None) -> bool:
        """Set the condition (default: the agent's main one) if it differs or its heartbeat is due; True when a
        patch was (or would be) made. `lastTransitionTime` moves only when the status flips. `annotations` go in
        the same nodes/status write, and only in a write that changes the condition (never a heartbeat's)."""
        kind = condition_type or self.condition_type
        now = self._clock.now()
        status = "True" if problem else "False"
        current = self.condition(kind)
        changed = self.condition_differs(problem, reason, message, kind)
        due = self.heartbeat_due_at(kind)
        if not changed and due is not None and now < due:
            return False
        flipped = current is None or current.status != status
        transition = now if flipped or current is None or current.last_transition is None \
            else current.last_transition
        condition = Condition(kind, status, reason, message, now, transition)
        action = "condition" if changed else "heartbeat"
        extra = dict(annotations) if changed and annotations else None
        if self.dry_run:
            if changed:
                if extra:
                    patch = {"metadata": {"annotations": extra}}
                    self._overlay = compose(self._overlay, patch)
                    self._node = apply_patch(self.node, patch)
                self._overlay_conditions[kind] = condition
                self._node = with_condition(self.node, condition)
                self._actions.count(action, "dry_run")
                log.info("dry-run: would set condition %s=%s (%s: %s)", kind, status, reason, message)
            else:  # nothing is sent in dry-run; just move the local heartbeat on
                self._overlay_conditions[kind] = condition
                self._node = with_condition(self.node, condition)
            return changed
        try:
            self.observe(await self._api.patch_node_condition(condition, extra))
        except ApiError:
            self._actions.count(action, "failed")
            raise
        self._actions.count(action, "ok")
        if changed:
            log.info("condition %s=%s (%s: %s)", kind, status, reason, message)
        return True
