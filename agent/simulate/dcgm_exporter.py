"""A stand-in for NVIDIA's dcgm-exporter: its `/metrics` text, byte for byte, served over real HTTP.

In production the agent's dcgm-exporter health source scrapes a real exporter. Tests and `run --simulate` need
one that writes exactly that format (the Go template of dcgm-exporter's rendermetrics package, the counters of
etc/default-counters.csv, the exporter-owned Xid count and total collectors) and that takes injected faults:
Xids, ECC and row-remap counters, pod assignments, HTTP errors, unparsable text and slow answers. Nothing here
touches a GPU. Only what a parser could tell apart is modelled; values are plausible, not measured.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any
from urllib.parse import parse_qs, urlsplit

from agent.host.busid import normalize_bus_id
from agent.simulate.dcgm_fields import FIELDS, OPTIONAL_FIELDS, XID_GAUGE, FieldSpec, coerce, field_spec, format_value
from agent.simulate.profiles import load_profile

log = logging.getLogger(__name__)

DEFAULT_MODEL = "NVIDIA H100 80GB HBM3"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
XID_METRICS = frozenset({"gauge", "count", "total"})
XID_COUNT = "DCGM_EXP_XID_ERRORS_COUNT"
XID_TOTAL = "DCGM_EXP_XID_ERRORS_TOTAL"

_MODEL_BY_DEVICE_ID = {"0x2330": DEFAULT_MODEL, "0x1db1": "Tesla V100-SXM2-16GB"}
_FB_MIB = {DEFAULT_MODEL: (81004, 1), "Tesla V100-SXM2-16GB": (16150, 0)}  # (free, used) of an idle GPU


def nvml_bus_id(bus_id: str) -> str:
    """NVML's form of a PCI bus id, as dcgm-exporter prints it: "0000:1b:00.0" -> "00000000:1B:00.0"."""
    domain, bus, devfn = normalize_bus_id(bus_id).split(":")
    return f"{int(domain, 16):08X}:{bus.upper()}:{devfn.upper()}"


def _label_value(what: str, value: str) -> str:
    # The Go template writes label values unescaped; refuse what would make it emit broken text.
    if any(c in value for c in '"\\\n'):
        raise ValueError(f"{what} {value!r} cannot be a label value (quote, backslash or newline)")
    return value


@dataclass(frozen=True)
class ExporterGpu:
    """One GPU as dcgm-exporter labels it; `bus_id` in the agent's sysfs form, rendered in NVML form."""

    index: int
    uuid: str
    bus_id: str
    model: str = DEFAULT_MODEL
    mig: tuple[tuple[str, int], ...] = ()  # (GPU_I_PROFILE, GPU_I_ID) per MIG GPU instance


@dataclass(frozen=True)
class _Series:
    """One monitored entity: a whole GPU, or one GPU instance of a MIG GPU."""

    gpu: ExporterGpu
    instance: tuple[str, int] | None
    labels: str  # gpu, UUID, pci_bus_id, device, modelName[, GPU_I_PROFILE, GPU_I_ID][, Hostname]

    @property
    def key(self) -> tuple[str, int | None]:
        return self.gpu.uuid, self.instance[1] if self.instance else None


@dataclass(frozen=True)
class _Xid:
    at: float
    uuid: str
    instance: int | None  # None: the whole GPU (every GPU instance of a MIG GPU)
    code: int
    count: int


