"""Streaming conversion DCP -> Orbax, Orbax -> DCP and DCP -> DCP, with dequantize/transpose on the way.

Memory: a DCP source is read one chunk at a time and a DCP destination written one chunk at a time, so
DCP -> DCP peaks at about one chunk. An Orbax source is restored one tensor at a time (Orbax -> DCP peaks
at about the largest tensor). An Orbax destination is written chunk by chunk into the TensorStore arrays of
the Orbax layout, its zarr chunks aligned to the DCP chunks (peak about one chunk, or one tensor when the DCP
chunks cannot be aligned to a reasonable zarr grid); see ``orbax_io.OrbaxSink``.
"""

from __future__ import annotations

import os
from typing import Iterable

import numpy as np

from jaxquant.checkpoint import dtypes as dt
from jaxquant.checkpoint import fsutil, interrupt, quantnp
from jaxquant.checkpoint.errors import CheckpointError, CorruptCheckpointError
from jaxquant.checkpoint.layout import volume
from jaxquant.checkpoint.metadata import BytesEntry
from jaxquant.checkpoint.orbax_io import OrbaxSink, OrbaxSource, is_orbax, require_orbax
from jaxquant.checkpoint.progress import Progress
from jaxquant.checkpoint.reader import ChunkReader
from jaxquant.checkpoint.safepickle import safe_loads
from jaxquant.checkpoint.torchsave import RECORD_ALLOW
from jaxquant.checkpoint.tree import FP8_COMPONENTS, NVFP4_COMPONENTS, QUANT_INFO_KEY, TransposeMap
from jaxquant.checkpoint.writer import DcpWriter, write_metadata


class DcpSource:
    def __init__(self, path: str, verify: bool = True):
        self.r = ChunkReader(path, verify)
        self.md = self.r.metadata

    def keys(self):
        return list(self.md.entries)

    def kind(self, key):
        return "value" if isinstance(self.md.entries[key], BytesEntry) else "tensor"

    def parts(self, key):
        p = self.md.planner_data.get(key)
        return tuple(str(x) for x in p) if isinstance(p, (tuple, list)) else (key,)

    def tensor_meta(self, key):
        e = self.md.entries[key]
        return dt.to_numpy(e.dtype, what=f"{self.r.root}: key {key!r}"), tuple(e.size)

    def value_pickle(self, key):
        return self.r.value_pickle(self.md.entries[key])

    def full(self, key):
        e = self.md.entries[key]
        self.r.check_coverage(e)
        return self.r.read_boxes(e, [((0,) * len(e.size), tuple(e.size))])[0]

    def boxes(self, key):
        """(offsets, sizes) of the stored chunks of tensor ``key``."""
        return [(tuple(c.offsets), tuple(c.sizes)) for c in self.md.entries[key].chunks]

    def chunks(self, key):
        e = self.md.entries[key]
        self.r.check_coverage(e)
        for c in sorted(e.chunks, key=lambda c: (c.storage.relative_path, c.storage.offset) if c.storage else ("", 0)):
            yield c.offsets, self.r.chunk(e, c)

    def close(self):
        self.r.close()


class DcpSink:
    """Writes a DCP directory into ``staging`` (created by the caller), renamed to ``dst`` on commit."""

    def __init__(self, dst: str, staging: str):
        self.dst, self.staging = dst, staging
        self.w = DcpWriter(self.staging, 0)

    def declare_tensor(self, key, dtype, shape, parts=None, boxes=None):
        self.w.declare_tensor(key, dtype, shape, parts)

    def write_chunk(self, key, offsets, arr):
        return self.w.write_chunk(key, offsets, arr)

    def write_value(self, key, pickled, parts=None):
        self.w.write_value(key, pickled, parts)

    def commit(self):
        self.w.close()
        write_metadata(self.staging, self.w.metadata(), os.path.abspath(self.dst))
        fsutil.commit(self.staging, self.dst)

    def abort(self):
        self.w.close(sync=False)


