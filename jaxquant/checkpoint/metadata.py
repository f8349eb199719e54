"""The DCP ``.metadata`` file: a small model of it, an allowlist reader and a writer.

torch pickles ``torch.distributed.checkpoint.metadata.Metadata`` (dataclasses: TensorStorageMetadata
with TensorProperties/ChunkStorageMetadata, BytesStorageMetadata, MetadataIndex keys, and
``filesystem._StorageInfo`` values that locate each chunk in a ``.distcp`` file). We read it with
stand-in classes (no torch import, nothing executed) and write the same pickle opcodes by name.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from typing import Optional, Union

from jaxquant.checkpoint import dtypes as dt
from jaxquant.checkpoint.errors import CorruptCheckpointError
from jaxquant.checkpoint.safepickle import Global, NewObj, Reduce, dumps, safe_loads

METADATA_FILE = ".metadata"
DCP_VERSION = "1.0.0"
_M = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"


# ------------------------------------------------------------------------------------------- model

@dataclass
class StorageInfo:
    relative_path: str
    offset: int
    length: int


@dataclass
class Chunk:
    offsets: tuple
    sizes: tuple
    storage: Optional[StorageInfo] = None


@dataclass
class TensorEntry:
    key: str
    dtype: str  # torch dtype name
    size: tuple
    chunks: list = field(default_factory=list)


@dataclass
class BytesEntry:
    key: str
    storage: Optional[StorageInfo] = None


Entry = Union[TensorEntry, BytesEntry]


@dataclass
class DcpMetadata:
    entries: dict  # key -> Entry, in file order
    planner_data: dict = field(default_factory=dict)  # key -> tuple path (torch's unflatten mapping)
    version: Optional[str] = None


# ------------------------------------------------------------------------------ reading (stand-ins)

class _Rec:
    """Stand-in for a pickled dataclass: NEWOBJ then BUILD with a dict (or (dict, slots)) state."""

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2:
            state = {**(state[0] or {}), **(state[1] or {})}
        if not isinstance(state, dict):
            raise CorruptCheckpointError(f"{type(self).__name__[1:]}: unexpected pickled state {type(state)}")
        self.__dict__.update(state)


class _Metadata(_Rec): pass
class _TensorStorageMetadata(_Rec): pass
class _BytesStorageMetadata(_Rec): pass
class _ChunkStorageMetadata(_Rec): pass
class _StorageInfo(_Rec): pass
class _StorageMeta(_Rec): pass
class _StoragePrefix(_Rec): pass


class _TensorProperties(_Rec):
    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 5:  # TensorProperties.__getstate__
            self.dtype = state[0]
        else:
            super().__setstate__(state)


class _MetadataIndex(_Rec):
    def _k(self):
        off = getattr(self, "offset", None)
        return (getattr(self, "fqn", None), None if off is None else tuple(off))

    def __hash__(self):
        return hash(self._k())

    def __eq__(self, other):
        return isinstance(other, _MetadataIndex) and self._k() == other._k()


def _path(*parts):  # pathlib.PosixPath(*parts) -> plain str
    return "/".join(str(p) for p in parts)


def _metadata_allowlist():
    allow = {
        (_M, "Metadata"): _Metadata, (_M, "TensorStorageMetadata"): _TensorStorageMetadata,
        (_M, "BytesStorageMetadata"): _BytesStorageMetadata, (_M, "ChunkStorageMetadata"): _ChunkStorageMetadata,
        (_M, "TensorProperties"): _TensorProperties, (_M, "MetadataIndex"): _MetadataIndex,
        (_M, "StorageMeta"): _StorageMeta, (_M, "_MEM_FORMAT_ENCODING"): int,
        ("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties"): _TensorProperties,
        (_FS, "_StorageInfo"): _StorageInfo, (_FS, "_StoragePrefix"): _StoragePrefix,
        ("torch", "Size"): tuple, ("torch.serialization", "_get_layout"): str,
        ("collections", "OrderedDict"): dict,
        ("pathlib", "PosixPath"): _path, ("pathlib", "PurePosixPath"): _path,
        ("pathlib", "WindowsPath"): _path, ("pathlib", "PureWindowsPath"): _path,
    }
    for name in ("strided", "sparse_coo", "contiguous_format", "channels_last", "preserve_format"):
        allow[("torch", name)] = name
    for name in dt.KNOWN_TORCH_DTYPES:
        allow[("torch", name)] = dt.TorchDtype(name)
    return allow


METADATA_ALLOW = _metadata_allowlist()


def _ints(v, what) -> tuple:
    if not isinstance(v, (tuple, list)) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise CorruptCheckpointError(f"{what}: expected a tuple of ints, got {v!r}")
    return tuple(int(x) for x in v)


def read_metadata(ckpt_dir: str) -> DcpMetadata:
    """Read and structurally validate ``<ckpt_dir>/.metadata``."""
    path = os.path.join(ckpt_dir, METADATA_FILE)
    if not os.path.isfile(path):
        raise CorruptCheckpointError(f"{path}: missing; not a DCP checkpoint directory (no .metadata file)")
    with open(path, "rb") as f:
        raw = f.read()
    md = safe_loads(raw, METADATA_ALLOW, what=path)
    if not isinstance(md, _Metadata) or not isinstance(getattr(md, "state_dict_metadata", None), dict):
        raise CorruptCheckpointError(f"{path}: does not hold a torch.distributed.checkpoint Metadata object")
    storage = getattr(md, "storage_data", None) or {}
    if not isinstance(storage, dict):
        raise CorruptCheckpointError(f"{path}: storage_data is {type(storage).__name__}, expected a dict")

    def info(key, offsets):
        probe = _MetadataIndex()
        probe.fqn, probe.offset = key, offsets
        s = storage.get(probe)
        if s is None:
            return None
        if not isinstance(s, _StorageInfo) or not isinstance(getattr(s, "relative_path", None), str):
            raise CorruptCheckpointError(f"{path}: storage entry of {key!r} is not a _StorageInfo")
        if getattr(s, "transform_descriptors", None):
            raise CorruptCheckpointError(f"{path}: {key!r} uses stream transforms {s.transform_descriptors} "
                                         f"(not supported)")
        rel = s.relative_path
        if os.path.isabs(rel) or ".." in rel.replace("\\", "/").split("/"):
            raise CorruptCheckpointError(f"{path}: {key!r} points outside the checkpoint ({rel!r})")
        return StorageInfo(rel, int(s.offset), int(s.length))

    entries = {}
    for key, m in md.state_dict_metadata.items():
        if not isinstance(key, str):
            raise CorruptCheckpointError(f"{path}: non-string key {key!r}")
        what = f"{path}: key {key!r}"
        if isinstance(m, _BytesStorageMetadata):
            entries[key] = BytesEntry(key, info(key, None))
        elif isinstance(m, _TensorStorageMetadata):
            dtype = getattr(getattr(m, "properties", None), "dtype", None)
            if not isinstance(dtype, dt.TorchDtype):
                raise CorruptCheckpointError(f"{what}: tensor properties carry no torch dtype")
            size = _ints(getattr(m, "size", None), f"{what} size")
            chunks = []
            for c in getattr(m, "chunks", None) or []:
                if not isinstance(c, _ChunkStorageMetadata):
                    raise CorruptCheckpointError(f"{what}: chunk is {type(c).__name__}")
                off, sz = _ints(c.offsets, f"{what} chunk offsets"), _ints(c.sizes, f"{what} chunk sizes")
                chunks.append(Chunk(off, sz, info(key, off)))
            entries[key] = TensorEntry(key, dtype.name, size, chunks)
        else:
            raise CorruptCheckpointError(f"{what}: unknown storage metadata {type(m).__name__}")
    planner = getattr(md, "planner_data", None)
    return DcpMetadata(entries, planner if isinstance(planner, dict) else {}, getattr(md, "version", None))


# ------------------------------------------------------------------------------------------ writing

def _size(t) -> Reduce:
    return Reduce(Global("torch", "Size"), (tuple(int(x) for x in t),))


def _index(key, offsets, index):
    state = {"fqn": key, "index": index} if offsets is None else {"fqn": key, "offset": _size(offsets),
                                                                  "index": index}
    return NewObj(Global(_M, "MetadataIndex"), state)


def _storage(s: StorageInfo):
    return NewObj(Global(_FS, "_StorageInfo"),
                  {"relative_path": s.relative_path, "offset": int(s.offset), "length": int(s.length)})


def encode_metadata(md: DcpMetadata, checkpoint_id: str) -> bytes:
    """The pickle torch's ``FileSystemReader.read_metadata`` expects."""
    layout = Reduce(Global("torch.serialization", "_get_layout"), ("torch.strided",))
    contiguous = Reduce(Global(_M, "_MEM_FORMAT_ENCODING"), (0,))
    sdm, storage = {}, {}
    for key, e in md.entries.items():
        if isinstance(e, BytesEntry):
            sdm[key] = NewObj(Global(_M, "BytesStorageMetadata"), None)
            storage[_index(key, None, None)] = _storage(e.storage)
            continue
        props = NewObj(Global(_M, "TensorProperties"),
                       (Global("torch", e.dtype), layout, False, contiguous, False))
        chunks = [NewObj(Global(_M, "ChunkStorageMetadata"), {"offsets": _size(c.offsets), "sizes": _size(c.sizes)})
                  for c in e.chunks]
        sdm[key] = NewObj(Global(_M, "TensorStorageMetadata"),
                          {"properties": props, "size": _size(e.size), "chunks": chunks})
        for i, c in enumerate(e.chunks):
            storage[_index(key, c.offsets, i)] = _storage(c.storage)
    meta = NewObj(Global(_M, "StorageMeta"), {"checkpoint_id": checkpoint_id, "save_id": str(uuid.uuid4()),
                                              "load_id": None, "modules": []})
    planner = {k: tuple(md.planner_data.get(k, (k,))) for k in md.entries}
    return dumps(NewObj(Global(_M, "Metadata"), {
        "state_dict_metadata": sdm, "planner_data": planner, "storage_data": storage,
        "storage_meta": meta, "version": DCP_VERSION}))