class SimulatedDcgmExporter:
    """The exporter's state and its text. Thread-safe: the HTTP server renders while tests inject."""

    def __init__(self, gpus: Sequence[ExporterGpu], *, hostname: str = "node-1", driver_version: str = "550.54.15",
                 xid_metrics: Collection[str] = ("gauge",), xid_window_seconds: float = 300.0,
                 uuid_label: str = "UUID", extra_fields: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if unknown := set(xid_metrics) - XID_METRICS:
            raise ValueError(f"unknown xid metrics {sorted(unknown)}; choose from {sorted(XID_METRICS)}")
        if uuid_label not in ("UUID", "uuid"):
            raise ValueError(f"uuid_label must be 'UUID' or 'uuid', not {uuid_label!r}")
        if xid_window_seconds <= 0:
            raise ValueError(f"xid_window_seconds must be positive, not {xid_window_seconds!r}")
        self.gpus = tuple(sorted(gpus, key=lambda g: g.index))
        if len({g.index for g in self.gpus}) != len(self.gpus) or len({g.uuid for g in self.gpus}) != len(self.gpus):
            raise ValueError("GPU indexes and UUIDs must be unique")
        self._by_uuid = {g.uuid: g for g in self.gpus}
        self.hostname = _label_value("hostname", hostname)
        self.driver_version = _label_value("driver version", driver_version)
        self.xid_metrics = frozenset(xid_metrics)
        self.xid_window_seconds = xid_window_seconds
        self.uuid_label = uuid_label
        self.extra_fields = extra_fields
        self._clock = clock
        self._lock = threading.Lock()
        self._series = tuple(self._make_series())
        self._values: dict[tuple[str, int | None], dict[str, float]] = {}
        self._enabled: set[str] = set()  # optional or unknown fields that something set
        self._xids: list[_Xid] = []
        self._pods: dict[tuple[str, int | None], tuple[tuple[str, str], ...]] = {}
        self.status = 200
        self.malformed = False
        self.delay_seconds = 0.0

    @classmethod
    def for_profile(cls, name: str, **options: Any) -> SimulatedDcgmExporter:
        """The GPUs of a built-in simulated node, indexed in bus-id order like the agent's topology."""
        profile = load_profile(name)
        device_ids = {dev.bdf: dev.model.device for _, _, dev in profile.walk() if dev.model.is_gpu}
        gpus = [ExporterGpu(index=i, uuid=uuid, bus_id=bus_id,
                            model=_MODEL_BY_DEVICE_ID.get(device_ids.get(bus_id, ""), DEFAULT_MODEL))
                for i, (bus_id, uuid) in enumerate(sorted(profile.gpu_uuids.items()))]
        return cls(gpus, **options)

    def _make_series(self) -> Iterable[_Series]:
        for gpu in self.gpus:
            base = (f'gpu="{gpu.index}",{self.uuid_label}="{_label_value("UUID", gpu.uuid)}",'
                    f'pci_bus_id="{nvml_bus_id(gpu.bus_id)}",device="nvidia{gpu.index}",'
                    f'modelName="{_label_value("model", gpu.model)}"')
            host = f',Hostname="{self.hostname}"' if self.hostname else ""
            if len({i for _, i in gpu.mig}) != len(gpu.mig):
                raise ValueError(f"GPU {gpu.uuid}: MIG instance ids must be unique")
            if not gpu.mig:
                yield _Series(gpu, None, base + host)
            for profile, instance in gpu.mig:
                mig = f',GPU_I_PROFILE="{_label_value("profile", profile)}",GPU_I_ID="{instance}"'
                yield _Series(gpu, (profile, instance), base + mig + host)

    def find_gpu(self, ref: str | int) -> ExporterGpu:
        """A GPU by index (int or digits) or UUID; ValueError naming the known ones."""
        for gpu in self.gpus:
            if gpu.uuid == ref or str(gpu.index) == str(ref):
                return gpu
        raise ValueError(f"no GPU {ref!r}; known: " + ", ".join(f"{g.index} ({g.uuid})" for g in self.gpus))

    def _key(self, uuid: str, gpu_instance: int | None) -> tuple[str, int | None]:
        gpu = self._by_uuid.get(uuid) or self.find_gpu(uuid)
        if gpu_instance is not None and gpu_instance not in {i for _, i in gpu.mig}:
            raise ValueError(f"GPU {gpu.uuid} has no MIG GPU instance {gpu_instance}")
        return gpu.uuid, gpu_instance

    def inject_xid(self, uuid: str, code: int, count: int = 1, gpu_instance: int | None = None) -> None:
        """Record `count` occurrences of Xid `code` now, on the GPU or one of its MIG GPU instances."""
        if code < 1 or count < 1:
            raise ValueError(f"Xid code and count must be positive, got code={code} count={count}")
        with self._lock:
            key = self._key(uuid, gpu_instance)
            self._xids.append(_Xid(self._clock(), key[0], key[1], int(code), int(count)))

    def set_field(self, uuid: str, field: str, value: float, gpu_instance: int | None = None) -> None:
        """Set any DCGM_FI_* field (the Xid gauge excepted: use inject_xid); optional fields start rendering."""
        spec = self._settable(field)
        with self._lock:
            self._values.setdefault(self._key(uuid, gpu_instance), {})[field] = coerce(spec, value)
            self._enabled.add(field)

    def add_to_field(self, uuid: str, field: str, delta: float, gpu_instance: int | None = None) -> None:
        """Add to a field's current value (its default or what was set), e.g. to grow an error counter."""
        spec = self._settable(field)
        with self._lock:
            key = self._key(uuid, gpu_instance)
            current = self._value(key, spec)
            self._values.setdefault(key, {})[field] = coerce(spec, current + delta)
            self._enabled.add(field)

    @staticmethod
    def _settable(field: str) -> FieldSpec:
        if field == XID_GAUGE:
            raise ValueError(f"{XID_GAUGE} follows the injected Xids; use inject_xid")
        return field_spec(field)

    def assign_pod(self, uuid: str, namespace: str, pod: str, container: str,
                   gpu_instance: int | None = None) -> None:
        """Label the GPU's (or one GPU instance's) series with the pod using it, as the pod mapper does."""
        attributes = {"container": container, "namespace": namespace, "pod": pod}
        for name, value in attributes.items():
            _label_value(name, value)
        with self._lock:
            self._pods[self._key(uuid, gpu_instance)] = tuple(sorted(attributes.items()))

    def release_pod(self, uuid: str, gpu_instance: int | None = None) -> None:
        """Drop a pod assignment made with assign_pod."""
        with self._lock:
            self._pods.pop(self._key(uuid, gpu_instance), None)

    def _defaults(self, gpu: ExporterGpu) -> dict[str, float]:
        free, used = _FB_MIB.get(gpu.model, _FB_MIB[DEFAULT_MODEL])
        return {"DCGM_FI_DEV_SM_CLOCK": 345, "DCGM_FI_DEV_MEM_CLOCK": 2619,
                "DCGM_FI_DEV_MEMORY_TEMP": 30 + gpu.index % 3, "DCGM_FI_DEV_GPU_TEMP": 27 + gpu.index % 4,
                "DCGM_FI_DEV_POWER_USAGE": 69.25 + 1.5 * gpu.index,
                "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": 7_034_811_203 + 10_007 * gpu.index,
                "DCGM_FI_DEV_FB_FREE": free, "DCGM_FI_DEV_FB_USED": used}

    def _value(self, key: tuple[str, int | None], field: FieldSpec) -> float:
        """Instance value, else the whole GPU's, else the default. Call with the lock held."""
        for where in (key, (key[0], None)):
            if field.name in self._values.get(where, {}):
                return self._values[where][field.name]
        return coerce(field, self._defaults(self._by_uuid[key[0]]).get(field.name, 0))

    def _families(self) -> list[FieldSpec]:
        shown = [f for name, f in FIELDS.items()
                 if f.default or name in self._enabled or (self.extra_fields and name in OPTIONAL_FIELDS)
                 or (name == XID_GAUGE and "gauge" in self.xid_metrics)]
        return shown + [field_spec(name) for name in sorted(self._enabled - FIELDS.keys())]

    def _line(self, name: str, series: _Series, value: float, labels: dict[str, str]) -> str:
        extra = {"DCGM_FI_DRIVER_VERSION": self.driver_version} if self.driver_version else {}
        extra |= labels
        text = "".join(f',{k}="{v}"' for k, v in sorted(extra.items()))
        pod = self._pods.get(series.key) or self._pods.get((series.gpu.uuid, None), ())
        text += "".join(f',{k}="{v}"' for k, v in pod)
        return f"{name}{{{series.labels}{text}}} {format_value(value)}\n"

    def _xids_of(self, series: _Series) -> list[_Xid]:
        uuid, instance = series.key
        return [x for x in self._xids if x.uuid == uuid and x.instance in (None, instance)]

    def render(self) -> str:
        """The /metrics text: every family that has samples, in dcgm-exporter's exact layout."""
        with self._lock:
            now = self._clock()
            families: list[tuple[FieldSpec, list[str]]] = []
            for field in self._families():
                if field.name == XID_GAUGE:
                    last = [xids[-1] if (xids := self._xids_of(s)) else None for s in self._series]  # injection order
                    lines = [self._line(XID_GAUGE, s, x.code if x else 0, {})
                             for s, x in zip(self._series, last, strict=True)]
                else:
                    lines = [self._line(field.name, s, self._value(s.key, field), {}) for s in self._series]
                families.append((field, lines))
            if "count" in self.xid_metrics:
                help_ = "Count of XID Errors within user-specified time window (see xid-count-window-size param)."
                window = {"window_size_in_ms": str(round(self.xid_window_seconds * 1000))}
                lines = []
                for s in self._series:
                    recent = Counter[int]()
                    for x in self._xids_of(s):
                        if now - x.at <= self.xid_window_seconds:
                            recent[x.code] += x.count
                    # Like the real collector: an entity without Xids in the window gets one 0 without `xid`.
                    lines += [self._line(XID_COUNT, s, n, window | {"xid": str(code)})
                              for code, n in sorted(recent.items())] or [self._line(XID_COUNT, s, 0, window)]
                families.append((FieldSpec(XID_COUNT, "gauge", help_), lines))
            if "total" in self.xid_metrics:
                lines = []
                for s in self._series:
                    totals = Counter[int]()
                    for x in self._xids_of(s):
                        totals[x.code] += x.count
                    lines += [self._line(XID_TOTAL, s, n, {"xid": str(code)}) for code, n in sorted(totals.items())]
                families.append((FieldSpec(XID_TOTAL, "counter", "Total number of XID errors since exporter start."),
                                 lines))
        return "".join(f"# HELP {f.name} {f.help}\n# TYPE {f.name} {f.prom_type}\n" + "".join(lines)
                       for f, lines in families if lines)

    def response(self) -> tuple[int, str]:
        """What GET /metrics answers now, failure modes included: (HTTP status, body)."""
        if self.status != 200:
            return self.status, f"simulated dcgm-exporter failure (HTTP {self.status})\n"
        text = self.render()
        if self.malformed:  # cut mid-label, like a connection dropped halfway through the body
            marker = f'{self.uuid_label}="GPU-'
            cut = text.find(marker)
            return 200, text[:cut + len(marker)] if cut >= 0 else 'DCGM_FI_DEV_GPU_TEMP{gpu="0",UUID="GPU-'
        return 200, text

    def inject_query(self, query: str) -> None:
        """`gpu=<index or UUID>&xid=<code>[&count=N][&gpu_instance=I]`, as POST /inject takes it."""
        params = parse_qs(query, keep_blank_values=True)
        if unknown := set(params) - {"gpu", "xid", "count", "gpu_instance"}:
            raise ValueError(f"unknown parameters: {', '.join(sorted(unknown))}")
        single: dict[str, str] = {}
        for name, values in params.items():
            if len(values) != 1:
                raise ValueError(f"{name} given {len(values)} times")
            single[name] = values[0]
        if "gpu" not in single or "xid" not in single:
            raise ValueError("need gpu=<index or UUID> and xid=<code>")

        def integer(name: str) -> int | None:
            if name not in single:
                return None
            if not (single[name].isascii() and single[name].isdigit()):
                raise ValueError(f"{name} must be a non-negative integer, not {single[name]!r}")
            return int(single[name])

        count = integer("count")
        self.inject_xid(self.find_gpu(single["gpu"]).uuid, integer("xid") or 0, 1 if count is None else count,
                        gpu_instance=integer("gpu_instance"))


class _HttpServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], exporter: SimulatedDcgmExporter, stopping: threading.Event) -> None:
        self.exporter, self.stopping = exporter, stopping
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        """Bind without HTTPServer's reverse DNS lookup of the address (slow, or hanging, without DNS)."""
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that gave up (timeouts) is normal here; no traceback on stderr."""
        log.debug("simulated dcgm-exporter: error answering %s", client_address, exc_info=True)


class _HttpServer6(_HttpServer):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    server: _HttpServer
    protocol_version = "HTTP/1.1"
    timeout = 60  # idle keep-alive connections close eventually
    # Go's net/http (dcgm-exporter) sets TCP_NODELAY on every connection; without it the headers and body of an
    # answer on a kept-alive connection wait for the client's delayed ACK (~40 ms a scrape)
    disable_nagle_algorithm = True

    def do_GET(self) -> None:
        """GET /metrics, through the exporter's failure modes."""
        if urlsplit(self.path).path != "/metrics":
            self._reply(404, "404 page not found\n")
            return
        exporter = self.server.exporter
        if exporter.delay_seconds > 0:
            self.server.stopping.wait(exporter.delay_seconds)
        status, body = exporter.response()
        self._reply(status, body, CONTENT_TYPE if status == 200 else "text/plain; charset=utf-8")

    def do_POST(self) -> None:
        """POST /inject?gpu=..&xid=..: a demo convenience."""
        length = self.headers.get("Content-Length", "0")
        self.rfile.read(int(length) if length.isdigit() else 0)
        split = urlsplit(self.path)
        if split.path != "/inject":
            self._reply(404, "404 page not found\n")
            return
        try:
            self.server.exporter.inject_query(split.query)
        except ValueError as exc:
            self._reply(400, f"{exc}\n")
            return
        self._reply(204, "")

    def _reply(self, status: int, body: str, content_type: str = "text/plain; charset=utf-8") -> None:
        data = body.encode()
        self.send_response(status)
        if status != 204:
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        """Requests go to debug logging, not stderr."""
        log.debug("simulated dcgm-exporter: " + format, *args)


