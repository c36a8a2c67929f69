"""Re-run the hostile inputs of issue 27 that reach the agent through its command line and its annotation parser,
and print a table: input, expected, seen (exit code or refusal), seconds.

Each config-level try is a `gpu-node-agent config|run` process of its own (as an operator's bad file would be);
the annotation tries call the one quantity parser the shaping resolver uses, timed on this process's CPU.

    python bench/hostile_tries.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.config.shaping import parse_bandwidth

_LAUGHS = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi", strict=True))


def _sriov(resources: object) -> bytes:
    return json.dumps({"resourceList": resources}).encode()


FILES: list[tuple[str, str, str, bytes]] = [
    # (what, command, flag, file content)
    ("namespaceDefaults egress 1e999999", "config", "--config",
     b"shaping: {namespaceDefaults: {team: {egress: '1e999999'}}}\n"),
    ("namespaceDefaults egress 1e9999999", "run", "--config",
     b"shaping: {namespaceDefaults: {team: {egress: '1e9999999'}}}\n"),
    ("YAML alias bomb (9^9 values)", "config", "--config", _LAUGHS.encode()),
    ("YAML alias bomb (9^9 values)", "run", "--config", _LAUGHS.encode()),
    ("SR-IOV file 100,000 deep", "run", "--sriov-dp-config", b"[" * 100_000 + b"]" * 100_000),
    ("SR-IOV file non-UTF-8", "config", "--sriov-dp-config", b'{"resourceList": [{"resourceName": "caf\xe9"}]}'),
    ("SR-IOV file 100,000-digit number", "config", "--sriov-dp-config", b'{"resourceList": [], "x": '
     + b"9" * 100_000 + b"}"),
    ("SR-IOV file over 1 MiB", "run", "--sriov-dp-config", b" " * ((1 << 20) + 1)),
    ("SR-IOV VF range #5-2", "config", "--sriov-dp-config", _sriov([{"resourceName": "a",
                                                                    "selectors": {"pfNames": ["ens1f0#5-2"]}}])),
]
FLAGS = [("--rescan-interval=1e-9",), ("--link-check-interval=1e-300",),
         ("--reboot-sentinel=/etc/passwd",)]
ANNOTATIONS = ["1e999999", "1e9999999", "1E+999999999", "9" * 60 + "e99"]


def _run(*args: str) -> tuple[str, float]:
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-m", "agent", *args], capture_output=True, text=True, timeout=120,
                              check=False)
    except subprocess.TimeoutExpired:
        return "no answer in 120 s", time.monotonic() - started
    last = done.stderr.strip().splitlines()[-1:] or [""]
    tb = " TRACEBACK" if "Traceback" in done.stderr else ""
    return f"exit {done.returncode}{tb}: {last[0][:90]}", time.monotonic() - started


def main() -> None:
    rows: list[tuple[str, str, str, float]] = []
    with tempfile.TemporaryDirectory(prefix="gna-hostile-") as tmp:
        for index, (what, command, flag, content) in enumerate(FILES):
            path = Path(tmp) / f"input-{index}"
            path.write_bytes(content)
            seen, took = _run(command, flag, str(path))
            rows.append((f"{command}: {what}", "exit 2, one line", seen, took))
        for args in FLAGS:
            seen, took = _run("config", *args)
            rows.append((f"config {' '.join(args)}", "exit 2, one line", seen, took))
    for text in ANNOTATIONS:
        started = time.process_time()
        try:
            parse_bandwidth(text)
            seen = "accepted"
        except ValueError as exc:
            seen = f"refused: {str(exc)[:90]}"
        rows.append((f"annotation internet-egress-bandwidth {text[:20]!r}", "refused at once", seen,
                     time.process_time() - started))
    rows.extend(_netacct_rows())
    print("| input | expected | seen | seconds |")
    print("|---|---|---|---|")
    for what, expected, seen, took in rows:
        print(f"| {what} | {expected} | {seen.replace('|', '/')} | {took:.3f} |")


def _netacct_rows() -> list[tuple[str, str, str, float]]:
    """Issue 37 items 3 and 5, network accounting: real packets in throw-away network namespaces (root; about
    90 s), from bench/netacct_hostile.py (run alone there)."""
    from bench.netacct_hostile import netacct_rows

    return netacct_rows()


if __name__ == "__main__":
    main()
