"""Reading DCP directories into JAX arrays: :class:`ChunkReader` and :func:`load_dcp`."""

from __future__ import annotations

import os
from typing import Any, Iterable

import jax
import numpy as np

from jaxquant.checkpoint import dtypes as dt
from jaxquant.checkpoint import fsutil, torchsave
from jaxquant.checkpoint.errors import CorruptCheckpointError, CoverageError, KeyMismatchError
from jaxquant.checkpoint.layout import coverage_problems, intersect, index_to_box, rel_slices, volume
from jaxquant.checkpoint.metadata import BytesEntry, DcpMetadata, TensorEntry, read_metadata
from jaxquant.checkpoint.progress import Progress
from jaxquant.checkpoint.tree import TransposeMap, components, flatten, is_quantized, is_value_list, rebuild_quantized


class ChunkReader:
    """Reads chunks and byte entries of one DCP directory, keeping data files open; read-only."""

    def __init__(self, root: str, verify: bool = True):
        fsutil.check_source_dir(root)
        self.root, self.verify = root, verify
        self.metadata: DcpMetadata = read_metadata(root)
        self._files: dict = {}

    def _file(self, rel: str, key: str):
        if rel not in self._files:
            p = os.path.join(self.root, rel)
            try:
                self._files[rel] = open(p, "rb")
            except FileNotFoundError:
                raise CorruptCheckpointError(f"{p}: data file of key {key!r} is missing") from None
        return self._files[rel]

    def entry(self, key: str, kind: type):
        e = self.metadata.entries.get(key)
        if e is None:
            raise KeyMismatchError(f"{self.root}: key {key!r} not in the checkpoint")
        if not isinstance(e, kind):
            raise KeyMismatchError(f"{self.root}: key {key!r} is a {type(e).__name__}, "
                                   f"expected a {kind.__name__}")
        return e

    def chunk(self, e: TensorEntry, c) -> np.ndarray:
        """One chunk as a (possibly strided, read-only) numpy array, validated against the metadata."""
        what = f"{os.path.join(self.root, c.storage.relative_path) if c.storage else self.root}: key {e.key!r} " \
               f"chunk at offsets {c.offsets}"
        if c.storage is None:
            raise CorruptCheckpointError(f"{what}: no storage entry in .metadata")
        arr = torchsave.read_tensor(self._file(c.storage.relative_path, e.key), c.storage.offset,
                                    c.storage.length, what, self.verify)
        want = dt.to_numpy(e.dtype, what=what)
        if arr.dtype != want or tuple(arr.shape) != tuple(c.sizes):
            raise CorruptCheckpointError(f"{what}: record holds {arr.dtype}{list(arr.shape)}, metadata says "
                                         f"{want}{list(c.sizes)}")
        return arr

    def _read_entry(self, e: BytesEntry, read):
        what = f"{self.root}: byte entry {e.key!r}"
        if e.storage is None:
            raise CorruptCheckpointError(f"{what}: no storage entry in .metadata")
        return read(self._file(e.storage.relative_path, e.key), e.storage.offset, e.storage.length, what,
                    self.verify)

    def value(self, e: BytesEntry) -> Any:
        """The Python value of a byte entry."""
        return self._read_entry(e, torchsave.read_value)

    def value_pickle(self, e: BytesEntry) -> bytes:
        """The raw pickle of a byte entry (to copy it verbatim)."""
        return self._read_entry(e, torchsave.read_value_pickle)

    def check_coverage(self, e: TensorEntry) -> None:
        problems = coverage_problems(e)
        if problems:
            raise CoverageError(f"{self.root}: key {e.key!r}: chunks do not tile shape {e.size}: "
                                f"{'; '.join(problems)}")

    def read_boxes(self, e: TensorEntry, boxes: list, on_bytes=None) -> list[np.ndarray]:
        """Assemble the given boxes [(lo, hi)] of ``e`` (stored coordinates) from the chunks they touch.

        Each needed chunk is read once (in file order) and scattered into every box it intersects, so
        memory is the boxes plus one chunk.
        """
        dtype = dt.to_numpy(e.dtype, what=f"{self.root}: key {e.key!r}")
        outs = [np.empty(tuple(h - l for l, h in zip(lo, hi)), dtype) for lo, hi in boxes]
        filled = [0] * len(boxes)
        needed = [c for c in e.chunks if volume(c.sizes) and any(
            intersect(c.offsets, tuple(o + s for o, s in zip(c.offsets, c.sizes)), lo, hi) for lo, hi in boxes)]
        needed.sort(key=lambda c: (c.storage.relative_path, c.storage.offset) if c.storage else ("", 0))
        for c in needed:
            arr = self.chunk(e, c)
            c_hi = tuple(o + s for o, s in zip(c.offsets, c.sizes))
            for i, (lo, hi) in enumerate(boxes):
                box = intersect(c.offsets, c_hi, lo, hi)
                if box is not None:
                    outs[i][rel_slices(*box, lo)] = arr[rel_slices(*box, c.offsets)]
                    filled[i] += volume(b - a for a, b in zip(*box))
            if on_bytes:
                on_bytes(arr.nbytes)
            del arr
        for (lo, hi), n, out in zip(boxes, filled, outs):
            if n != out.size:
                raise CoverageError(f"{self.root}: key {e.key!r}: region {lo}..{hi} is only partly covered "
                                    f"by chunks ({n} of {out.size} elements)")
        return outs

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def _sharding(leaf):
    s = getattr(leaf, "sharding", None)
    return s if isinstance(s, jax.sharding.Sharding) else jax.sharding.SingleDeviceSharding(jax.devices()[0])


