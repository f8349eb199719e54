"""Orbax side of the conversion: a flat ``{dcp_key: array}`` PyTree plus one JSON string leaf.

The JSON leaf (key ``__jaxquant_dcp__``) carries what Orbax cannot hold as arrays: DCP byte entries
(their pickles, base64), zero-size tensors (dtype and shape), and torch's key paths (planner data).
"""

from __future__ import annotations

import base64
import json
import math
import os
import time

import numpy as np

from jaxquant.checkpoint import dtypes as dt
from jaxquant.checkpoint import fsutil, interrupt, orbax_layout
from jaxquant.checkpoint.errors import CheckpointError, CorruptCheckpointError, MissingDependencyError
from jaxquant.checkpoint.layout import rel_slices, volume
from jaxquant.checkpoint.safepickle import dumps

EXTRA_KEY = "__jaxquant_dcp__"

INSTALL_ORBAX = 'pip install "jaxquant[orbax]" (from a checkout: pip install --no-build-isolation -e ".[orbax]")'


def require_orbax(what: str) -> None:
    """Import Orbax and TensorStore, or raise :class:`MissingDependencyError` (one line naming the ``orbax``
    extra). ``what``: the operation that needs them, e.g. "convert --to orbax"."""
    try:
        import orbax.checkpoint  # noqa: F401
        import tensorstore  # noqa: F401
    except ModuleNotFoundError as e:
        raise MissingDependencyError(f"{what} needs orbax-checkpoint and tensorstore, and {e.name or e} is not "
                                     f"installed; install the orbax extra: {INSTALL_ORBAX}") from None


def _ocp():
    import orbax.checkpoint as ocp

    return ocp


def is_orbax(path: str) -> bool:
    return os.path.isdir(path) and any(os.path.exists(os.path.join(path, n))
                                       for n in ("_CHECKPOINT_METADATA", "_METADATA"))


