"""Atomic directory writes: stage in ``DST.tmp-<token>``, fsync, rename; refuse staging dirs on read.

A staging directory holds the incomplete marker for as long as it exists: it is made under a hidden name,
marked, and only then renamed to its staging name; the marker is removed just before the final rename (with
SIGINT/SIGTERM held), and deleted last when the directory is removed. Its name records the writer
(``DST.tmp-<host>-<pid>-<random>``), so a later write to the same destination removes staging directories (and
hidden ones not yet renamed) whose writer died (SIGKILL, power loss).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import socket
import uuid
import zlib

from jaxquant.checkpoint import interrupt
from jaxquant.checkpoint.errors import (CheckpointNotFoundError, DestinationError, DestinationExistsError,
                                        IncompleteCheckpointError)

# Present in a staging directory from its creation until just before the final rename. A directory that
# still has it (e.g. after a SIGKILL) is refused by inspect/load; it is safe to delete.
INCOMPLETE_MARKER = ".jaxquant-incomplete"
# This host, in staging directory names (a short hash: host names may hold any character).
HOST_TAG = "%08x" % zlib.crc32(socket.gethostname().encode())
_OWNED_TOKEN = re.compile(r"(?P<host>[0-9a-f]{8})-(?P<pid>[0-9]+)-[0-9a-f]{8}")

# errno -> the cause in our words
_CAUSES = {errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
           errno.EPERM: "operation not permitted", errno.ENOENT: "a directory on the way does not exist",
           errno.ENOTDIR: "a component of the path is not a directory", errno.ENOSPC: "no space left on the device",
           errno.EDQUOT: "disk quota exceeded", errno.ENAMETOOLONG: "the path is too long"}


def os_error_cause(e: OSError) -> str:
    return _CAUSES.get(e.errno, e.strerror or str(e))


def check_destination(dst: str) -> None:
    """A destination must not exist, or be an empty directory (not a link to one)."""
    if not os.path.lexists(dst):
        return
    if os.path.islink(dst):
        what = "is a symbolic link"
    elif not os.path.isdir(dst):
        what = "is a file" if os.path.isfile(dst) else "exists and is not a directory"
    elif os.listdir(dst):
        what = "is a directory that is not empty"
    else:
        return
    raise DestinationExistsError(f"{dst}: the destination {what}; refusing to overwrite it (remove it or choose "
                                 f"another path)")


def staging_path(dst: str, token: str | None = None) -> str:
    """``DST.tmp-<token>``; without a token one naming this host and process (see remove_stale_staging)."""
    dst = os.path.abspath(dst)
    return f"{dst}.tmp-{token or _owned_token()}"


def _owned_token() -> str:
    """``<host>-<pid>-<random>``: names this process as a directory's writer (``_OWNED_TOKEN``, ``_writer_is_gone``)."""
    return f"{HOST_TAG}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def make_staging(path: str, dst: str, exist_ok: bool = False) -> None:
    """Create the staging directory ``path`` of destination ``dst`` with its marker in it (errors name ``dst``).

    The directory is made under a hidden name owned by this process, marked, then renamed to ``path``, so no
    process (a reader, the next writer) ever sees ``path`` without its marker, even if a SIGKILL lands between the
    ``mkdir`` and the marker's write. With ``exist_ok`` (the processes of one save all create ``path``), the first
    rename wins and the others drop their own copy.
    """
    fresh = None
    try:
        if not (exist_ok and os.path.isdir(path)):   # (else another process of the same save made it, marked)
            if os.path.lexists(path):
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path)
            parent, name = os.path.split(path)
            fresh = os.path.join(parent, f".{name}.{_owned_token()}")
            with interrupt.deferred():  # a handler that raises anywhere must not strand the hidden directory
                os.makedirs(fresh)  # with the destination's missing parents
                try:
                    _write_marker(fresh)
                    os.rename(fresh, path)  # replaces nothing but an empty directory; fails on a marked one
                except OSError:
                    remove_staging(fresh)
                    if not (exist_ok and os.path.isdir(path)):  # not another process of the same save
                        raise
        if not os.path.exists(os.path.join(path, INCOMPLETE_MARKER)):   # one found unmarked (exist_ok) is marked now
            _write_marker(path)
        interrupt.stage("staging")
    except OSError as e:
        hidden = fresh is not None and str(e.filename or "").startswith(fresh)
        made = e.filename if e.filename and not hidden else path   # the staging path, never its hidden first name
        raise DestinationError(f"{dst}: cannot write the destination: {os_error_cause(e)} (creating {made})") from e


