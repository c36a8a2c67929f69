"""The simulated dcgm-exporter over real HTTP, its failure modes, and the `simulate-dcgm-exporter` command.

Every request goes through a real socket on 127.0.0.1; timeouts here are hang guards, never timing assertions.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.cli import main
from agent.simulate.dcgm_exporter import CONTENT_TYPE, DcgmExporterServer, SimulatedDcgmExporter
from tests.fakes.ports import free_port
from tests.simulate.test_dcgm_exporter import GPUS, UUID0, families, line, samples

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def exporter() -> SimulatedDcgmExporter:
    return SimulatedDcgmExporter(GPUS, xid_metrics=("gauge", "count", "total"))


@pytest.fixture
def served(exporter: SimulatedDcgmExporter) -> Iterator[DcgmExporterServer]:
    with DcgmExporterServer(exporter) as server:
        yield server


def get(url: str, timeout: float = 10.0) -> tuple[int, str, str]:
    with urllib.request.urlopen(url, timeout=timeout) as answer:  # noqa: S310 - a local test server
        return answer.status, answer.headers["Content-Type"], answer.read().decode()


def post(url: str) -> tuple[int, str]:
    request = urllib.request.Request(url, method="POST", data=b"")  # noqa: S310
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:  # noqa: S310
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()



# --- HTTP -----------------------------------------------------------------------------------------------------


def test_get_metrics_over_http(served: DcgmExporterServer, exporter: SimulatedDcgmExporter) -> None:
    assert served.url == f"http://127.0.0.1:{served.port}/metrics"
    status, content_type, body = get(served.url)
    assert (status, content_type) == (200, CONTENT_TYPE)
    assert body == exporter.render()
    with pytest.raises(urllib.error.HTTPError) as info:
        get(served.url.removesuffix("metrics"))
    assert info.value.code == 404


def test_post_inject_by_index_and_uuid(served: DcgmExporterServer, exporter: SimulatedDcgmExporter) -> None:
    base = served.url.removesuffix("/metrics")
    assert post(f"{base}/inject?gpu=1&xid=79") == (204, "")
    assert post(f"{base}/inject?gpu={UUID0}&xid=48&count=2") == (204, "")
    text = get(served.url)[2]
    totals = {(labels["gpu"], labels["xid"]): v for labels, v in samples(text, "DCGM_EXP_XID_ERRORS_TOTAL")}
    assert totals == {("1", "79"): 1, ("0", "48"): 2}


@pytest.mark.parametrize(("query", "message"), [
    ("gpu=1", "need gpu"),
    ("gpu=9&xid=79", "no GPU '9'"),
    ("gpu=1&xid=abc", "xid must be"),
    ("gpu=1&xid=79&count=0", "positive"),
    ("gpu=1&xid=79&count=-1", "count must be"),
    ("gpu=1&xid=79&xid=80", "xid given 2 times"),
    ("gpu=1&xid=79&color=red", "unknown parameters: color"),
    ("gpu=1&xid=79&gpu_instance=2", "no MIG GPU instance"),
])
def test_post_inject_refuses_bad_input_with_400(served: DcgmExporterServer, query: str, message: str) -> None:
    status, body = post(served.url.removesuffix("/metrics") + "/inject?" + query)
    assert status == 400
    assert message in body
    assert "Traceback" not in body


def test_post_elsewhere_is_404(served: DcgmExporterServer) -> None:
    assert post(served.url)[0] == 404


@pytest.mark.parametrize("status", [500, 503])
def test_an_error_status_is_served(served: DcgmExporterServer, exporter: SimulatedDcgmExporter, status: int) -> None:
    exporter.status = status
    with pytest.raises(urllib.error.HTTPError) as info:
        get(served.url)
    assert info.value.code == status
    assert "simulated dcgm-exporter failure" in info.value.read().decode()
    exporter.status = 200
    assert get(served.url)[0] == 200


def test_malformed_text_is_rejected_by_the_prometheus_parser(served: DcgmExporterServer,
                                                             exporter: SimulatedDcgmExporter) -> None:
    exporter.malformed = True
    status, _, body = get(served.url)
    assert status == 200
    assert body.endswith('DCGM_FI_DEV_SM_CLOCK{gpu="0",UUID="GPU-')
    with pytest.raises(ValueError):
        families(body)


def test_a_delayed_answer_times_the_client_out(served: DcgmExporterServer, exporter: SimulatedDcgmExporter) -> None:
    exporter.delay_seconds = 30.0
    with pytest.raises((TimeoutError, urllib.error.URLError)):
        get(served.url, timeout=0.2)
    exporter.delay_seconds = 0.0
    assert get(served.url)[0] == 200


def test_the_server_stops_and_restarts(exporter: SimulatedDcgmExporter) -> None:
    server = DcgmExporterServer(exporter)
    url = server.start()
    assert server.start() == url
    server.stop()
    server.stop()
    with pytest.raises(urllib.error.URLError):
        get(url, timeout=2)
    url = server.start()
    try:
        assert get(url)[0] == 200
    finally:
        server.stop()


# --- CLI ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_the_cli_serves_until_signalled(stop_signal: signal.Signals) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    proc = subprocess.Popen([sys.executable, "-m", "agent", "simulate-dcgm-exporter", "--profile", "dgx-h100",
                             "--address", f"127.0.0.1:{port}", "--xid-metrics", "gauge,total", "--hostname", "sim-1"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30  # hang guard only
        while True:
            assert proc.poll() is None, proc.communicate()
            with contextlib.suppress(OSError):
                status, _, body = get(url, timeout=2)
                break
            assert time.monotonic() < deadline, "the simulated exporter never answered"
            time.sleep(0.05)
        assert status == 200
        assert 'Hostname="sim-1"' in body
        assert post(url.removesuffix("/metrics") + "/inject?gpu=2&xid=79") == (204, "")
        assert 'gpu="2"' in line(get(url)[2], "DCGM_EXP_XID_ERRORS_TOTAL", "2")
        proc.send_signal(stop_signal)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert url in out
    assert f"curl -X POST 'http://127.0.0.1:{port}/inject?gpu=2&xid=79'" in out


@pytest.mark.parametrize(("argv", "message"), [
    (["--profile", "no-such-node"], "unknown simulated profile"),
    (["--profile", "dgx-h100", "--address", "nowhere"], "not a host:port address"),
    (["--profile", "dgx-h100", "--xid-metrics", "gauge,histogram"], "unknown xid metrics"),
])
def test_cli_usage_errors_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate-dcgm-exporter", *argv]) == 2
    assert message in capsys.readouterr().err


def test_cli_reports_a_busy_port(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert main(["simulate-dcgm-exporter", "--profile", "dgx-h100", "--address", f"127.0.0.1:{port}"]) == 2
    assert "cannot listen on" in capsys.readouterr().err
