"""A Host twin that runs nothing: it serves empty saves and records what would have been applied."""

from __future__ import annotations

from collections.abc import Iterable

from agent.host.netfilter import CommandError, Host, Snapshot


class _NoTable:
    """The nftables reader of a namespace without netacct's table."""

    def sets(self) -> None:
        """No table."""
        return None

    def close(self) -> None:
        """Nothing to release."""


class FakeHost(Host):
    """The iptables layout's twin: fails the first `failures` reads (and cleanups), then reports an empty
    namespace; it has no `nft` and no bpf(2), so `layout: auto` falls back to iptables on it."""

    def __init__(self, failures: int = 0, mode: str = "nft") -> None:
        super().__init__(netns=None)
        self.failures = failures
        self.fixed_mode = mode
        self.restores: list[tuple[str, int, str]] = []
        self.ipset_payloads: list[str] = []
        self.reads = 0
        self.nft_reader = _NoTable()  # type: ignore[assignment]

    def nft_usable(self) -> str | None:
        """A simulated host has no nft."""
        return "nft is not installed (simulated host)"

    def bpf_usable(self) -> str | None:
        """A simulated host has no bpf(2) to probe (its kernel is the test machine's)."""
        return "no bpf(2) on a simulated host"

    def detect_mode(self, families: Iterable[int] = (4, 6)) -> str:
        """The configured answer."""
        return self.fixed_mode

    def snapshot(self, mode: str, families: Iterable[int], set_names: Iterable[str]) -> Snapshot:
        """Empty mangle tables and no sets, after the planned failures."""
        self.reads += 1
        if self.failures > 0:  # as the real Host does: the read pass reports errors instead of raising
            self.failures -= 1
            return Snapshot({}, {}, ("iptables-nft-save exited 4: Resource temporarily unavailable",))
        return Snapshot({family: "*mangle\nCOMMIT\n" for family in families}, dict.fromkeys(set_names))

    def restore(self, mode: str, family: int, payload: str, counters: bool = False) -> None:
        """Record (a payload with counters is recorded the same way)."""
        self.restores.append((mode, family, payload))

    def ipset_restore(self, payload: str) -> None:
        """Record."""
        if payload:
            self.ipset_payloads.append(payload)

    def save_full(self, mode: str, family: int, counters: bool = False) -> str:
        """Nothing installed, or a failure while failures remain."""
        if self.failures > 0:
            raise CommandError(f"iptables-{mode}-save is not installed")
        return ""

    def ipset_names(self) -> set[str]:
        """No sets; fails while failures remain."""
        if self.failures > 0:
            raise CommandError("ipset is not installed (Debian/Ubuntu package: ipset)")
        return set()
