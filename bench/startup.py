"""Start time of `gpu-node-agent run --simulate dgx-h100`: process start to every device-plugin resource registered.

Each run starts the agent as a real process (`python -m agent run`, its own short device-plugin directory, so
the built-in stand-in kubelet registers the plugins there; metrics on a free loopback port) with
`-X importtime`, reads its stderr and stops the clock at the log line `all N device-plugin resources are
registered with the kubelet`. Also printed per run: the first log line (imports, config and the metrics socket
done) and the import self time summed over every module imported up to registration (all, and `agent.*`
alone). Goal (issue 32): median <= 1 s over 5 runs. Import times under `-X importtime` are a little higher
than without it; `--no-importtime` measures without. Bytecode is cached as an installed package's is (a
`PYTHONPYCACHEPREFIX` under the temp directory, filled by one uncounted start first, so the checkout stays
clean); `--cold` starts with the environment as it is (with PYTHONDONTWRITEBYTECODE every start compiles).

    python bench/startup.py                   # 5 runs, dgx-h100
    python bench/startup.py --runs 9 --profile pcie-pairs --no-importtime
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

GOAL_S = 1.0
REGISTERED = "device-plugin resources are registered with the kubelet"


@dataclass
class Start:
    """What one run measured (seconds; import self times in seconds too)."""

    first_log: float
    registered: float
    import_self: float
    agent_import_self: float
    modules: int


def _import_line(line: str) -> tuple[float, str] | None:
    """`import time:   1234 |   5678 |   agent.x` -> (self seconds, module), or None."""
    if not line.startswith("import time:"):
        return None
    parts = line.split("|")
    try:
        return int(parts[0].removeprefix("import time:").strip()) / 1e6, parts[2].strip()
    except (IndexError, ValueError):
        return None  # the header line


def _read_until_registered(process: subprocess.Popen[str], started: float, timeout: float) -> Start:
    """Read the agent's stderr (import lines and JSON log lines) until the registration line."""
    first_log: float | None = None
    registered: float | None = None
    import_self = agent_self = 0.0
    modules = 0
    seen: list[str] = []
    assert process.stderr is not None
    with selectors.DefaultSelector() as selector:
        selector.register(process.stderr, selectors.EVENT_READ)
        while registered is None:
            left = timeout - (time.monotonic() - started)
            if left <= 0 or not selector.select(left):
                raise RuntimeError(f"not registered within {timeout:.0f}s; log:\n" + "".join(seen[-30:]))
            line = process.stderr.readline()
            if not line:
                raise RuntimeError(f"agent exited with {process.wait()}; log:\n" + "".join(seen[-30:]))
            now = time.monotonic() - started
            parsed = _import_line(line)
            if parsed is not None:
                modules += 1
                import_self += parsed[0]
                if parsed[1] == "agent" or parsed[1].startswith("agent."):
                    agent_self += parsed[0]
                continue
            seen.append(line)
            try:
                message = str(json.loads(line).get("msg", ""))
            except (json.JSONDecodeError, AttributeError):
                continue
            if first_log is None:
                first_log = now
            if REGISTERED in message:
                registered = now
    return Start(first_log=first_log or registered, registered=registered, import_self=import_self,
                 agent_import_self=agent_self, modules=modules)


def stop(process: subprocess.Popen[str] | subprocess.Popen[bytes]) -> None:
    """SIGTERM, as the kubelet stops a pod, then SIGKILL after 30 s (the agent's own shutdown takes well under)."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def run_once(profile: str, importtime: bool, env: dict[str, str], timeout: float = 60.0) -> Start:
    """Start the agent with `env`, wait for registration, stop it (SIGTERM)."""
    workdir = Path(tempfile.mkdtemp(prefix="gnast"))  # short: unix socket paths are limited to 108 bytes
    plugin_dir = workdir / "dp"
    plugin_dir.mkdir()
    argv = [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "agent", "run",
            "--simulate", profile, "--metrics-address", "127.0.0.1:0", "--device-plugin-dir", str(plugin_dir),
            "--state-dir", str(workdir / "state"), "--log-format", "json"]
    started = time.monotonic()
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, text=True)
    try:
        return _read_until_registered(process, started, timeout)
    finally:
        stop(process)
        if process.stderr is not None:
            process.stderr.close()
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """Run `--runs` times and print each run and the medians; exit 1 with --check when the goal is missed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="dgx-h100", help="simulated node profile (default dgx-h100)")
    parser.add_argument("--runs", type=int, default=5, help="agent starts (default 5)")
    parser.add_argument("--no-importtime", action="store_true", help="run without -X importtime")
    parser.add_argument("--cold", action="store_true", help="no bytecode cache set up, no warm-up start")
    parser.add_argument("--check", action="store_true", help=f"exit 1 when the median is over {GOAL_S} s")
    args = parser.parse_args(argv)
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if not args.cold:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(Path(tempfile.gettempdir()) / "gna-bench-pycache")
        run_once(args.profile, importtime=False, env=env)  # fills the bytecode cache
    runs = []
    for i in range(args.runs):
        start = run_once(args.profile, importtime=not args.no_importtime, env=env)
        runs.append(start)
        imports = "" if args.no_importtime else \
            f"; import self time {start.import_self * 1e3:.0f} ms ({start.modules} modules), " \
            f"agent.* {start.agent_import_self * 1e3:.0f} ms"
        print(f"run {i + 1}: first log line {start.first_log * 1e3:.0f} ms, registered {start.registered * 1e3:.0f} ms"
              f"{imports}")
    median = statistics.median(r.registered for r in runs)
    summary = f"median: first log line {statistics.median(r.first_log for r in runs) * 1e3:.0f} ms, " \
        f"registered {median * 1e3:.0f} ms"
    if not args.no_importtime:
        summary += f", import self time {statistics.median(r.import_self for r in runs) * 1e3:.0f} ms " \
            f"(agent.* {statistics.median(r.agent_import_self for r in runs) * 1e3:.0f} ms, " \
            f"{statistics.median(r.modules for r in runs):.0f} modules)"
    print(summary)
    print(f"goal <= {GOAL_S:.0f} s median: {'ok' if median <= GOAL_S else 'MISSED'}; "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 1 if args.check and median > GOAL_S else 0


if __name__ == "__main__":
    sys.exit(main())