def _open_source(src: str, verify: bool):
    fsutil.check_source_dir(src, "source")
    if os.path.exists(os.path.join(src, ".metadata")):
        return DcpSource(src, verify)
    if is_orbax(src):
        return OrbaxSource(src)
    raise CorruptCheckpointError(f"{src}: neither a DCP checkpoint (no .metadata file) nor an Orbax checkpoint")


def _quant_info(source) -> dict:
    if QUANT_INFO_KEY not in source.keys():
        return {}
    info = safe_loads(source.value_pickle(QUANT_INFO_KEY), RECORD_ALLOW, what=f"key {QUANT_INFO_KEY!r}")
    return dict(info.get("quantized", {})) if isinstance(info, dict) else {}


def _dequantized_chunks(source, key, info, dtype):
    """Chunks of the logical tensor of quantized ``key``, one per stored data chunk."""
    scale_inv = source.full(key + ".scale_inv")
    if info["format"] == "fp8":
        for off, arr in source.chunks(key):
            yield off, quantnp.fp8_block(arr, scale_inv, dtype)
    elif info["format"] == "nvfp4":
        quantnp.check_nvfp4_scale_layout(key, info["shape"], scale_inv.shape)
        amax = source.full(key + ".amax")
        for off, arr in source.chunks(key):
            yield (off[0], 2 * off[1]), quantnp.nvfp4_block(arr, off[0], off[1], scale_inv, amax, dtype)
    else:
        raise CheckpointError(f"key {key!r}: unknown quantization format {info['format']!r}")


def convert(src: str, dst: str, *, to: str, dequantize=None, transpose: Iterable[str] | str = (),
            progress: bool = False, verify: bool = True) -> str:
    """Convert the checkpoint ``src`` (DCP or Orbax, detected) to ``dst`` in format ``to``.

    ``dst`` is written atomically, streaming chunk by chunk; ``src`` is only read. An exception, SIGINT
    or SIGTERM removes the staging directory (see ``interrupt``).

    Args:
      src: the source checkpoint directory.
      dst: the destination; it must not exist, or be an empty directory, and differ from ``src``.
      to: "dcp" or "orbax" (Orbax needs the ``orbax`` extra; an Orbax source converts to "dcp" only).
      dequantize: a dtype (e.g. "bfloat16"): quantized tensors (listed in the ``__jaxquant__`` entry)
        become one tensor of their logical shape (default None: copied as components).
      transpose: fnmatch pattern(s) of 2-D keys to transpose (``[out, in]`` <-> ``[in, out]``; default
        none).
      progress: print a progress bar on stderr (default False).
      verify: check the CRC-32 of every DCP record read (default True).

    Returns:
      ``dst``.

    Raises:
      DestinationExistsError: ``dst`` exists and is not an empty directory.
      MissingDependencyError: ``to="orbax"`` or an Orbax source without Orbax installed.
      CorruptCheckpointError: ``src`` is neither format, or is damaged.
      CheckpointError: a bad argument, or another problem with either checkpoint (its subclasses above
        included).
      Interrupted: SIGINT or SIGTERM during the write, after the cleanup.
    """
    with interrupt.default_signals_clean_up():
        return _convert(src, dst, to, dequantize, transpose, progress, verify)


