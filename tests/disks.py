"""Small file systems for tests of disk trouble: a tmpfs of a few MiB that a test fills up, and read-only views of
its directories (a bind mount remounted read-only: the kernel's answer is EROFS, which root cannot bypass as it can
a directory's permissions). Needs root and mount(8); ``tiny_disk`` skips the test otherwise."""

from __future__ import annotations

import errno
import os
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, List

import pytest


def _sh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=30)


class TinyDisk:
    """A tmpfs mounted at ``path``; ``fill``/``free`` use up and give back its space, ``read_only(directory)``
    makes one of its directories read-only (and ``writable`` undoes it); ``close`` unmounts everything."""

    def __init__(self, path: Path, size: str) -> None:
        self.path = path
        self._mounts: List[Path] = []
        path.mkdir(parents=True, exist_ok=True)
        done = _sh("mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path))
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}): disk-trouble tests need root")
        self._mounts.append(path)

    def fill(self) -> None:
        """Write a filler file until the file system is full."""
        chunk = b"\0" * 65536
        with open(self.path / "filler", "wb", buffering=0) as f:  # unbuffered: closing has nothing left to write
            try:
                while f.write(chunk):
                    pass
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise

    def free(self) -> None:
        (self.path / "filler").unlink(missing_ok=True)

    def read_only(self, directory: Path) -> None:
        for args in (("--bind", str(directory), str(directory)), ("-o", "remount,bind,ro", str(directory))):
            done = _sh("mount", *args)
            assert done.returncode == 0, done.stderr
        self._mounts.append(directory)

    def writable(self) -> None:
        while len(self._mounts) > 1:
            _sh("umount", str(self._mounts.pop()))

    def close(self) -> None:
        self.writable()
        _sh("umount", "-l", str(self.path))


@contextmanager
def tiny_disk(path: Path, size: str = "2m") -> Iterator[TinyDisk]:
    if os.geteuid() != 0:
        pytest.skip("disk-trouble tests mount a tmpfs: run them as root")
    disk = TinyDisk(path, size)
    try:
        yield disk
    finally:
        disk.close()
