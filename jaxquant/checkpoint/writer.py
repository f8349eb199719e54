"""Writing DCP directories: :class:`DcpWriter`, :func:`save_dcp` and the multi-process :func:`finalize_dcp`."""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import numbers
import os
import time
from typing import Iterable

import jax
import numpy as np

from jaxquant.checkpoint import dtypes as dt
from jaxquant.checkpoint import fsutil, interrupt, torchsave
from jaxquant.checkpoint.errors import CheckpointError, CoverageError
from jaxquant.checkpoint.layout import coverage_problems, index_to_box
from jaxquant.checkpoint.metadata import (METADATA_FILE, BytesEntry, Chunk, DcpMetadata, StorageInfo, TensorEntry,
                                          encode_metadata)
from jaxquant.checkpoint.progress import Progress
from jaxquant.checkpoint.quantnp import check_nvfp4_scale_layout
from jaxquant.checkpoint.safepickle import dumps
from jaxquant.checkpoint.tree import (QUANT_INFO_KEY, TransposeMap, components, flatten, is_quantized,
                                      is_value_list, quant_info)
from jaxquant.primitives.tensors import NVFP4Tensor

_PLAN_SUFFIX = ".jaxquant-plan.json"
# The processes of a multi-process save meet through files in its staging directory, which they all write to (one
# shared file system): JAX's own barrier (multihost_utils.sync_global_devices) waits forever for a process that is
# gone, and the distributed client's timed barriers and key-value store are not public JAX API (jax 0.10/0.11).
# The first process to decide creates this file (O_EXCL): "commit" (process 0, every plan present) or
# "abort <rank>: <why>" (a failure or a timeout), so a process that gives up never removes what process 0 commits.
_DECISION = ".jaxquant-decision"
_POLL_MAX_S = 0.5  # longest sleep between two looks at the staging directory
# staging gone and no .metadata at the destination: how long to take it for a rename not yet visible here
# (file systems that cache directory entries) before calling the save aborted
_GONE_GRACE_S = 2.0


@dataclasses.dataclass
class LocalShards:
    """A leaf for :func:`save_dcp`: this process's blocks of a global tensor, as host arrays.

    Use it for data that is not a ``jax.Array`` (or to drive a multi-process save from separate
    processes); all processes' blocks together must tile ``shape`` exactly (checked when the metadata is
    written).

    Attributes:
      shape: the global tensor's shape.
      dtype: its dtype (numpy or ml_dtypes).
      shards: ``[(global offsets, numpy array)]``, this process's blocks.
    """

    shape: tuple
    dtype: object
    shards: list


class DcpWriter:
    """Appends torch.save records for one process to ``<dir>/__<rank>_0.distcp`` and tracks the metadata."""

    def __init__(self, directory: str, rank: int = 0):
        self.directory, self.rank = directory, rank
        self.rel = f"__{rank}_0.distcp"
        self.file = open(os.path.join(directory, self.rel), "wb")
        self.entries: dict = {}
        self.planner: dict = {}

    def declare_tensor(self, key: str, np_dtype, size, parts=None) -> None:
        self.entries[key] = TensorEntry(key, dt.to_torch_name(np_dtype, what=f"key {key!r}"),
                                        tuple(int(s) for s in size), [])
        self.planner[key] = tuple(parts or (key,))

    def write_chunk(self, key: str, offsets, arr: np.ndarray) -> int:
        e = self.entries[key]
        offset = self.file.tell()
        length = torchsave.write_tensor(self.file, arr, e.dtype)
        e.chunks.append(Chunk(tuple(int(o) for o in offsets), tuple(int(s) for s in arr.shape),
                              StorageInfo(self.rel, offset, length)))
        return arr.nbytes

    def write_value(self, key: str, pickled: bytes, parts=None) -> None:
        offset = self.file.tell()
        length = torchsave.write_value(self.file, pickled)
        self.entries[key] = BytesEntry(key, StorageInfo(self.rel, offset, length))
        self.planner[key] = tuple(parts or (key,))

    def close(self, sync: bool = True) -> None:
        if not self.file.closed:
            self.file.flush()
            if sync:
                os.fsync(self.file.fileno())
            self.file.close()

    def metadata(self) -> DcpMetadata:
        return DcpMetadata(dict(self.entries), dict(self.planner))