def _write_marker(directory: str) -> None:
    with open(os.path.join(directory, INCOMPLETE_MARKER), "w") as f:
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
    with interrupt.deferred():  # unmarked but not yet renamed: no signal may land in between
        interrupt.stage("commit")
        interrupt.check()  # the last moment a signal still cancels the write
        if os.path.exists(marker):
            os.unlink(marker)
        try:
            if os.path.isdir(dst):
                os.rmdir(dst)  # empty (checked above); rename cannot replace a directory on every platform
            os.rename(staging, dst)
        except BaseException:
            open(marker, "w").close()
            raise
        interrupt.stage("renamed")  # complete: a signal from here on is raised when the write returns
    if sync:
        fsync_dir(os.path.dirname(os.path.abspath(dst)) or ".")


def remove_staging(path: str) -> None:
    """Delete a staging directory, its marker last, so that it is marked for as long as it exists.

    Best effort and silent (it runs while another error propagates): what cannot be deleted stays marked.
    """
    interrupt.stage("cleanup")
    for _ in range(5):  # retried: a writer may still add a file while we delete
        try:
            names = os.listdir(path)
        except OSError:  # gone, never created, or unreadable
            return
        for name in names:
            if name == INCOMPLETE_MARKER:
                continue
            p = os.path.join(path, name)
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p, ignore_errors=True)
            else:
                try:
                    os.unlink(p)
                except OSError:
                    pass
        try:
            if set(os.listdir(path)) <= {INCOMPLETE_MARKER}:
                if os.path.exists(os.path.join(path, INCOMPLETE_MARKER)):
                    os.unlink(os.path.join(path, INCOMPLETE_MARKER))
                os.rmdir(path)
                return
        except OSError:
            continue


def _writer_is_gone(token: str) -> bool:
    m = _OWNED_TOKEN.fullmatch(token)
    if m is None or m["host"] != HOST_TAG:
        return False  # a multi-process save's directory, or another host's: not ours to judge
    pid = int(m["pid"])
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def remove_stale_staging(dst: str) -> list[str]:
    """Remove staging directories of ``dst`` left by writers on this host that no longer run; their paths."""
    dst = os.path.abspath(dst)
    parent, prefix = os.path.dirname(dst), os.path.basename(dst) + ".tmp-"
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    removed = []
    for name in names:
        if name.startswith(prefix):
            owner = name[len(prefix):]
        elif name.startswith("." + prefix):  # make_staging's hidden directory, not yet renamed
            owner = name.rsplit(".", 1)[-1]
        else:
            continue
        if _writer_is_gone(owner):
            remove_staging(os.path.join(parent, name))
            removed.append(os.path.join(parent, name))
    return removed


def check_source_dir(path: str, what: str = "checkpoint") -> None:
    """A checkpoint to read must be an existing, complete directory."""
    if not os.path.exists(path):
        raise CheckpointNotFoundError(f"{path}: {what} directory does not exist")
    if not os.path.isdir(path):
        raise CheckpointNotFoundError(f"{path}: {what} path is not a directory")
    check_complete(path)


def check_complete(path: str) -> None:
    if os.path.exists(os.path.join(path, INCOMPLETE_MARKER)):
        raise IncompleteCheckpointError(
            f"{path}: staging directory of an interrupted or in-progress write ({INCOMPLETE_MARKER} present); "
            f"not a checkpoint")
