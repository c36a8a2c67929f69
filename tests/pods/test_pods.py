"""Pod sources: the file format, validation, and keeping the last good list when a file goes bad."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from agent.pods.model import Pod, PodListError, make_pod, parse_pods
from agent.pods.source import FilePodSource


def test_parse_normalises_addresses_and_keeps_names_verbatim() -> None:
    pods = parse_pods({"pods": [{"namespace": "ns", "name": 'p"; rm -rf /', "ips": ["10.1.2.3", "FD00:0::3",
                                                                                    "fd00::3"]},
                                {"namespace": "ns", "name": "no-ip"}]})
    assert pods == [Pod("ns", 'p"; rm -rf /', ("10.1.2.3", "fd00::3")), Pod("ns", "no-ip", ())]


@pytest.mark.parametrize(("data", "message"), [
    ([], "object with a"),
    ({"pods": [{"namespace": "ns", "name": "p", "ips": ["10.1.2.3; reboot"]}]}, "is not an IP address"),
    ({"pods": [{"namespace": "", "name": "p"}]}, "non-empty strings"),
    ({"pods": [{"namespace": "ns", "name": "p", "ips": "10.1.2.3"}]}, "list of strings"),
    ({"pods": [{"namespace": "ns", "name": "p"}, {"namespace": "ns", "name": "p"}]}, "listed twice"),
    ({"pods": ["p"]}, "expected an object"),
])
def test_invalid_lists_are_rejected(data: object, message: str) -> None:
    with pytest.raises(PodListError, match=message):
        parse_pods(data)


def test_make_pod_rejects_bad_addresses() -> None:
    with pytest.raises(PodListError):
        make_pod("ns", "p", ["fd00::/8"])


def test_file_source_keeps_the_last_good_list(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "pods.json"
    source = FilePodSource(str(path))
    with caplog.at_level(logging.WARNING):
        assert not source.poll()
    assert "unreadable" in caplog.text and source.snapshot() == (0, None)
    path.write_text(json.dumps({"pods": [{"namespace": "ns", "name": "a", "ips": ["10.0.0.1"]}]}))
    assert source.poll()
    version, pods = source.snapshot()
    assert pods == (Pod("ns", "a", ("10.0.0.1",)),)
    assert not source.poll()  # unchanged file: nothing published
    path.write_text('{"pods": [{"namespace": "ns", "name": "a", "ips": ["not-an-ip"]}]}')
    assert not source.poll()
    assert "invalid" in caplog.text and source.snapshot() == (version, pods)
    path.write_text(json.dumps({"pods": []}))
    assert source.poll() and source.snapshot() == (version + 1, ())
