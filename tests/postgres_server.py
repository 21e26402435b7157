"""A real PostgreSQL for the tests (Debian's ``postgresql``, which .ci/run installs): a cluster made
by ``initdb`` in a temporary directory, started on a free port, fsync off (nothing here must outlive
the test run), stopped when the block ends. Run as the ``postgres`` user when the tests run as
root (PostgreSQL refuses root). Never a mock: row locks, ``SKIP LOCKED`` and advisory locks are
what the job store counts on, and only a real server has them."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import under_ci
from tests.test_server import free_port

START_TIMEOUT_S = 30.0


def postgres_bin() -> Path:
    """The directory of ``initdb`` and ``pg_ctl``: on PATH, or Debian's /usr/lib/postgresql/N/bin."""
    found = shutil.which("initdb")
    if found is not None:
        return Path(found).resolve().parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if not versions:
        if under_ci():
            pytest.fail("PostgreSQL is not installed (.ci/run installs Debian's postgresql)")
        pytest.skip("PostgreSQL is not installed here (apt-get install postgresql)")
    return Path(versions[-1]).parent


def as_postgres(command: list[str]) -> list[str]:
    """``command`` run as the ``postgres`` user when this process is root."""
    return ["runuser", "-u", "postgres", "--", *command] if os.geteuid() == 0 else command


@dataclass
class PostgresServer:
    directory: Path  # the cluster's data and its log
    port: int

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _pg_ctl(self, *args: str) -> None:
        command = [str(postgres_bin() / "pg_ctl"), "-D", str(self.directory / "data"), *args]
        subprocess.run(as_postgres(command), check=True, capture_output=True, timeout=START_TIMEOUT_S + 5)

    def start(self) -> None:
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={self.directory} "
            "-c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
        )
        log = str(self.directory / "log")
        self._pg_ctl("-w", "-t", str(int(START_TIMEOUT_S)), "-l", log, "-o", options, "start")

    def stop(self, mode: str = "fast") -> None:
        self._pg_ctl("-w", "-m", mode, "stop")

    def restart(self) -> None:
        self.stop()
        self.start()


def start_postgres(directory: Path) -> PostgresServer:
    """A new cluster under ``directory``, started on a free port, its ``postgres`` database open to
    the ``postgres`` user without a password (trust, on 127.0.0.1 only)."""
    directory.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        shutil.chown(directory, "postgres", "postgres")
    command = [str(postgres_bin() / "initdb"), "-D", str(directory / "data"), "-U", "postgres", "-A", "trust"]
    subprocess.run(as_postgres([*command, "-E", "UTF8", "--no-sync"]), check=True, capture_output=True)
    server = PostgresServer(directory, free_port())
    server.start()
    return server


def reset(url: str) -> None:
    """Every table of the database dropped: a test starts from an empty database."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as db:
        db.execute("DROP SCHEMA public CASCADE")
        db.execute("CREATE SCHEMA public")


@contextmanager
def running_postgres(directory: Path) -> Iterator[PostgresServer]:
    server = start_postgres(directory)
    try:
        yield server
    finally:
        with suppress(subprocess.CalledProcessError):
            server.stop("immediate")