def _load_array(r: ChunkReader, key: str, leaf, transposed_fn, progress) -> jax.Array:
    e = r.entry(key, TensorEntry)
    shape, dtype = tuple(int(d) for d in leaf.shape), np.dtype(leaf.dtype)
    tr = transposed_fn(key, shape)
    stored_shape = shape[::-1] if tr else shape
    have = dt.to_numpy(e.dtype, what=f"{r.root}: key {key!r}")
    if have != dtype or tuple(e.size) != stored_shape:
        raise KeyMismatchError(f"{r.root}: key {key!r} is {have}{list(e.size)} in the checkpoint, target asks "
                               f"{dtype}{list(shape)}" + (" (transposed)" if tr else ""))
    r.check_coverage(e)
    sharding = _sharding(leaf)
    dev_idx = sharding.addressable_devices_indices_map(shape)
    boxes = {}
    for d, idx in dev_idx.items():
        boxes.setdefault(index_to_box(idx, shape), []).append(d)
    keys = list(boxes)
    stored = [(lo[::-1], hi[::-1]) if tr else (lo, hi) for lo, hi in keys]
    blocks = r.read_boxes(e, stored, progress.update)
    arrays = []
    for box, block in zip(keys, blocks):
        if tr:  # stored [out, in] -> JAX [in, out]
            block = np.ascontiguousarray(block.T)
        arrays += [jax.device_put(block, d) for d in boxes[box]]
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def _nbytes(leaf) -> int:
    if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
        return 0
    return volume(leaf.shape) * np.dtype(leaf.dtype).itemsize


def _load_value(r: ChunkReader, key: str, leaf):
    e = r.metadata.entries.get(key)
    if isinstance(e, TensorEntry) and e.size == () and len(e.chunks) == 1:
        v = r.chunk(e, e.chunks[0]).item()  # a 0-d tensor (e.g. torch's int64 step) as a Python scalar
    else:
        v = r.value(r.entry(key, BytesEntry))
    want = leaf if isinstance(leaf, type) else type(leaf)
    if want in (list, tuple) and isinstance(v, (list, tuple)):
        return want(v)
    exact = isinstance(v, want) or (want is float and isinstance(v, int))
    if want in (bool, int, float, str, list, tuple) and not exact:
        raise KeyMismatchError(f"{r.root}: byte entry {key!r} holds a {type(v).__name__}, target asks {want.__name__}")
    return v


def load_dcp(path: str, target, *, transpose: Iterable[str] | str = (), verify: bool = True,
             progress: bool = False):
    """Read the DCP directory ``path`` into the structure of ``target``.

    Each process reads only the chunks that intersect its addressable shards; chunks are resharded to
    the target layout.

    Args:
      path: the checkpoint directory.
      target: a pytree whose leaves say what to read: ``jax.ShapeDtypeStruct(shape, dtype, sharding=...)``
        (no sharding: one device), a ``Float8Tensor``/``NVFP4Tensor`` whose components are such structs,
        or ``int``/``float``/``bool``/``str`` (a type or an example value) for byte entries. Keys are the
        tree paths joined with '.'.
      transpose: fnmatch pattern(s) of 2-D keys stored ``[out, in]`` and wanted ``[in, out]`` (default
        none).
      verify: check the CRC-32 of every record read (default True).
      progress: print a progress bar on stderr (default False).

    Returns:
      A pytree of ``target``'s structure holding ``jax.Array``s (sharded as asked), quantized tensors and
      Python values.

    Raises:
      CheckpointNotFoundError: ``path`` is not a directory.
      CorruptCheckpointError: a missing, truncated or corrupt file, or a CRC-32 mismatch.
      KeyMismatchError: a key missing, or of another shape, dtype or kind than ``target`` asks.
      CoverageError: the stored chunks do not cover a requested region.
      CheckpointError: other problems (its subclasses above included).
    """
    items, treedef = flatten(target, "load_dcp: target")
    tmap = TransposeMap(transpose)
    out = []
    with ChunkReader(path, verify) as r:
        total = sum(_nbytes(c) for _, _, l in items
                    for c in ([v for _, _, v in components(l)] if is_quantized(l) else [l]))
        with Progress(total, "load_dcp", enabled=progress) as bar:
            for key, _parts, leaf in items:
                if is_quantized(leaf):
                    tmap.check(key, (), quantized=True)
                    vals = {attr: _load_array(r, key + suffix, v, lambda k, s: False, bar)
                            for attr, suffix, v in components(leaf)}
                    out.append(rebuild_quantized(leaf, vals))
                elif hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
                    out.append(_load_array(r, key, leaf, tmap.check, bar))
                elif (leaf is None or isinstance(leaf, (bool, int, float, str)) or is_value_list(leaf)
                      or leaf in (bool, int, float, str, list, tuple)):
                    out.append(_load_value(r, key, leaf))
                else:
                    raise KeyMismatchError(f"load_dcp: target leaf {key!r} is a {type(leaf).__name__}; expected "
                                           f"a jax.ShapeDtypeStruct, a quantized tensor of them, or int/float/bool/str")
    tmap.finish()
    return jax.tree_util.tree_unflatten(treedef, out)
