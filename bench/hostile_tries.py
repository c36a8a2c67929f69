"""Re-run the hostile inputs of issue 27 that reach the agent through its command line and its annotation parser,
and print a table: input, expected, seen (exit code or refusal), seconds.

Each config-level try is a `gpu-node-agent config|run` process of its own (as an operator's bad file would be);
the annotation tries call the one quantity parser the shaping resolver uses, timed on this process's CPU.

    python bench/hostile_tries.py
"""

from __future__ import annotations

import json
import os
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
        rows.extend(round3_rows(Path(tmp)))
    for text in ANNOTATIONS:
        started = time.process_time()
        try:
            parse_bandwidth(text)
            seen = "accepted"
        except ValueError as exc:
            seen = f"refused: {str(exc)[:90]}"
        rows.append((f"annotation internet-egress-bandwidth {text[:20]!r}", "refused at once", seen,
                     time.process_time() - started))
    print("| input | expected | seen | seconds |")
    print("|---|---|---|---|")
    for what, expected, seen, took in rows:
        print(f"| {what} | {expected} | {seen.replace('|', '/')} | {took:.3f} |")


# --- issue 37 (items 2 and 5): resource-name collisions, non-regular config files, kubelet socket paths, interval
# floors. Self-contained: its own helper and rows, added to the table by one call in main().
ROUND3_FIFO_FLAGS = ["--config", "--nvidia-dp-config", "--sriov-dp-config", "--pods-file"]
ROUND3_KUBELET_SOCKETS = ["kubelet.sock", "/", "/kubelet.sock"]


def _run_round3(args: list[str], env: dict[str, str] | None = None, timeout: float = 30) -> tuple[str, float]:
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-m", "agent", *args], capture_output=True, text=True,
                              timeout=timeout, check=False, env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired:
        return f"no answer in {timeout:.0f} s", time.monotonic() - started
    last = done.stderr.strip().splitlines()[-1:] or [""]
    tb = " TRACEBACK" if "Traceback" in done.stderr else ""
    return f"exit {done.returncode}{tb}: {last[0][:90]}", time.monotonic() - started


def _rescans_per_second(tmp: Path) -> tuple[str, float]:
    """`run --rescan-interval 0.01` plus 30 SIGHUPs in 1.5 s: rescans counted by the agent over 3 s."""
    import re
    import signal
    import socket
    import urllib.request

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "agent", "run", "--simulate", "dgx-h100", "--kmsg", "",
                                "--device-plugin-dir", str(tmp), "--metrics-address", f"127.0.0.1:{port}",
                                "--rescan-interval", "0.01"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def count() -> float | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                match = re.search(r"^gpu_node_agent_hardware_rescans_total (\S+)$", response.read().decode(), re.M)
        except OSError:
            return None
        return float(match.group(1)) if match else None

    try:
        deadline = time.monotonic() + 60
        while (first := count()) is None:
            if time.monotonic() > deadline:
                return "no gpu_node_agent_hardware_rescans_total", 0.0
            time.sleep(0.2)
        started = time.monotonic()
        for _ in range(30):
            process.send_signal(signal.SIGHUP)
            time.sleep(0.05)
        time.sleep(max(0.0, 3.0 - (time.monotonic() - started)))
        took = time.monotonic() - started
        return f"{((count() or 0.0) - first) / took:.2f} rescans/s", took
    finally:
        process.terminate()
        process.wait(timeout=30)


def round3_rows(tmp: Path) -> list[tuple[str, str, str, float]]:
    """Rows of issue 37's config-side inputs (each a process of its own, as an operator's input would be)."""
    rows: list[tuple[str, str, str, float]] = []
    sriov = tmp / "r3-sriov-gpu.json"
    sriov.write_bytes(_sriov([{"resourceName": "gpu", "resourcePrefix": "nvidia.com",
                               "selectors": {"isRdma": True}}]))
    for command in ("config", "run"):
        seen, took = _run_round3([command, "--simulate", "dgx-h100", "--sriov-dp-config", str(sriov),
                                  "--device-plugin-dir", str(tmp), "--metrics-address", "127.0.0.1:0"])
        rows.append((f"{command}: SR-IOV pool nvidia.com/gpu beside served GPUs", "exit 2, one line (run < 10 s)",
                     seen, took))
    for index, flag in enumerate(ROUND3_FIFO_FLAGS):
        fifo = tmp / f"r3-{index}.fifo"
        os.mkfifo(fifo)
        for command in ("config", "run", "doctor"):
            seen, took = _run_round3([command, "--simulate", "dgx-h100", flag, str(fifo), "--device-plugin-dir",
                                      str(tmp), "--metrics-address", "127.0.0.1:0"])
            rows.append((f"{command}: a FIFO as {flag}", "exit 2 naming it, < 3 s", seen, took))
    for value in ROUND3_KUBELET_SOCKETS:
        for command in ("config", "run"):
            seen, took = _run_round3([command, "--simulate", "dgx-h100", "--metrics-address", "127.0.0.1:0"],
                                     env={"KUBELET_SOCKET": value})
            rows.append((f"{command}: KUBELET_SOCKET={value}", "exit 2, one line", seen, took))
    seen, took = _run_round3(["config", "--rescan-interval", "0.01"])
    rows.append(("config --rescan-interval 0.01", "raised to 1 s, a warning", seen, took))
    seen, took = _rescans_per_second(tmp)
    rows.append(("run --rescan-interval 0.01, 30 SIGHUPs", "at most 1 rescan/s", seen, took))
    return rows


if __name__ == "__main__":
    main()
