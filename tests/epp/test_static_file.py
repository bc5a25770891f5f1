from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from epp.datalayer.endpoints import EndpointStore
from epp.datalayer.static_file import EndpointsFileError, StaticFileSource, load_endpoints
from tests.support import eventually


def write(path: Path, text: str, bump: float = 0.0) -> None:
    path.write_text(text)
    if bump:
        stat = path.stat()
        os.utime(path, (stat.st_atime + bump, stat.st_mtime + bump))


def test_load_with_default_names(tmp_path: Path) -> None:
    path = tmp_path / "e.yaml"
    write(path, "endpoints:\n- {address: 10.0.0.1, port: 80}\n- {name: b, address: '::1', port: 81}\n")
    endpoints = load_endpoints(path)
    assert [e.name for e in endpoints] == ["10.0.0.1:80", "b"]
    assert endpoints[1].hostport == "[::1]:81"


@pytest.mark.parametrize(
    "text",
    [
        "endpoints: [{address: my-host, port: 80}]",
        "endpoints: [{address: 10.0.0.1, port: 0}]",
        "endpoints: [{name: a, address: 10.0.0.1, port: 1}, {name: a, address: 10.0.0.2, port: 1}]",
        "nodes: []",
        "endpoints: [",
    ],
)
def test_invalid_files_are_rejected(tmp_path: Path, text: str) -> None:
    path = tmp_path / "e.yaml"
    write(path, text)
    with pytest.raises(EndpointsFileError):
        load_endpoints(path)


async def test_reload_on_change_and_keep_last_good_set(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "e.yaml"
    write(path, "endpoints: [{name: a, address: 10.0.0.1, port: 80}]")
    store = EndpointStore()
    removed: list[str] = []
    store.subscribe(on_removed=lambda e: removed.append(e.name))
    source = StaticFileSource(path, store, poll_interval=0.01)
    source.load()
    watcher = asyncio.create_task(source.watch())
    try:
        write(path, "endpoints: [{name: b, address: 10.0.0.2, port: 80}]", bump=1)
        await eventually(lambda: [s.name for s in store.all()] == ["b"], what="the reload")
        assert removed == ["a"]
        write(path, "endpoints: [{name: c, address: not-an-ip, port: 80}]", bump=2)
        # Evidence that the watcher read the bad file: it logs that it keeps the previous set.
        await eventually(lambda: any("keeping the previous" in r.getMessage() for r in caplog.records))
        assert [s.name for s in store.all()] == ["b"]
    finally:
        watcher.cancel()
