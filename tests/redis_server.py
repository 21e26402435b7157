"""A real Redis for the tests (Debian's ``redis-server``, which .ci/run installs): started on a free
port with nothing saved to disk, stopped when the block ends. Never a mock: the usage store's
atomicity is Redis running each script alone, which only a real server shows."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import under_ci
from tests.test_server import free_port

START_TIMEOUT_S = 10.0


@dataclass
class RedisServer:
    process: subprocess.Popen[bytes]
    port: int
    directory: Path

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)


def redis_binary() -> str:
    path = shutil.which("redis-server")
    if path is None:
        if under_ci():
            pytest.fail("redis-server is not installed (.ci/run installs it)")
        pytest.skip("redis-server is not installed here (apt-get install redis-server)")
    return path


def start_redis(directory: Path, port: int | None = None) -> RedisServer:
    """A redis-server on 127.0.0.1 (``port``, or a free one), ready for commands."""
    port = port or free_port()
    directory.mkdir(parents=True, exist_ok=True)
    command = [
        redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
        "--dir", str(directory), "--logfile", str(directory / "redis.log"),
    ]  # fmt: skip
    server = RedisServer(subprocess.Popen(command), port, directory)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return server
        except OSError:
            time.sleep(0.05)
    server.stop()
    raise RuntimeError(f"redis-server did not start on port {port}: see {directory / 'redis.log'}")


@contextmanager
def running_redis(directory: Path) -> Iterator[RedisServer]:
    server = start_redis(directory)
    try:
        yield server
    finally:
        server.stop()