def write_metadata(directory: str, md: DcpMetadata, checkpoint_id: str) -> None:
    """Check every tensor's coverage, then write ``.metadata``."""
    for e in md.entries.values():
        if isinstance(e, TensorEntry):
            problems = coverage_problems(e)
            if problems:
                raise CoverageError(f"key {e.key!r}: chunks do not tile shape {e.size}: {'; '.join(problems)}")
    with open(os.path.join(directory, METADATA_FILE), "wb") as f:
        f.write(encode_metadata(md, checkpoint_id))
        f.flush()
        os.fsync(f.fileno())


# ------------------------------------------------------------------------------------------- save

@functools.partial(jax.jit, static_argnames="dtype")
def _dequantized(q, dtype):
    """``q.dequantize(dtype)`` as one compiled program (op-by-op dispatch over sharded components is slow)."""
    return q.dequantize(dtype)


def _plan(tree, transpose: TransposeMap, dequantize, rank: int):
    """[(key, parts, kind, payload)]: kind 'value' (pickled bytes) or 'array' (dtype, shape, chunk list)."""
    items, _ = flatten(tree, "save_dcp: tree")
    out, quant = [], {}
    for key, parts, leaf in items:
        if is_quantized(leaf):
            if dequantize is not None:  # a plain array from here on (may be transposed)
                if isinstance(leaf, NVFP4Tensor):
                    check_nvfp4_scale_layout(key, leaf.shape, leaf.scale_inv.shape)
                out.append((key, parts, _dequantized(leaf, jax.numpy.dtype(dequantize))))
                continue
            transpose.check(key, (), quantized=True)
            quant[key] = quant_info(leaf)
            out += [(key + suffix, parts[:-1] + (parts[-1] + suffix,), v) for _, suffix, v in components(leaf)]
        else:
            out.append((key, parts, leaf))
    plan = []
    for key, parts, leaf in out:
        if isinstance(leaf, (bool, int, float, str)) or leaf is None or is_value_list(leaf):
            plan.append((key, parts, "value", dumps(leaf)))
            continue
        if isinstance(leaf, np.generic):
            leaf = np.asarray(leaf)
        if isinstance(leaf, LocalShards):
            shape = tuple(int(d) for d in leaf.shape)
            dt.to_torch_name(leaf.dtype, what=f"save_dcp: key {key!r}")
            for off, a in leaf.shards:
                if np.dtype(a.dtype) != np.dtype(leaf.dtype) or len(off) != len(shape):
                    raise CheckpointError(f"save_dcp: key {key!r}: shard at {off} is {a.dtype}{list(a.shape)}, "
                                          f"tensor is {np.dtype(leaf.dtype)}{list(shape)}")
            plan.append((key, parts, "array", (np.dtype(leaf.dtype), shape,
                                               [(tuple(o), a) for o, a in leaf.shards], transpose.check(key, shape))))
            continue
        if not isinstance(leaf, (jax.Array, np.ndarray)):
            raise CheckpointError(f"save_dcp: key {key!r}: cannot store a {type(leaf).__name__} "
                                  f"(arrays, Float8Tensor/NVFP4Tensor, int, float, bool, str only)")
        dt.to_torch_name(leaf.dtype, what=f"save_dcp: key {key!r}")
        shape = tuple(int(d) for d in leaf.shape)
        tr = transpose.check(key, shape)
        if isinstance(leaf, jax.Array):
            chunks = [(index_to_box(s.index, shape)[0], s) for s in leaf.addressable_shards if s.replica_id == 0]
        else:
            chunks = [((0,) * len(shape), leaf)] if rank == 0 else []
        plan.append((key, parts, "array", (leaf.dtype, shape, chunks, tr)))
    if quant:
        plan.append((QUANT_INFO_KEY, (QUANT_INFO_KEY,), "value", dumps({"version": 1, "quantized": quant})))
    transpose.finish()
    return plan


