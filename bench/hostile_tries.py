"""Re-run the hostile inputs of issue 27 that reach the agent through its command line and its annotation parser
(and issue 37's PodResources socket that accepts and never answers, `bench/podresources_hang.py`),
and print a table: input, expected, seen (exit code or refusal), seconds.

Each config-level try is a `gpu-node-agent config|run` process of its own (as an operator's bad file would be);
the annotation tries call the one quantity parser the shaping resolver uses, timed on this process's CPU.
Issue 37, item 1 (`replica_rows`): big time-sliced preference calls to a real `run --simulate` (1024 replicas per
GPU or MIG device) over its plugin sockets, with a NIC call sent meanwhile, and SIGTERM during the biggest; and
19,000 aliased time-slicing entries or NIC pools, timed on this process's CPU.

    python bench/hostile_tries.py
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.config.shaping import parse_bandwidth
from bench.podresources_hang import measure

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


def _pod_resources_hang() -> tuple[str, str, str, float]:
    """Issue 37 item 4: a PodResources socket that accepts and never answers (`bench/podresources_hang.py`)."""
    result = asyncio.run(measure(5.0))
    after = sorted(result.after)
    seen = (f"first call {result.first_s:.2f} s, then {len(after)} calls max {after[-1] * 1e3:.0f} ms; exact "
            f"{result.recovered_s:.2f} s after it answers" if after and result.recovered_s is not None
            else f"first call {result.first_s:.2f} s, {len(after)} later calls, never exact again")
    return ("PodResources socket accepts, never answers (5 s)", "<= 2 s once, then < 150 ms per call", seen,
            max(after, default=result.first_s))


# --- issue 37: MIG payloads in simulate mode; pod LISTs through a proxy that ignores the field selector ----------

def _mig_payload_row() -> tuple[str, str, str, float]:
    """A MIG device admitted through the stand-in kubelet (gRPC) from a `run --simulate dgx-h100-mig` process."""
    import asyncio

    from agent.simulate.kubelet import LocalKubelet

    async def admit() -> tuple[str, float]:
        directory = Path(tempfile.mkdtemp(prefix="gna-mig-"))
        kubelet = LocalKubelet(directory)
        await kubelet.start()
        started = time.monotonic()
        agent = subprocess.Popen([sys.executable, "-m", "agent", "run", "--simulate", "dgx-h100-mig", "--mig-strategy",
                                  "mixed", "--pass-device-specs", "--kmsg", "", "--device-plugin-dir", str(directory),
                                  "--metrics-address", "127.0.0.1:0"], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
        try:
            resource = "nvidia.com/mig-1g.10gb"
            await kubelet.wait_for(lambda: resource in kubelet.plugins and kubelet.plugins[resource].lists > 0, 60)
            await kubelet.admit({resource: 1})
            paths = sorted(d.host_path for d in kubelet.responses[resource].devices)
            return ", ".join(paths), time.monotonic() - started
        finally:
            agent.terminate()
            agent.wait(30)
            await kubelet.stop()

    seen, took = asyncio.run(admit())
    return ("run --simulate dgx-h100-mig --mig-strategy mixed --pass-device-specs: a MIG device's Allocate",
            "parent /dev/nvidia<N> + 2 distinct nvidia-cap nodes", seen, took)


def _foreign_pod_rows() -> list[tuple[str, str, str, float]]:
    """The lightkube port against the API double in its own process, answering every LIST with all its pods."""
    import asyncio
    import contextlib

    from prometheus_client import CollectorRegistry

    from agent.kube.cluster import connect
    from agent.kube.errors import ApiError
    from agent.kube.metrics import ApiRequestCounter
    from tests.fakes.apiserver import write_kubeconfig

    async def worst_hold(work: asyncio.Future[object]) -> float:
        worst = 0.0
        while not work.done():
            started = time.perf_counter()
            await asyncio.sleep(0.005)
            worst = max(worst, time.perf_counter() - started - 0.005)
        return worst

    async def tries(*double_args: str) -> list[tuple[str, float, float]]:
        double = subprocess.Popen([sys.executable, "-m", "tests.fakes.apiserver_proc", "--node", "gpu-node-1",
                                   "--ignore-field-selectors", *double_args], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        assert double.stdin is not None and double.stdout is not None
        url = double.stdout.readline().strip()
        registry = CollectorRegistry()
        port = connect("gpu-node-1", ApiRequestCounter(registry),
                       str(write_kubeconfig(Path(tempfile.mkdtemp()) / "kc", url)), timeout=30)
        found: list[tuple[str, float, float]] = []
        try:
            with contextlib.suppress(ApiError):
                await port.find_node_pod("team", "absent")  # connection and code paths warm
            for call in (lambda: port.find_node_pod("team", "train-0"), port.list_node_pods):
                started = time.perf_counter()
                work: asyncio.Future[object] = asyncio.ensure_future(call())
                held = await worst_hold(work)
                try:
                    result = await work
                    pods = getattr(result, "pods", None)
                    seen = f"{len(pods)} own pods" if pods is not None else f"found {getattr(result, 'key', None)}"
                except ApiError as exc:
                    seen = f"refused: {exc}"[:90]
                foreign = sum(registry.get_sample_value("gpu_node_agent_apiserver_foreign_pods_total",
                                                        {"request": r}) or 0 for r in ("find_node_pod",
                                                                                       "list_node_pods"))
                found.append((f"{seen}; {foreign:.0f} foreign pods skipped so far; loop held {held * 1e3:.1f} ms",
                              held, time.perf_counter() - started))
        finally:
            await port.aclose()
            double.stdin.close()
            double.wait(10)
        return found

    rows = []
    for label, args in (("20,000 pods (9 MB)", ("--pods", "20000", "--own", "train-0")),
                        ("2,000 pods of 9 kB (18 MB)", ("--pods", "2000", "--pad", "9000"))):
        for call, (seen, _, took) in zip(("find_node_pod", "list_node_pods"), asyncio.run(tries(*args)), strict=True):
            rows.append((f"pod LIST through a proxy ignoring fieldSelector, {label}: {call}",
                         "own node's pods only (over 16 MiB: 502), loop held < 50 ms", seen, took))
    return rows


def issue37_rows() -> list[tuple[str, str, str, float]]:
    """Issue 37's rows for items 6 and 5 (pod-spec fetch)."""
    return [_mig_payload_row(), *_foreign_pod_rows()]


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
    rows += replica_rows()
    for text in ANNOTATIONS:
        started = time.process_time()
        try:
            parse_bandwidth(text)
            seen = "accepted"
        except ValueError as exc:
            seen = f"refused: {str(exc)[:90]}"
        rows.append((f"annotation internet-egress-bandwidth {text[:20]!r}", "refused at once", seen,
                     time.process_time() - started))
    rows.append(_pod_resources_hang())
    rows.extend(issue37_rows())
    rows.extend(_netacct_rows())
    print("| input | expected | seen | seconds |")
    print("|---|---|---|---|")
    for what, expected, seen, took in rows:
        print(f"| {what} | {expected} | {seen.replace('|', '/')} | {took:.3f} |")



