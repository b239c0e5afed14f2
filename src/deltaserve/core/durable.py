"""Durable writes: what survives a power loss, not only a process crash. A file's data needs an
fsync of the file; a create or a rename needs an fsync of the directory holding the entry."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (a create, a rename) durable, not only the files' data."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