def _host(x) -> tuple[np.ndarray, bool]:
    """A chunk's data as a host array, and whether it is a copy of a device buffer (not a CPU array's view).

    No copy is left behind: ``np.asarray`` of a ``jax.Array`` whose bytes it had to copy to the host (a GPU shard)
    keeps that copy cached on the array object, here the caller's own shard, for as long as the caller keeps the
    array (after the save too), so a save would end up holding the whole tree on the host. Converting a fresh
    ``jax.Array`` over the same device buffer caches the copy on the fresh object instead, which goes with it."""
    a = x.data if hasattr(x, "replica_id") else x
    if not isinstance(a, jax.Array) or len(a.sharding.device_set) != 1:
        return np.asarray(a), False
    copied = next(iter(a.sharding.device_set)).platform != "cpu"
    return np.asarray(jax.make_array_from_single_device_arrays(a.shape, a.sharding, [a])), copied


def _write_plan(w: DcpWriter, plan, rank: int, progress: Progress) -> None:
    for key, parts, kind, payload in plan:
        interrupt.stage("entry")
        interrupt.check()  # between entries and between chunks: nothing is in flight there
        if kind == "value":
            if rank == 0:
                w.write_value(key, payload, parts)
            continue
        dtype, shape, chunks, tr = payload
        w.declare_tensor(key, dtype, shape[::-1] if tr else shape, parts)
        for offsets, src in chunks:
            arr, copied = _host(src)
            if tr:  # JAX [in, out] -> stored [out, in]
                arr, offsets = np.ascontiguousarray(arr.T), offsets[::-1]
            progress.update(w.write_chunk(key, offsets, arr))
            del arr  # host memory: one chunk at a time (plus its transpose)
            if copied:  # a device buffer's host copy is freed only by the garbage collector (jaxlib 0.11, GPU)
                gc.collect(1)
            interrupt.stage("chunk")
            interrupt.check()


def save_dcp(path: str, tree, *, transpose: Iterable[str] | str = (), dequantize=None,
             process_index: int | None = None, process_count: int | None = None, save_id: str | None = None,
             finalize: bool = True, progress: bool = False, barrier_timeout_s: float = 600.0) -> str:
    """Write ``tree`` as a PyTorch Distributed Checkpoint directory at ``path``.

    The directory is written atomically: under a staging name, renamed once complete; an exception,
    SIGINT or SIGTERM removes the staging directory.

    Multi-process: every process calls this with the same ``save_id``; each writes
    ``__<rank>_0.distcp`` plus a plan file into ``<path>.tmp-<save_id>``. With ``finalize=True`` under a
    real JAX multi-process runtime the processes wait for each other through files in that directory (it must
    be on a file system they all see) and process 0 merges the plans into one ``.metadata`` and renames the
    directory; a failure or timeout on any process aborts the save on all of them and removes the directory.
    With ``finalize=False`` the caller must call :func:`finalize_dcp` once after all processes have returned.

    Args:
      path: the checkpoint directory; it must not exist, or be an empty directory.
      tree: a pytree whose leaves are ``jax.Array`` (one chunk per addressable shard with
        ``replica_id == 0``, at its global offsets), numpy arrays, :class:`LocalShards`,
        ``Float8Tensor``/``NVFP4Tensor`` (stored as components, see docs/checkpoint.md), or Python
        int/float/bool/str (DCP byte entries). Keys are the tree paths joined with '.'.
      transpose: fnmatch pattern(s) of 2-D keys stored as the transpose (JAX ``[in, out]`` -> PyTorch
        ``[out, in]``; default none).
      dequantize: a dtype (e.g. ``jnp.bfloat16``): store quantized tensors dequantized to it, as one
        tensor of their logical shape (default None: as components).
      process_index, process_count: this process's rank and the number of processes (default None: JAX's
        ``jax.process_index()`` / ``jax.process_count()``).
      save_id: the id every process of one save shares (default None: drawn by process 0 and broadcast
        through a JAX collective; required when ``process_count`` is given explicitly).
      finalize: commit the checkpoint here (default True); False leaves the staging directory for
        :func:`finalize_dcp`.
      progress: print a progress bar on stderr (default False).
      barrier_timeout_s: multi-process saves with ``finalize=True``: how long one process waits for the others
        at each barrier, in seconds: "written" (every process wrote its part) and "final" (process 0 committed
        the checkpoint). A process that died or never calls ``save_dcp`` then makes the others raise
        :class:`CheckpointError` naming the barrier instead of waiting forever, with nothing left at ``path``.
        Set it above the longest gap between processes finishing their writes, and above the time process 0's
        commit (an fsync of every file) takes. Not covered: with ``save_id=None`` the processes first agree on
        an id through a JAX collective, which has no timeout (pass ``save_id``, e.g. the step, to bound every
        wait); and ``jax.distributed`` itself terminates every process once one stops sending heartbeats
        (``heartbeat_timeout_seconds`` of ``jax.distributed.initialize``, 100 s by default), before a longer
        timeout here runs out. Default 600 s.

    Returns:
      The final path, or the staging path when the caller must still run :func:`finalize_dcp`.

    Raises:
      DestinationExistsError: ``path`` exists and is not an empty directory.
      CheckpointError: a bad argument or leaf, a barrier timeout, or another process's failure (and its
        subclasses for what they name).
      Interrupted: SIGINT or SIGTERM during the write (a ``KeyboardInterrupt``), after the cleanup.
    """
    rank = jax.process_index() if process_index is None else int(process_index)
    count = jax.process_count() if process_count is None else int(process_count)
    if not 0 <= rank < count:
        raise CheckpointError(f"save_dcp: process_index {rank} not in [0, {count})")
    if isinstance(barrier_timeout_s, bool) or not isinstance(barrier_timeout_s, numbers.Real) \
            or not barrier_timeout_s > 0:
        raise CheckpointError(f"save_dcp: barrier_timeout_s must be a number of seconds > 0, got {barrier_timeout_s!r}")
    with interrupt.default_signals_clean_up():
        return _save(path, tree, transpose, dequantize, rank, count, save_id, finalize, progress,
                     float(barrier_timeout_s))