def _convert(src, dst, to, dequantize, transpose, progress, verify) -> str:
    if to not in ("dcp", "orbax"):
        raise CheckpointError(f"to: must be 'dcp' or 'orbax', got {to!r}")
    if os.path.abspath(src) == os.path.abspath(dst):
        raise CheckpointError(f"{dst}: destination is the source")
    if to == "orbax":
        require_orbax("convert --to orbax")  # before anything is read or created
    fsutil.check_destination(dst)
    source = _open_source(src, verify)
    if to == "orbax" and isinstance(source, OrbaxSource):
        source.close()
        raise CheckpointError(f"{src}: already an Orbax checkpoint; convert --to dcp instead")
    dq = np.dtype(dt.to_numpy(str(np.dtype(dequantize)) if not isinstance(dequantize, str) else dequantize,
                              what="dequantize")) if dequantize is not None else None
    quant = _quant_info(source)
    comp_keys = {k + sfx: k for k, i in quant.items()
                 for _, sfx in (NVFP4_COMPONENTS if i["format"] == "nvfp4" else FP8_COMPONENTS)}
    tmap = TransposeMap(transpose)
    total = 0
    for k in source.keys():
        if source.kind(k) == "tensor":
            d, s = source.tensor_meta(k)
            total += volume(s) * d.itemsize
    sink, staging = None, fsutil.staging_path(dst)
    try:
        fsutil.remove_stale_staging(dst)
        fsutil.make_staging(staging, dst)
        sink = DcpSink(dst, staging) if to == "dcp" else OrbaxSink(dst, staging)
        with Progress(total, f"convert -> {to}", enabled=progress) as bar:
            for key in source.keys():
                interrupt.stage("entry")
                interrupt.check()  # between keys and between chunks: nothing is in flight there
                parts = source.parts(key)
                if dq is not None and (key == QUANT_INFO_KEY or (key in comp_keys and comp_keys[key] != key)):
                    continue  # components folded into the dequantized tensor
                if source.kind(key) == "value":
                    sink.write_value(key, source.value_pickle(key), parts)
                    continue
                # the boxes the chunks will have (lets an Orbax sink align its zarr chunks to them)
                boxes = source.boxes(key) if hasattr(source, "boxes") else None
                if dq is not None and key in quant:
                    info = quant[key]
                    shape = tuple(info["shape"])
                    chunks, dtype = _dequantized_chunks(source, key, info, dq), dq
                    if boxes is not None and info["format"] == "nvfp4":
                        boxes = [((o[0], 2 * o[1]), (s[0], 2 * s[1])) for o, s in boxes]
                else:
                    dtype, shape = source.tensor_meta(key)
                    chunks = source.chunks(key)
                tr = tmap.check(key, shape, quantized=key in comp_keys and dq is None)
                if tr and boxes is not None:
                    boxes = [(tuple(o)[::-1], tuple(s)[::-1]) for o, s in boxes]
                sink.declare_tensor(key, dtype, shape[::-1] if tr else shape, parts, boxes=boxes)
                for off, arr in chunks:
                    if tr:
                        arr, off = np.ascontiguousarray(arr.T), tuple(off)[::-1]
                    sink.write_chunk(key, off, arr)
                    bar.update(arr.nbytes)
                    del arr
                    interrupt.stage("chunk")
                    interrupt.check()
        tmap.finish()
        sink.commit()
    except BaseException:
        if sink is not None:
            sink.abort()  # stops its writers before the directory goes
        fsutil.remove_staging(staging)
        raise
    finally:
        source.close()
    return dst


def dcp_to_orbax(src: str, dst: str, **kw) -> str:
    """DCP directory -> Orbax PyTree checkpoint (flat ``{dcp_key: array}``).

    Args:
      src: the DCP checkpoint directory.
      dst: the destination directory.
      **kw: :func:`convert`'s keyword arguments (``dequantize``, ``transpose``, ``progress``, ``verify``).

    Returns:
      ``dst``.

    Raises:
      CorruptCheckpointError: ``src`` has no ``.metadata``; and :func:`convert`'s errors.
    """
    fsutil.check_source_dir(src, "source")
    if not os.path.exists(os.path.join(src, ".metadata")):
        raise CorruptCheckpointError(f"{src}: missing .metadata; not a DCP checkpoint directory")
    return convert(src, dst, to="orbax", **kw)


def orbax_to_dcp(src: str, dst: str, **kw) -> str:
    """Orbax PyTree checkpoint -> DCP directory (nested keys joined with '.').

    Args:
      src: the Orbax checkpoint directory.
      dst: the destination directory.
      **kw: :func:`convert`'s keyword arguments (``dequantize``, ``transpose``, ``progress``, ``verify``).

    Returns:
      ``dst``.

    Raises:
      CorruptCheckpointError: ``src`` is not an Orbax checkpoint; and :func:`convert`'s errors.
    """
    fsutil.check_source_dir(src, "source")
    if not is_orbax(src):
        raise CorruptCheckpointError(f"{src}: not an Orbax checkpoint directory")
    return convert(src, dst, to="dcp", **kw)