class DcgmExporterServer:
    """Serves a SimulatedDcgmExporter over HTTP (ThreadingHTTPServer in a daemon thread)."""

    def __init__(self, exporter: SimulatedDcgmExporter, host: str = "127.0.0.1", port: int = 0) -> None:
        self.exporter, self.host, self.port = exporter, host, port
        self.url = ""
        self._stopping = threading.Event()
        self._server: _HttpServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> str:
        """Bind and serve; returns the metrics URL (the bound port when asked for port 0). OSError if it cannot."""
        if self._server is None:
            self._stopping = threading.Event()
            server_class = _HttpServer6 if ":" in self.host else _HttpServer
            self._server = server_class((self.host, self.port), self.exporter, self._stopping)
            self.port = self._server.server_address[1]
            host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)  # noqa: S104
            self.url = f"http://{f'[{host}]' if ':' in host else host}:{self.port}/metrics"
            self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),  # prompt stop()
                                            name="dcgm-exporter-sim", daemon=True)
            self._thread.start()
            log.info("simulated dcgm-exporter serving %s", self.url)
        return self.url

    def stop(self) -> None:
        """Stop serving, wake delayed answers and close the socket."""
        self._stopping.set()
        if self._server is not None and self._thread is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join()
        self._server = self._thread = None

    def __enter__(self) -> DcgmExporterServer:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
