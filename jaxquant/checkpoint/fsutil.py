"""Atomic directory writes: stage in ``DST.tmp-<token>``, fsync, rename; refuse staging dirs on read."""

from __future__ import annotations

import os
import shutil
import uuid

from jaxquant.checkpoint.errors import DestinationExistsError, IncompleteCheckpointError

# Present in a staging directory from its creation until just before the final rename. A directory that
# still has it (e.g. after a SIGKILL) is refused by inspect/load; it is safe to delete.
INCOMPLETE_MARKER = ".jaxquant-incomplete"


def check_destination(dst: str) -> None:
    """A destination must not exist, or be an empty directory."""
    if os.path.lexists(dst) and not (os.path.isdir(dst) and not os.path.islink(dst) and not os.listdir(dst)):
        raise DestinationExistsError(f"{dst}: destination exists and is not an empty directory; "
                                     f"refusing to overwrite (remove it or choose another path)")


def staging_path(dst: str, token: str | None = None) -> str:
    dst = os.path.abspath(dst)
    return f"{dst}.tmp-{token or uuid.uuid4().hex[:12]}"


def make_staging(path: str, exist_ok: bool = False) -> None:
    os.makedirs(path, exist_ok=exist_ok)
    marker = os.path.join(path, INCOMPLETE_MARKER)
    if not os.path.exists(marker):
        with open(marker, "w") as f:
            f.write("interrupted or in-progress jaxquant checkpoint write; safe to delete\n")


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str) -> None:
    for root, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(root)


def commit(staging: str, dst: str, *, sync: bool = True) -> None:
    """Make ``staging`` become ``dst`` atomically (after the data is durable)."""
    check_destination(dst)
    if sync:
        fsync_tree(staging)
    marker = os.path.join(staging, INCOMPLETE_MARKER)
    if os.path.exists(marker):
        os.unlink(marker)
    if os.path.isdir(dst):
        os.rmdir(dst)  # empty (checked above); rename cannot replace a directory on every platform
    os.rename(staging, dst)
    if sync:
        fsync_dir(os.path.dirname(os.path.abspath(dst)) or ".")


def remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def check_complete(path: str) -> None:
    if os.path.exists(os.path.join(path, INCOMPLETE_MARKER)):
        raise IncompleteCheckpointError(
            f"{path}: staging directory of an interrupted or in-progress write ({INCOMPLETE_MARKER} present); "
            f"not a checkpoint")