def _draw_save_id() -> str:
    """Process 0's random id, the same on every process: from os.urandom, so the user's numpy RNG is untouched
    (``np.random`` would advance it, and two runs seeded alike would draw the same id)."""
    from jax.experimental import multihost_utils
    words = np.frombuffer(os.urandom(8), np.uint32) if jax.process_index() == 0 else np.zeros(2, np.uint32)
    return "".join("%08x" % int(w) for w in np.asarray(multihost_utils.broadcast_one_to_all(words)))


def _save(path, tree, transpose, dequantize, rank, count, save_id, finalize, progress, barrier_timeout_s) -> str:
    fsutil.check_destination(path)
    plan = _plan(tree, TransposeMap(transpose), dequantize, rank)
    if count > 1 and save_id is None:
        if jax.process_count() != count:
            raise CheckpointError("save_dcp: save_id is required when process_count is given explicitly")
        save_id = _draw_save_id()
    staging = fsutil.staging_path(path, save_id)
    total = sum(_host_nbytes(c) for *_, kind, p in plan if kind == "array" for _, c in p[2])
    together = finalize and jax.process_count() == count > 1  # the processes meet here (else finalize_dcp does)
    try:
        if count == 1:
            fsutil.remove_stale_staging(path)
        fsutil.make_staging(staging, path, exist_ok=count > 1)
        w = DcpWriter(staging, rank)
        with Progress(total, "save_dcp", enabled=progress) as bar:
            try:
                _write_plan(w, plan, rank, bar)
            except BaseException:
                w.close(sync=False)
                raise
            w.close()
        if count == 1:
            write_metadata(staging, w.metadata(), os.path.abspath(path))
            fsutil.commit(staging, path)
            return path
        _write_rank_plan(staging, rank, w)
    except BaseException as e:
        if count == 1:
            fsutil.remove_staging(staging)
        elif together:
            other = _give_up(path, staging, rank, e)
            if other is not None and isinstance(e, OSError):  # our files vanished under us: say why
                raise CheckpointError(f"save_dcp: {other}") from e
        raise
    if together:
        try:
            _meet(path, staging, save_id, rank, count, barrier_timeout_s)
        except BaseException as e:
            _give_up(path, staging, rank, e)  # (what _meet raises itself was decided already; an interrupt not)
            raise
        return path
    return staging


def _decision(staging: str) -> str | None:
    """The save's decision (see _DECISION): None if none yet, "" while its maker is still writing it."""
    try:
        with open(os.path.join(staging, _DECISION)) as f:
            return f.read()
    except FileNotFoundError:
        return None


