"""The jobs' files on disk (``app.jobs.store``): written whole or not at all, measured, checked
against the disk's free space, and swept when no row accounts for them.

A full disk is told apart from other failures (``storage_error``): the job or request it stops is
answered 507 (``StorageFull``), as one refused by the quota, not 503 as a store of the moment.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from collections.abc import Container
from pathlib import Path

from app.stores.database.errors import StoreUnavailable

MIB = 1024 * 1024
PARTIAL = ".partial"  # a file being written (``write_file``)
JOB_ID = re.compile(r"[A-Za-z0-9_-]{22}\Z")  # secrets.token_urlsafe(16): what the sweep may remove


class StorageFull(Exception):
    """The jobs' files would pass the quota, or the disk has too little room left (507)."""


def storage_error(what: str, e: OSError) -> Exception:
    """``StorageFull`` for a full disk (or the user's disk quota), else ``StoreUnavailable``."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageFull(f"{what}: the disk is full")
    return StoreUnavailable(f"{what}: {e.strerror or e}")


def disk_refusal(directory: Path, need: int, reserve: int) -> StorageFull | None:
    """A refusal if writing ``need`` more bytes under ``directory`` would leave less than
    ``reserve`` free on its disk (None: it would not)."""
    try:
        free = shutil.disk_usage(directory).free
    except OSError as e:
        raise StoreUnavailable(f"cannot see the disk's free space: {e.strerror or e}") from e
    if free - need < reserve:
        return StorageFull(
            f"the disk is nearly full ({free / MIB:.0f} MiB free, {reserve / MIB:.0f} MiB kept for the "
            "service's other stores): retry later"
        )
    return None


def write_file(path: Path, data: bytes) -> None:
    """``data`` at ``path``, whole or not at all (written beside it, synced, then renamed; the
    partial file removed if that fails)."""
    partial = path.with_name(path.name + PARTIAL)
    try:
        with open(partial, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def file_size(path: Path) -> int:
    """``path``'s size (0 if there is no such file)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def folder_size(folder: Path) -> int:
    """The bytes of the files directly in ``folder`` (0 if there is none)."""
    try:
        with os.scandir(folder) as entries:
            return sum(e.stat().st_size for e in entries if e.is_file(follow_symlinks=False))
    except FileNotFoundError:
        return 0


def sweep(directory: Path, jobs: Container[str], cutoff: float) -> int:
    """Remove under ``directory``, when last modified before ``cutoff`` (``time.time()``), each
    job directory whose id is not in ``jobs`` and each ``.partial`` file in the others; how many.
    Only names a job id may have are looked at (nothing else there is the jobs')."""
    removed = 0
    with os.scandir(directory) as entries:
        folders = [e for e in entries if JOB_ID.match(e.name) and e.is_dir(follow_symlinks=False)]
    for folder in folders:
        if folder.name not in jobs:
            if older(folder, cutoff):
                shutil.rmtree(folder.path, ignore_errors=True)
                removed += 1
            continue
        try:
            with os.scandir(folder.path) as files:
                stale = [f for f in files if f.name.endswith(PARTIAL) and older(f, cutoff)]
        except FileNotFoundError:  # deleted meanwhile
            continue
        for f in stale:
            Path(f.path).unlink(missing_ok=True)
            removed += 1
    return removed


def older(entry: os.DirEntry[str], cutoff: float) -> bool:
    """Whether ``entry`` was last modified before ``cutoff`` (False if it is gone meanwhile)."""
    try:
        return entry.stat(follow_symlinks=False).st_mtime < cutoff
    except FileNotFoundError:
        return False
