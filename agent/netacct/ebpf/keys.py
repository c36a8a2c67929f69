"""The layout's map keys and values: the node series array's indexes and the pods hash's keys (shared by the
program builder, the objects and the readers).

- `node`: a per-CPU array of 16 (packets, bytes) slots, one per family x node series (`NODE_KEYS`, the iptables
  layout's rule keys);
- `pods`: a per-CPU hash keyed by a pod address (16 bytes, IPv4 in the first 4, the rest zero) and a u32 naming
  the counted role (ROLES position) and family (bit 2).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from agent.netacct import ipsets

NODE_KEYS = tuple(f"traffic={cls}-{way} scope={scope}" for cls in ("cluster", "internet") for way in ("in", "out")
                  for scope in ("host", "pod"))
NODE_SLOTS = 2 * len(NODE_KEYS)
VALUE_SIZE = 16  # u64 packets, u64 bytes
POD_KEY_SIZE = 20  # 16-byte address + u32 role
ROLES = ipsets.COUNTED  # rx-inet, tx-inet, rx-clus, tx-clus


def node_slot(family: int, key: str) -> int:
    """The `node` array index of a family's node series."""
    return (0 if family == 4 else len(NODE_KEYS)) + NODE_KEYS.index(key)


def slot_key(slot: int) -> tuple[int, str]:
    """(family, node series key) of an array index."""
    return (4 if slot < len(NODE_KEYS) else 6), NODE_KEYS[slot % len(NODE_KEYS)]


def role_code(role: str, family: int) -> int:
    """The u32 after a pod key's address."""
    return ROLES.index(role) | (4 if family == 6 else 0)


def pod_key(address: bytes, role: str) -> bytes:
    """The `pods` map key of a packed address (4 or 16 bytes) and a counted role."""
    family = 4 if len(address) == 4 else 6
    return address.ljust(16, b"\0") + role_code(role, family).to_bytes(4, "little")


def parse_pod_key(key: bytes) -> tuple[bytes, str]:
    """(packed address, role) back from a `pods` key."""
    code = int.from_bytes(key[16:20], "little")
    family = 6 if code & 4 else 4
    return (key[:4] if family == 4 else key[:16]), ROLES[code & 3]


def node_counts(slots: Mapping[int, tuple[int, int]], families: Iterable[int]) -> dict[int, dict[str, tuple[int, int]]]:
    """Per family, the node series of the summed `node` array slots."""
    out: dict[int, dict[str, tuple[int, int]]] = {family: {} for family in families}
    for slot, value in slots.items():
        family, key = slot_key(slot)
        if family in out:
            out[family][key] = value
    return out