def _decide(staging: str, decision: str) -> str | None:
    """Record ``decision`` unless another process made one first: None if ours stands, else theirs ("" while it
    is being written, or when the staging directory is gone)."""
    try:
        with open(os.path.join(staging, _DECISION), "x") as f:
            f.write(decision)
        return None
    except FileExistsError:
        return _decision(staging) or ""
    except FileNotFoundError:
        return ""


def _aborted(path: str, decision: str) -> str:
    rank, _, why = decision[len("abort "):].partition(": ")
    return f"process {rank} aborted the save of {path}: {why} (the staging directory is removed)"


def _give_up(path: str, staging: str, rank: int, e: BaseException) -> str | None:
    """Abort the save after this process failed, unless process 0 is already committing it, and remove the staging
    directory once the save is aborted. Best effort (another error is propagating). Returns what happened instead
    when another process had aborted the save first or the staging directory is gone."""
    why = " ".join(f"{type(e).__name__}: {e}".split())[:500]  # one line
    try:
        other = _decide(staging, f"abort {rank}: {why}")
    except OSError:
        return None
    if other is None or other.startswith("abort "):
        fsutil.remove_staging(staging)
    if other and other.startswith("abort "):
        return _aborted(path, other)
    if other == "" and not os.path.isdir(staging):
        return f"{staging} vanished while this process wrote its part: another process aborted the save (see its error)"
    return None


def _meet(path: str, staging: str, save_id: str, rank: int, count: int, timeout: float) -> None:
    """The barriers of a multi-process save, through files in ``staging``: "written" (every process's plan file is
    there), then "final" (process 0 merged the plans and renamed ``staging`` to ``path``). A process still absent
    after ``timeout`` seconds at either makes the one waiting abort the save, unless process 0 decided to commit."""
    plans = [os.path.join(staging, f"__{r}{_PLAN_SUFFIX}") for r in range(count)]
    barrier, deadline, gone_since, delay = "written", time.monotonic() + timeout, None, 0.01
    while True:
        interrupt.check()
        now = time.monotonic()
        if not os.path.isdir(staging):
            if os.path.isfile(os.path.join(path, METADATA_FILE)):
                return  # process 0 committed it
            gone_since = now if gone_since is None else gone_since
            if now - gone_since >= _GONE_GRACE_S:
                raise CheckpointError(f"save_dcp: {staging} was removed and {path} not committed: another process "
                                      f"aborted the save (see the error of process 0 or of the process that failed)")
        else:
            gone_since = None
            decision = _decision(staging)
            if decision and decision.startswith("abort "):
                fsutil.remove_staging(staging)
                raise CheckpointError(f"save_dcp: {_aborted(path, decision)}")
            if barrier == "written" and (decision == "commit" or all(map(os.path.exists, plans))):
                barrier, deadline = "final", now + timeout
                if rank == 0:
                    other = _decide(staging, "commit")
                    if other == "commit":  # not ours: this save's own process 0 is this one
                        raise CheckpointError(f"save_dcp: {staging} holds the commit decision of an earlier save "
                                              f"with save_id {save_id!r} (its process 0 died while committing): "
                                              f"delete the directory or use another save_id")
                    if other is None:
                        finalize_dcp(path, save_id=save_id, process_count=count)
                        try:  # renamed along with the rest; no part of the checkpoint
                            os.unlink(os.path.join(path, _DECISION))
                        except OSError:
                            pass
                        return
                continue  # (another process's abort: raised at the next look)
            if now >= deadline:
                if barrier == "written":
                    missing = ", ".join(str(r) for r, p in enumerate(plans) if not os.path.exists(p))
                    why = f"barrier 'written' timed out after {timeout:g} s waiting for process(es) {missing}"
                    what = (f"process(es) {missing} of {count} did not write their part of {path} (no plan file in "
                            f"{staging}); check that every process calls save_dcp for this save (same path and "
                            f"save_id), that none died (see its log) and that all write to one shared file system")
                else:
                    why = f"barrier 'final' timed out after {timeout:g} s waiting for process 0 to commit"
                    what = (f"every process wrote its part of {path}, but process 0 did not commit it; check that "
                            f"process 0 is alive (see its log) and writes to the same file system")
                error = f"save_dcp: barrier {barrier!r} timed out after {timeout:g} s (barrier_timeout_s): {what}"
                if decision is None:
                    if _decide(staging, f"abort {rank}: {why}") is None:
                        fsutil.remove_staging(staging)
                        raise CheckpointError(f"{error}; the save was aborted and its staging directory removed")
                    continue  # another process decided first: take its decision at the next look
                if decision == "commit":
                    raise CheckpointError(f"{error}; process 0 began committing it, so {staging} is left as it is "
                                          f"(process 0 may still complete it; if it died, delete the directory)")
                if now >= deadline + _GONE_GRACE_S:  # "" for that long: its maker died while writing it
                    raise CheckpointError(f"{error}; the save's decision in {staging} stays empty (the process "
                                          f"making it died?), so the directory is left as it is: delete it")
        time.sleep(delay)
        delay = min(delay * 1.5, _POLL_MAX_S)