class OrbaxSource:
    """Keys of an Orbax PyTree checkpoint; tensors restored one key at a time as numpy."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        require_orbax(f"{path}: reading an Orbax checkpoint")
        ocp = _ocp()
        self._ck = ocp.PyTreeCheckpointer()
        try:
            with interrupt.deferred():  # Orbax runs an asyncio loop here too: see _restore
                tree = self._ck.metadata(self.path).item_metadata.tree
        except Exception as e:
            raise CorruptCheckpointError(f"{path}: not a readable Orbax PyTree checkpoint ({e})") from e
        self._meta = {}
        self._flatten(tree, ())
        extra = {}
        if EXTRA_KEY in self._meta:
            extra = json.loads(self._restore(*self._meta[EXTRA_KEY]))
            del self._meta[EXTRA_KEY]
        self.values = {k: base64.b64decode(v) for k, v in extra.get("values", {}).items()}
        self.empty = {k: (d, tuple(s)) for k, (d, s) in extra.get("empty", {}).items()}
        self.planner = {k: tuple(v) for k, v in extra.get("planner", {}).items()}
        self.order = extra.get("order") or list(self._meta) + list(self.values) + list(self.empty)

    def _flatten(self, node, parts):
        if isinstance(node, dict):
            for k, v in node.items():
                self._flatten(v, parts + (str(k),))
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                self._flatten(v, parts + (str(i),))
        else:
            self._meta[".".join(parts)] = (parts, node)

    def _restore(self, parts, meta):
        ocp = _ocp()
        is_array = type(meta).__name__ == "ArrayMetadata"
        item, args = meta, ocp.RestoreArgs(restore_type=np.ndarray) if is_array else ocp.RestoreArgs()
        for p in reversed(parts):
            item, args = {p: item}, {p: args}
        # Orbax's restore runs an asyncio loop fed by TensorStore threads; cut short it leaves them calling a closed
        # loop. SIGINT/SIGTERM therefore take effect once this key is read.
        with interrupt.deferred():
            interrupt.stage("restore")
            out = self._ck.restore(self.path, args=ocp.args.PyTreeRestore(item=item, restore_args=args,
                                                                         partial_restore=True))
        for p in parts:
            out = out[p]
        return out

    def keys(self):
        return list(self.order)

    def kind(self, key):
        if key in self.values:
            return "value"
        if key in self.empty:
            return "tensor"
        parts, meta = self._meta[key]
        return "tensor" if type(meta).__name__ == "ArrayMetadata" else "value"

    def parts(self, key):
        return self.planner.get(key) or (self._meta[key][0] if key in self._meta else (key,))

    def tensor_meta(self, key):
        if key in self.empty:
            d, s = self.empty[key]
            return dt.to_numpy(d, what=f"{self.path}: key {key!r}"), s
        meta = self._meta[key][1]
        return np.dtype(meta.dtype), tuple(int(d) for d in meta.shape)

    def chunk_shape(self, key):
        """The zarr chunk shape of tensor ``key`` as Orbax's metadata records it, or None (not recorded, or a
        zero-size tensor)."""
        if key in self.empty or key not in self._meta:
            return None
        storage = getattr(self._meta[key][1], "storage", None)
        shape = getattr(storage, "chunk_shape", None)
        return tuple(int(c) for c in shape) if shape else None

    def value_pickle(self, key) -> bytes:
        if key in self.values:
            return self.values[key]
        v = self._restore(*self._meta[key])
        if isinstance(v, np.ndarray) and v.ndim == 0:
            v = v.item()
        if not isinstance(v, (bool, int, float, str)):
            raise CheckpointError(f"{self.path}: leaf {key!r} is a {type(v).__name__}; cannot store it in DCP")
        return dumps(v)

    def full(self, key) -> np.ndarray:
        if key in self.empty:
            d, s = self.tensor_meta(key)
            return np.zeros(s, d)
        return np.asarray(self._restore(*self._meta[key]))

    def chunks(self, key):
        arr = self.full(key)
        yield (0,) * arr.ndim, arr

    def close(self):
        pass


# Orbax's TensorStore context, except: no OCDBT node cache (Orbax keeps up to 100 MB; with one commit per
# ~FLUSH_BYTES it fills with what was written and RSS grows with the checkpoint) and one data-copy/compression
# thread (the writes are sequential anyway; fewer threads = fewer malloc arenas holding freed chunk buffers).
_TS_CONTEXT = {"cache_pool#ocdbt": {"total_bytes_limit": 0}, "file_io_concurrency": {"limit": 128},
               "data_copy_concurrency": {"limit": 1}}
# Staged writes are committed once this many bytes are pending (small tensors share a commit; a chunk at least
# this large is committed on its own), so at most ~FLUSH_BYTES + one chunk is held.
FLUSH_BYTES = 4 << 20
# A zarr chunk grid aligned to the DCP chunks is used unless its chunks would be smaller than this (e.g. odd
# uneven splits); then the tensor gets one zarr chunk (capped at 2 GiB) and is committed whole.
MIN_ALIGNED_CHUNK_BYTES = 1 << 20


def _release_free_memory():
    """Return freed heap memory to the OS (glibc keeps it in per-thread arenas; compressed chunk buffers freed
    by TensorStore's threads would otherwise stay resident). No-op where ``malloc_trim`` does not exist."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            import ctypes

            _malloc_trim = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim = None


def _cap_chunk(chunk, itemsize, cap=orbax_layout.TARGET_DATA_FILE_BYTES):
    """Split ``chunk`` (by a divisor of one dim at a time, largest dim first) until it has <= cap bytes."""
    chunk = list(chunk)
    while volume(chunk) * itemsize > cap and any(c > 1 for c in chunk):
        d = max(range(len(chunk)), key=lambda i: chunk[i])
        n = chunk[d]
        chunk[d] = n // next(p for p in range(2, n + 1) if n % p == 0)
    return tuple(chunk)


def zarr_chunk_shape(shape, boxes, itemsize) -> tuple[tuple, bool]:
    """(zarr chunk shape, aligned): aligned when every zarr chunk lies inside one of ``boxes``.

    ``boxes``: the (offsets, sizes) of the chunks that will be written (they tile ``shape``), or None. Per
    dimension the chunk size is the gcd of the interior chunk boundaries, so grid cells never straddle a
    boundary and each written region is a union of whole zarr chunks (written without reading anything back).
    """
    shape = tuple(int(n) for n in shape)
    whole = _cap_chunk(shape, itemsize)
    if not boxes:
        return whole, False
    grid = []
    for d, n in enumerate(shape):
        g = 0
        for off, size in boxes:
            for cut in (int(off[d]), int(off[d]) + int(size[d])):
                if 0 < cut < n:
                    g = math.gcd(g, cut)
        grid.append(g or n)
    grid = _cap_chunk(grid, itemsize)
    if volume(grid) * itemsize < MIN_ALIGNED_CHUNK_BYTES and volume(grid) < volume(shape):
        return whole, False
    return grid, True


def _wait(start):
    """``start()`` (which begins a TensorStore operation and returns its future) and the future's result, with
    SIGINT/SIGTERM held from before the start until it is done. A signal between the start and the wait, or a
    wait cut short, would leave TensorStore threads writing into (and, through the file driver, re-creating)
    the staging directory while it is removed: CI once found a lone ``manifest.ocdbt`` written after the cleanup
    by a commit begun just before a SIGTERM. The hold lasts one commit (about FLUSH_BYTES or one chunk)."""
    with interrupt.deferred():
        future = start()
        interrupt.stage("tensorstore")  # an operation in flight
        return future.result()


class OrbaxSink:
    """Writes an Orbax PyTree checkpoint chunk by chunk, straight into its TensorStore arrays.

    Each tensor is a zarr array in the checkpoint's OCDBT store (the spec Orbax would use), with a zarr chunk
    grid aligned to the incoming chunks when they are known (``declare_tensor(..., boxes=...)``). Chunks are
    staged in a TensorStore transaction that is committed every ``FLUSH_BYTES``, so memory stays a few times
    the largest chunk (the largest tensor when its grid cannot be aligned). ``commit`` adds Orbax's metadata files
    and renames.
    """

    def __init__(self, dst: str, staging: str):
        require_orbax("writing an Orbax checkpoint")
        import tensorstore as ts

        orbax_layout.check_version()
        self._ts = ts
        self.dst, self.staging = os.path.abspath(dst), staging
        self._ctx = ts.Context(_TS_CONTEXT)
        self._kv = orbax_layout.kvstore_spec(self.staging, "cache_pool#ocdbt")
        self._txn, self._pending = ts.Transaction(), 0
        self._t0 = time.time_ns()
        self._cur = None  # (key, TensorStore in the transaction, aligned)
        self.arrays, self.values, self.empty, self.planner, self.order = [], {}, {}, {}, []

    def _flush(self):
        """Commit the staged writes (new zarr arrays and chunks) to the OCDBT store; start a new transaction."""
        _wait(self._txn.commit_async)
        self._txn, self._pending = self._ts.Transaction(), 0
        _release_free_memory()
        if self._cur is not None:
            key, t, aligned = self._cur
            self._cur = (key, t.with_transaction(self._txn), aligned)

    def _end_tensor(self):
        if self._cur is not None and self._pending >= FLUSH_BYTES:
            self._flush()
        self._cur = None

    def declare_tensor(self, key, dtype, shape, parts=None, boxes=None):
        self._end_tensor()
        self.order.append(key)
        self.planner[key] = list(parts or (key,))
        dtype = np.dtype(dtype)
        if volume(shape) == 0:
            self.empty[key] = [dt.to_torch_name(dtype, what=f"key {key!r}"), list(shape)]
            return
        dt.to_torch_name(dtype, what=f"key {key!r}")
        if key == EXTRA_KEY:
            raise CheckpointError(f"key {key!r} is reserved for jaxquant's Orbax metadata leaf")
        if boxes is not None:
            boxes = [(tuple(o), tuple(s)) for o, s in boxes if volume(s) > 0]
        chunks, aligned = zarr_chunk_shape(shape, boxes, dtype.itemsize)
        try:
            spec = orbax_layout.array_spec(self._kv, key, shape, chunks, self._ts.dtype(dtype).name)
            t = _wait(lambda: self._ts.open(self._ts.Spec(spec), create=True, context=self._ctx,
                                            transaction=self._txn))
        except Exception as e:
            raise CheckpointError(f"key {key!r}: cannot create its Orbax/TensorStore array ({e})") from e
        self._cur = (key, t, aligned)
        self.arrays.append(key)

    def write_chunk(self, key, offsets, arr):
        if key in self.empty:
            return 0
        if self._cur is None or self._cur[0] != key:
            raise CheckpointError(f"key {key!r}: chunk written outside its declare_tensor")
        _, t, aligned = self._cur
        hi = tuple(o + s for o, s in zip(offsets, arr.shape))
        region = rel_slices(offsets, hi, (0,) * len(offsets))
        # the transaction keeps a reference to ``arr`` (not a copy) until it is committed
        _wait(lambda: t[region].write(np.require(arr, requirements="C"),
                                      can_reference_source_data_indefinitely=True))
        self._pending += arr.nbytes
        if aligned and self._pending >= FLUSH_BYTES:
            self._flush()
        return arr.nbytes

    def write_value(self, key, pickled, parts=None):
        self._end_tensor()
        self.order.append(key)
        self.planner[key] = list(parts or (key,))
        self.values[key] = base64.b64encode(pickled).decode()

    def commit(self):
        self._flush()
        self._cur, self._txn = None, None
        extra = json.dumps({"version": 1, "values": self.values, "empty": self.empty,
                            "planner": self.planner, "order": self.order})
        orbax_layout.write_tree_files(self.staging, self.arrays, {EXTRA_KEY: extra}, self._t0, self.dst)
        fsutil.commit(self.staging, self.dst)

    def abort(self):
        """Drop what is staged in the open transaction (no TensorStore operation is in flight: see ``_wait``)."""
        txn, self._cur, self._txn = self._txn, None, None
        if txn is not None:
            try:
                txn.abort()
            except Exception:  # already committed or failed: nothing is pending either way
                pass