# Issue 37, item 1: time-sliced preference calls on the largest sharing, and many time-slicing entries or NIC pools
_SLICED = "version: v1\nflags:\n  migStrategy: mixed\nsharing:\n  timeSlicing:\n    resources:\n" \
          "    - name: {name}\n      replicas: 1024\n"
_REPLICA_CASES = [  # (profile, sliced resource, sizes asked); the last size is asked again for SIGTERM
    ("dgx-h100", "nvidia.com/gpu", (1000, 4000, 8000)),
    ("dgx-h100-mig", "nvidia.com/mig-1g.10gb", (1000, 25_088)),
]
_ENTRIES = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - &e {name: gpu, replicas: 4}\n" + \
    "    - *e\n" * 18_999
_POOLS = "devicePlugin:\n  pools:\n  - &p {resourceName: r}\n" + "  - *p\n" * 18_999


async def _replica_case(directory: Path, profile: str, resource: str, sizes: tuple[int, ...]) -> list[
        tuple[str, str, str, float]]:
    import asyncio
    import os
    import signal

    import grpc

    from agent.deviceplugin.pools import socket_name
    from agent.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc

    def request(ids: list[str], size: int) -> api_pb2.PreferredAllocationRequest:
        return api_pb2.PreferredAllocationRequest(container_requests=[
            api_pb2.ContainerPreferredAllocationRequest(available_deviceIDs=ids, allocation_size=size)])

    config = directory / "nvidia-dp.yaml"
    config.write_text(_SLICED.format(name=resource.rpartition("/")[2]))
    nic_resource = "gpunodeagent.io/sriov_rdma"
    process = subprocess.Popen([sys.executable, "-m", "agent", "run", "--simulate", profile, "--dry-run",
                                "--device-plugin-dir", str(directory), "--metrics-address", "127.0.0.1:0",
                                "--nvidia-dp-config", str(config)],
                               stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    rows: list[tuple[str, str, str, float]] = []
    try:
        deadline = time.monotonic() + 60
        while not all((directory / socket_name(r)).exists() for r in (resource, nic_resource)):
            if process.poll() is not None or time.monotonic() > deadline:
                return [(f"run --simulate {profile}: {resource} x1024", "serves", "no plugin sockets", 0.0)]
            await asyncio.sleep(0.1)
        stubs = {}
        offers = {}
        for name in (resource, nic_resource):
            channel = grpc.aio.insecure_channel(f"unix://{directory / socket_name(name)}")
            stubs[name] = api_pb2_grpc.DevicePluginStub(channel)
            call = stubs[name].ListAndWatch(api_pb2.Empty())
            offers[name] = [d.ID for d in (await asyncio.wait_for(call.read(), 30)).devices]
            call.cancel()

        async def timed(name: str, size: int, delay: float = 0.0) -> float:
            await asyncio.sleep(delay)
            started = time.monotonic()
            await stubs[name].GetPreferredAllocation(request(offers[name], size), timeout=120)
            return time.monotonic() - started

        what = f"run --simulate {profile}: GetPreferredAllocation of {{}} of {len(offers[resource])} replicas"
        for size in sizes:
            took, nic = await asyncio.gather(timed(resource, size), timed(nic_resource, 1, 0.02))
            rows.append((what.format(size), "< 0.5 s, NIC call meanwhile < 0.5 s", f"NIC call {nic:.3f} s", took))
        in_flight = asyncio.ensure_future(timed(resource, sizes[-1]))
        await asyncio.sleep(0.02)
        process.send_signal(signal.SIGTERM)
        started = time.monotonic()
        while process.poll() is None and time.monotonic() - started < 30:
            await asyncio.sleep(0.02)
        ended = time.monotonic() - started
        await asyncio.gather(in_flight, return_exceptions=True)
        rows.append((f"run --simulate {profile}: SIGTERM during a call of {sizes[-1]}", "ends within 5 s",
                     f"exit {process.poll()}", ended))
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return rows


def replica_rows() -> list[tuple[str, str, str, float]]:
    """Issue 37, item 1: the rows of big time-sliced preference calls and of many time-slicing entries."""
    import asyncio
    import contextlib
    import io

    from agent import cli

    rows: list[tuple[str, str, str, float]] = []
    for profile, resource, sizes in _REPLICA_CASES:
        with tempfile.TemporaryDirectory(prefix="gna") as tmp:  # short: unix socket paths
            rows += asyncio.run(_replica_case(Path(tmp), profile, resource, sizes))
    with tempfile.TemporaryDirectory(prefix="gna") as tmp:
        for what, flag, text in (("timeSlicing entries", "--nvidia-dp-config", _ENTRIES),
                                 ("devicePlugin.pools entries", "--config", _POOLS)):
            path = Path(tmp) / "entries.yaml"
            path.write_text(text)
            for command in ("config", "run"):
                err = io.StringIO()
                started = time.process_time()
                with contextlib.redirect_stderr(err):
                    code = cli.main([command, flag, str(path)])
                lines = err.getvalue().strip().splitlines()
                rows.append((f"{command}: 19,000 aliased {what} (s of CPU)", "exit 2, one line, < 1 s CPU",
                             f"exit {code}, {len(lines)} line(s): {(lines or [''])[-1][:70]}",
                             time.process_time() - started))


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


def _netacct_rows() -> list[tuple[str, str, str, float]]:
    """Issue 37 items 3 and 5, network accounting: real packets in throw-away network namespaces (root; about
    90 s), from bench/netacct_hostile.py (run alone there)."""
    from bench.netacct_hostile import netacct_rows

    return netacct_rows()


if __name__ == "__main__":
    main()