def _host_nbytes(c) -> int:
    return int(c.data.nbytes) if hasattr(c, "replica_id") else int(c.nbytes)


def _write_rank_plan(staging: str, rank: int, w: DcpWriter) -> None:
    rows = []
    for key, e in w.entries.items():
        if isinstance(e, BytesEntry):
            rows.append({"key": key, "kind": "bytes", "parts": list(w.planner[key]),
                         "storage": [e.storage.relative_path, e.storage.offset, e.storage.length]})
        else:
            rows.append({"key": key, "kind": "tensor", "parts": list(w.planner[key]), "dtype": e.dtype,
                         "size": list(e.size), "chunks": [[list(c.offsets), list(c.sizes), c.storage.relative_path,
                                                           c.storage.offset, c.storage.length] for c in e.chunks]})
    tmp = os.path.join(staging, f"__{rank}{_PLAN_SUFFIX}.tmp")
    with open(tmp, "w") as f:
        json.dump({"rank": rank, "entries": rows}, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, os.path.join(staging, f"__{rank}{_PLAN_SUFFIX}"))


def finalize_dcp(path: str, *, save_id: str, process_count: int) -> str:
    """Merge the per-process plans of a multi-process :func:`save_dcp` into ``.metadata`` and commit.

    Call once (e.g. on process 0) after every process's ``save_dcp(..., finalize=False)`` returned.
    Checks that all ranks wrote their plan, that dtypes and global shapes agree, and that the chunks tile
    every tensor.

    Args:
      path: the checkpoint directory given to ``save_dcp``.
      save_id: the ``save_id`` of that save.
      process_count: the number of processes that wrote it.

    Returns:
      ``path``, now a complete checkpoint.

    Raises:
      CheckpointError: a process's plan is missing, or the processes disagree on a key (its subclasses,
        e.g. :class:`CoverageError`, for chunks that do not tile a tensor). On an error while writing
        the metadata or committing, the staging directory is removed.
    """
    staging = fsutil.staging_path(path, save_id)
    entries, planner = {}, {}
    for rank in range(process_count):
        p = os.path.join(staging, f"__{rank}{_PLAN_SUFFIX}")
        if not os.path.isfile(p):
            raise CheckpointError(f"finalize_dcp: {p} missing: process {rank} did not finish writing")
        with open(p) as f:
            rows = json.load(f)["entries"]
        for r in rows:
            key = r["key"]
            planner[key] = tuple(r["parts"])
            if r["kind"] == "bytes":
                if key in entries:
                    raise CheckpointError(f"finalize_dcp: byte entry {key!r} written by more than one process")
                entries[key] = BytesEntry(key, StorageInfo(*r["storage"]))
                continue
            e = entries.setdefault(key, TensorEntry(key, r["dtype"], tuple(r["size"]), []))
            if not isinstance(e, TensorEntry) or (e.dtype, e.size) != (r["dtype"], tuple(r["size"])):
                raise CheckpointError(f"finalize_dcp: process {rank} disagrees on key {key!r} "
                                      f"(dtype/shape {r['dtype']} {r['size']})")
            e.chunks += [Chunk(tuple(o), tuple(s), StorageInfo(f_, off, ln)) for o, s, f_, off, ln in r["chunks"]]
    try:
        write_metadata(staging, DcpMetadata(entries, planner), os.path.abspath(path))
        for rank in range(process_count):
            os.unlink(os.path.join(staging, f"__{rank}{_PLAN_SUFFIX}"))
        fsutil.commit(staging, path)
    except BaseException:
        fsutil.remove_staging(staging)
        raise
    return path
