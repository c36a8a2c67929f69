"""Steady-state footprint of `gpu-node-agent run --simulate dgx-h100`: resident memory and idle CPU.

Starts the agent as a real process (its own short device-plugin directory, so the built-in stand-in kubelet
registers the plugins there; metrics on a free loopback port), waits until /readyz answers 200, lets it settle
for `--seconds` in total, and measures CPU time over the last `--window` seconds with psutil (user + system of
the agent and any children, as a percentage of one core). RSS is read at the end. Goals (issue 8): RSS <= 64 MB
and idle CPU <= 0.5 % of one core. The DaemonSet's resource requests and limits in `deploy/daemonset.yaml` are
sized from these figures.

    python bench/footprint.py                 # 60 s, CPU over the last 20 s
    python bench/footprint.py --seconds 120 --window 60 --profile pcie-pairs
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil
from startup import stop  # run as a script, bench/ is on sys.path

RSS_GOAL_MB = 64.0
CPU_GOAL_PERCENT = 0.5
MB = 1_000_000
MIB = 1 << 20


@dataclass
class Footprint:
    """What one run measured."""

    profile: str
    seconds: float
    window: float
    ready_after: float
    rss_bytes: int
    uss_bytes: int | None
    cpu_percent: float
    threads: int


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _port_from_log(path: Path) -> int | None:
    """The bound port from the agent's JSON log line `serving /metrics, /healthz and /readyz on port N`."""
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            message = str(json.loads(line).get("msg", ""))
        except (json.JSONDecodeError, AttributeError):
            continue
        if message.startswith("serving /metrics") and " on port " in message:
            return int(message.rsplit(" ", 1)[1])
    return None


def _tree(process: psutil.Process) -> list[psutil.Process]:
    try:
        return [process, *process.children(recursive=True)]
    except psutil.NoSuchProcess:
        return [process]


def _cpu_seconds(processes: list[psutil.Process]) -> float:
    total = 0.0
    for proc in processes:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def measure(profile: str, seconds: float, window: float, start_timeout: float = 60.0) -> Footprint:
    """Run the agent for `seconds` and measure it; the agent is stopped (SIGTERM) and its files removed after."""
    if window <= 0 or window > seconds:
        raise ValueError(f"--window must be in (0, --seconds], got {window} with --seconds {seconds}")
    workdir = Path(tempfile.mkdtemp(prefix="gnafp"))  # short: unix socket paths are limited to 108 bytes
    plugin_dir = workdir / "dp"
    plugin_dir.mkdir()
    log_path = workdir / "agent.log"
    argv = [sys.executable, "-m", "agent", "run", "--simulate", profile, "--metrics-address", "127.0.0.1:0",
            "--device-plugin-dir", str(plugin_dir), "--state-dir", str(workdir / "state"), "--log-format", "json"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log_path.open("w", encoding="utf-8") as log_file:
        process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log_file, env=env)
    started = time.monotonic()
    try:
        agent = psutil.Process(process.pid)
        port = None
        while time.monotonic() - started < start_timeout:
            if process.poll() is not None:
                raise RuntimeError(f"agent exited with {process.returncode}; log:\n{log_path.read_text()}")
            port = port or _port_from_log(log_path)
            if port and _ready(port):
                break
            time.sleep(0.2)
        else:
            raise RuntimeError(f"agent not ready within {start_timeout:.0f}s; log:\n{log_path.read_text()}")
        ready_after = time.monotonic() - started
        settle = seconds - window - (time.monotonic() - started)
        if settle > 0:
            time.sleep(settle)
        tree = _tree(agent)
        cpu_before, t_before = _cpu_seconds(tree), time.monotonic()
        time.sleep(window)
        tree = _tree(agent)
        cpu_after, t_after = _cpu_seconds(tree), time.monotonic()
        if process.poll() is not None:
            raise RuntimeError(f"agent exited with {process.returncode} during the run")
        rss = sum(p.memory_info().rss for p in tree)
        try:
            uss: int | None = sum(p.memory_full_info().uss for p in tree)
        except (psutil.AccessDenied, AttributeError):
            uss = None
        return Footprint(profile=profile, seconds=t_after - started, window=t_after - t_before,
                         ready_after=ready_after, rss_bytes=rss, uss_bytes=uss,
                         cpu_percent=100.0 * (cpu_after - cpu_before) / (t_after - t_before),
                         threads=agent.num_threads())
    finally:
        stop(process)
        shutil.rmtree(workdir, ignore_errors=True)


def render(result: Footprint) -> str:
    """A small table with the goals."""
    rss_mb = result.rss_bytes / MB
    rows = [
        ("profile", result.profile, ""),
        ("ran for", f"{result.seconds:.0f} s (ready after {result.ready_after:.1f} s)", ""),
        ("RSS", f"{rss_mb:.1f} MB ({result.rss_bytes / MIB:.1f} MiB)",
         f"goal <= {RSS_GOAL_MB:.0f} MB: {'ok' if rss_mb <= RSS_GOAL_MB else 'MISSED'}"),
        ("USS", "n/a" if result.uss_bytes is None else f"{result.uss_bytes / MB:.1f} MB", "memory only this process"),
        ("idle CPU", f"{result.cpu_percent:.2f} % of one core over the last {result.window:.0f} s",
         f"goal <= {CPU_GOAL_PERCENT} %: {'ok' if result.cpu_percent <= CPU_GOAL_PERCENT else 'MISSED'}"),
        ("threads", str(result.threads), ""),
    ]
    width = max(len(name) for name, _, _ in rows)
    value_width = max(len(value) for _, value, _ in rows)
    return "\n".join(f"{name:<{width}}  {value:<{value_width}}  {note}".rstrip() for name, value, note in rows)


def main(argv: list[str] | None = None) -> int:
    """Run once and print the table; exit 1 when a goal is missed and --check is given."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="dgx-h100", help="simulated node profile (default dgx-h100)")
    parser.add_argument("--seconds", type=float, default=60.0, help="total run time before measuring ends")
    parser.add_argument("--window", type=float, default=20.0, help="CPU is averaged over the last N seconds")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON instead of a table")
    parser.add_argument("--check", action="store_true", help="exit 1 when a goal is missed")
    args = parser.parse_args(argv)
    result = measure(args.profile, args.seconds, args.window)
    if args.json:
        print(json.dumps({"profile": result.profile, "seconds": round(result.seconds, 1),
                          "rss_mb": round(result.rss_bytes / MB, 1),
                          "uss_mb": None if result.uss_bytes is None else round(result.uss_bytes / MB, 1),
                          "cpu_percent": round(result.cpu_percent, 3), "threads": result.threads}))
    else:
        print(render(result))
    missed = result.rss_bytes / MB > RSS_GOAL_MB or result.cpu_percent > CPU_GOAL_PERCENT
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
