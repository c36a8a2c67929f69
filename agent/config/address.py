"""Listen addresses as the config writes them (`:9400`, `127.0.0.1:0`, `[::1]:9400`).

Parsed here, where the config is checked at load, so a bad address is exit 2 before anything binds; the
metrics server takes the parsed form.
"""

from __future__ import annotations


def parse_address(address: str) -> tuple[str, int]:
    """`:9400` -> ("", 9400) meaning every address; `127.0.0.1:0`; `[::1]:9400`. ValueError names the input."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"not a host:port address: {address!r}")
    return host.strip("[]"), int(port)
