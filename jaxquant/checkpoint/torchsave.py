"""torch.save's zip container for one tensor or one Python value, read and written without torch.

A DCP ``.distcp`` file is a concatenation of such archives; each is addressed by ``(offset, length)``
from the metadata. An archive holds ``archive/data.pkl`` (a pickle whose persistent ids name storages),
``archive/data/<key>`` (raw little-endian storage bytes) and small version records. Entries are stored
uncompressed; we align each entry's data to 64 bytes (as torch does) and always end with ZIP64 records.
"""

from __future__ import annotations

import collections
import os
import struct
import zlib
from dataclasses import dataclass

import numpy as np

from jaxquant.checkpoint import dtypes as dt
from jaxquant.checkpoint.errors import CorruptCheckpointError
from jaxquant.checkpoint.safepickle import Global, PersistentId, Reduce, dumps, safe_loads

_ALIGN = 64
_U32 = 0xFFFFFFFF


# ------------------------------------------------------------------------------------- zip writing

def _local_header(name: bytes, size: int, crc: int, pos: int) -> bytes:
    zip64 = size >= _U32
    extra = struct.pack("<HHQQ", 1, 16, size, size) if zip64 else b""
    fixed = 30 + len(name) + len(extra)
    pad = (-(pos + fixed + 4)) % _ALIGN  # "FB" padding field so the data starts 64-byte aligned
    extra += struct.pack("<HH", 0x4246, pad) + b"Z" * pad
    s = _U32 if zip64 else size
    return struct.pack("<IHHHHHIIIHH", 0x04034B50, 45 if zip64 else 20, 0x0800, 0, 0, 0, crc, s, s,
                       len(name), len(extra)) + name + extra


def _central_header(name: bytes, size: int, crc: int, offset: int) -> bytes:
    fields = [v for v in (size, size) if v >= _U32] if size >= _U32 else []
    if offset >= _U32:
        fields.append(offset)
    extra = struct.pack("<HH", 1, 8 * len(fields)) + struct.pack(f"<{len(fields)}Q", *fields) if fields else b""
    s = _U32 if size >= _U32 else size
    return struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 45, 45 if fields else 20, 0x0800, 0, 0, 0, crc, s, s,
                       len(name), len(extra), 0, 0, 0, 0, min(offset, _U32)) + name + extra


def write_archive(f, entries: list[tuple[str, object]]) -> int:
    """Write a stored (uncompressed) zip of ``entries`` [(name, bytes-like)] at ``f``'s position.

    Returns the number of bytes written. Data buffers are written without copying.
    """
    start = f.tell()
    central = []
    for name, data in entries:
        mv = memoryview(data).cast("B")
        bname = name.encode("utf-8")
        pos = f.tell() - start
        crc = zlib.crc32(mv)
        f.write(_local_header(bname, mv.nbytes, crc, pos))
        f.write(mv)
        central.append(_central_header(bname, mv.nbytes, crc, pos))
    cd_start = f.tell() - start
    for c in central:
        f.write(c)
    cd_size = f.tell() - start - cd_start
    n = len(entries)
    z64_pos = f.tell() - start
    f.write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, n, n, cd_size, cd_start))
    f.write(struct.pack("<IIQI", 0x07064B50, 0, z64_pos, 1))
    f.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, min(n, 0xFFFF), min(n, 0xFFFF), min(cd_size, _U32),
                        min(cd_start, _U32), 0))
    return f.tell() - start


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(int(d), 1)
    return tuple(reversed(strides))


_VERSION_RECORDS = [(".format_version", b"1"), (".storage_alignment", b"64"), ("byteorder", b"little")]


def _serialization_id() -> bytes:
    return str(int.from_bytes(os.urandom(16), "little")).rjust(40, "0")[:40].encode()


def write_tensor(f, arr: np.ndarray, torch_name: str) -> int:
    """Write ``arr`` (C-contiguous) as ``torch.save(tensor)`` would; returns the byte length."""
    arr = np.asarray(arr)
    if not arr.flags.c_contiguous:  # (np.ascontiguousarray would turn a 0-d array into 1-d)
        arr = arr.copy(order="C")
    shape = tuple(int(d) for d in arr.shape)
    hooks = Reduce(Global("collections", "OrderedDict"), ())
    if torch_name in dt.LEGACY_STORAGE:
        pid = ("storage", Global("torch", dt.LEGACY_STORAGE[torch_name]), "0", "cpu", int(arr.size))
        pkl = Reduce(Global("torch._utils", "_rebuild_tensor_v2"),
                     (PersistentId(pid), 0, shape, _contiguous_strides(shape), False, hooks))
    else:
        pid = ("storage", Global("torch.storage", "UntypedStorage"), "0", "cpu", int(arr.nbytes))
        pkl = Reduce(Global("torch._utils", "_rebuild_tensor_v3"),
                     (PersistentId(pid), 0, shape, _contiguous_strides(shape), False, hooks,
                      Global("torch", torch_name)))
    raw = arr.reshape(-1).view(np.uint8)
    entries = [("archive/data.pkl", dumps(pkl)), *[("archive/" + n, v) for n, v in _VERSION_RECORDS],
               ("archive/data/0", raw), ("archive/version", b"3\n"),
               ("archive/.data/serialization_id", _serialization_id())]
    return write_archive(f, entries)


def write_value(f, pickled: bytes) -> int:
    """Write an already pickled Python value as ``torch.save(value)`` would."""
    entries = [("archive/data.pkl", pickled), *[("archive/" + n, v) for n, v in _VERSION_RECORDS],
               ("archive/version", b"3\n"), ("archive/.data/serialization_id", _serialization_id())]
    return write_archive(f, entries)


# ------------------------------------------------------------------------------------- zip reading

@dataclass
class Entry:
    data_offset: int  # absolute offset in the file
    size: int
    crc: int


def _read_exact(f, pos: int, n: int, what: str) -> bytes:
    f.seek(pos)
    b = f.read(n)
    if len(b) != n:
        raise CorruptCheckpointError(f"{what}: truncated (wanted {n} bytes at offset {pos}, got {len(b)})")
    return b


def read_archive(f, start: int, length: int, what: str) -> dict[str, Entry]:
    """Parse the zip archive at ``[start, start+length)`` of ``f`` (its directory only)."""
    fsize = f.seek(0, os.SEEK_END)
    if start < 0 or length < 22 or start + length > fsize:
        raise CorruptCheckpointError(
            f"{what}: record [{start}, {start + length}) lies outside the file ({fsize} bytes): truncated")
    tail_len = min(length, 22 + 0xFFFF + 20 + 56)
    tail = _read_exact(f, start + length - tail_len, tail_len, what)
    i = tail.rfind(b"PK\x05\x06")
    if i < 0 or i + 22 > len(tail):
        raise CorruptCheckpointError(f"{what}: no zip end-of-central-directory record (corrupt or truncated)")
    _, _, _, _, n, cd_size, cd_off, _ = struct.unpack("<IHHHHIIH", tail[i:i + 22])
    if i >= 20 and tail[i - 20:i - 16] == b"PK\x06\x07":
        z64_pos = struct.unpack("<Q", tail[i - 12:i - 4])[0]
        z64 = _read_exact(f, start + z64_pos, 56, what)
        if z64[:4] != b"PK\x06\x06":
            raise CorruptCheckpointError(f"{what}: bad ZIP64 end-of-central-directory record")
        n, cd_size, cd_off = struct.unpack("<QQQ", z64[32:56])
    if cd_off + cd_size > length:
        raise CorruptCheckpointError(f"{what}: central directory outside the record (truncated)")
    cd = _read_exact(f, start + cd_off, cd_size, what)
    entries, p = {}, 0
    for _ in range(n):
        if cd[p:p + 4] != b"PK\x01\x02" or p + 46 > len(cd):
            raise CorruptCheckpointError(f"{what}: corrupt zip central directory")
        (method, crc, csize, usize, nlen, xlen, clen) = struct.unpack("<HxxxxIIIHHH", cd[p + 10:p + 34])
        lho = struct.unpack("<I", cd[p + 42:p + 46])[0]
        name = cd[p + 46:p + 46 + nlen].decode("utf-8", "replace")
        extra = cd[p + 46 + nlen:p + 46 + nlen + xlen]
        p += 46 + nlen + xlen + clen
        if _U32 in (csize, usize, lho):  # ZIP64 extended information
            vals = _zip64_extra(extra, what)
            if usize == _U32:
                usize = vals.pop(0)
            if csize == _U32:
                csize = vals.pop(0)
            if lho == _U32:
                lho = vals.pop(0)
        if method != 0 or csize != usize:
            raise CorruptCheckpointError(f"{what}: entry {name} is compressed; torch.save archives are stored")
        lh = _read_exact(f, start + lho, 30, what)
        if lh[:4] != b"PK\x03\x04":
            raise CorruptCheckpointError(f"{what}: bad local header for {name}")
        ln, lx = struct.unpack("<HH", lh[26:30])
        data_off = lho + 30 + ln + lx
        if data_off + usize > length:
            raise CorruptCheckpointError(f"{what}: entry {name} runs past the end of the record (truncated)")
        entries[name] = Entry(start + data_off, usize, crc)
    return entries


def _zip64_extra(extra: bytes, what: str) -> list[int]:
    p = 0
    while p + 4 <= len(extra):
        tag, sz = struct.unpack("<HH", extra[p:p + 4])
        if tag == 1:
            return list(struct.unpack(f"<{sz // 8}Q", extra[p + 4:p + 4 + sz - sz % 8]))
        p += 4 + sz
    raise CorruptCheckpointError(f"{what}: ZIP64 sizes announced but no ZIP64 extra field")


def read_entry(f, e: Entry, what: str, verify: bool = True) -> np.ndarray:
    """The bytes of one entry as a uint8 array (CRC-checked when ``verify``)."""
    buf = np.empty(e.size, np.uint8)
    f.seek(e.data_offset)
    if f.readinto(memoryview(buf)) != e.size:
        raise CorruptCheckpointError(f"{what}: truncated data")
    if verify and zlib.crc32(buf) != e.crc:
        raise CorruptCheckpointError(f"{what}: CRC-32 mismatch: the stored bytes are corrupt")
    return buf


# ----------------------------------------------------------------------------- pickle allowlist

@dataclass
class StorageRef:
    dtype: str  # torch dtype name of the storage elements ("uint8" for UntypedStorage)
    key: str
    numel: int


@dataclass
class TensorRef:
    dtype: str
    storage: StorageRef
    offset: int
    size: tuple
    stride: tuple


class _StorageType:
    def __init__(self, dtype_name):
        self.dtype = dtype_name


def _rebuild_v2(storage, storage_offset, size, stride, requires_grad=False, hooks=None, metadata=None):
    return TensorRef(storage.dtype, storage, int(storage_offset), tuple(size), tuple(stride))


def _rebuild_v3(storage, storage_offset, size, stride, requires_grad, hooks, dtype, metadata=None):
    if not isinstance(dtype, dt.TorchDtype):
        raise CorruptCheckpointError(f"_rebuild_tensor_v3: dtype argument is {type(dtype).__name__}")
    return TensorRef(dtype.name, storage, int(storage_offset), tuple(size), tuple(stride))


def _record_allowlist():
    allow = {("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
             ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
             ("collections", "OrderedDict"): collections.OrderedDict,
             ("torch.storage", "UntypedStorage"): _StorageType("uint8")}
    for sname, tname in dt.STORAGE_TO_TORCH.items():
        allow[("torch", sname)] = _StorageType(tname)
    for sname in dt.UNSUPPORTED_STORAGES:
        allow[("torch", sname)] = _StorageType(sname)
    for name in dt.KNOWN_TORCH_DTYPES:
        allow[("torch", name)] = dt.TorchDtype(name)
    return allow


RECORD_ALLOW = _record_allowlist()


def _persistent_load(pid):
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
            and isinstance(pid[1], _StorageType)):
        raise CorruptCheckpointError(f"unexpected persistent id {pid!r}")
    return StorageRef(pid[1].dtype, str(pid[2]), int(pid[4]))


def _prefix(entries: dict, what: str) -> str:
    for name in entries:
        if name.endswith("data.pkl") and name.count("/") == 1:
            return name[: -len("data.pkl")]
    raise CorruptCheckpointError(f"{what}: no data.pkl in the torch.save archive")


def read_tensor(f, start: int, length: int, what: str, verify: bool = True) -> np.ndarray:
    """The tensor stored by ``torch.save`` at ``[start, start+length)``, as a numpy array."""
    entries = read_archive(f, start, length, what)
    prefix = _prefix(entries, what)
    obj = safe_loads(read_entry(f, entries[prefix + "data.pkl"], what, verify).tobytes(), RECORD_ALLOW,
                     what=what, persistent_load=_persistent_load)
    if not isinstance(obj, TensorRef):
        raise CorruptCheckpointError(f"{what}: record holds a {type(obj).__name__}, expected a tensor")
    return _materialize(f, entries, prefix, obj, what, verify)


def _materialize(f, entries, prefix, t: TensorRef, what, verify) -> np.ndarray:
    np_dtype = dt.to_numpy(t.dtype, what=what)
    sdt = dt.to_numpy(t.storage.dtype, what=what)
    name = f"{prefix}data/{t.storage.key}"
    if name not in entries:
        raise CorruptCheckpointError(f"{what}: storage {name} missing from the archive")
    raw = read_entry(f, entries[name], what, verify)
    if raw.size < t.storage.numel * sdt.itemsize:
        raise CorruptCheckpointError(f"{what}: storage holds {raw.size} bytes, pickle says "
                                     f"{t.storage.numel} x {sdt.itemsize}")
    isz = np_dtype.itemsize
    if len(t.size) != len(t.stride) or any(s < 0 for s in t.stride) or t.offset < 0:
        raise CorruptCheckpointError(f"{what}: bad tensor geometry size={t.size} stride={t.stride}")
    if 0 in t.size:
        return np.zeros(t.size, np_dtype)
    last = t.offset + sum((n - 1) * s for n, s in zip(t.size, t.stride))
    if (last + 1) * isz > raw.size:
        raise CorruptCheckpointError(f"{what}: tensor (size={t.size}, stride={t.stride}, offset={t.offset}) "
                                     f"exceeds its {raw.size}-byte storage")
    # as_strided on a same-size void dtype (ml_dtypes do not survive __array_interface__), then view
    base = raw[: raw.size - raw.size % isz].view(np.dtype(f"V{isz}"))
    return np.lib.stride_tricks.as_strided(base[t.offset:], shape=t.size, strides=[s * isz for s in t.stride],
                                           writeable=False).view(np_dtype)


def read_value(f, start: int, length: int, what: str, verify: bool = True):
    """The Python value stored by ``torch.save`` (plain data; tensors inside come back as numpy)."""
    entries = read_archive(f, start, length, what)
    prefix = _prefix(entries, what)
    obj = safe_loads(read_entry(f, entries[prefix + "data.pkl"], what, verify).tobytes(), RECORD_ALLOW,
                     what=what, persistent_load=_persistent_load)
    return _resolve(obj, f, entries, prefix, what, verify)


def read_value_pickle(f, start: int, length: int, what: str, verify: bool = True) -> bytes:
    """The raw ``data.pkl`` bytes of a value record (to copy a value record verbatim)."""
    entries = read_archive(f, start, length, what)
    return read_entry(f, entries[_prefix(entries, what) + "data.pkl"], what, verify).tobytes()


def _resolve(obj, f, entries, prefix, what, verify):
    if isinstance(obj, TensorRef):
        return np.array(_materialize(f, entries, prefix, obj, what, verify))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_resolve(x, f, entries, prefix, what, verify) for x in obj)
    if isinstance(obj, dict):
        return type(obj)((k, _resolve(v, f, entries, prefix, what, verify)) for k, v in obj.items())
    return obj


def _crc_stream(f, e: Entry, what: str, block: int = 64 << 20) -> None:
    f.seek(e.data_offset)
    crc, left = 0, e.size
    while left:
        b = f.read(min(block, left))
        if not b:
            raise CorruptCheckpointError(f"{what}: truncated data")
        crc, left = zlib.crc32(b, crc), left - len(b)
    if crc != e.crc:
        raise CorruptCheckpointError(f"{what}: CRC-32 mismatch: the stored bytes are corrupt")


def verify_record(f, start: int, length: int, what: str) -> tuple[int, int]:
    """Read every zip entry of the record at ``[start, start+length)`` and check its CRC-32.

    Returns (entries checked, bytes read). Raises :class:`CorruptCheckpointError` naming the entry on a mismatch.
    """
    entries = read_archive(f, start, length, what)
    for name, e in entries.items():
        _crc_stream(f, e, f"{what}: zip entry {name}")
    return len(entries), sum(e.size for e in entries.values())


def probe_tensor(f, start: int, length: int, what: str, verify: bool = False) -> TensorRef:
    """Check a tensor record without loading its data (CRC-checked in blocks when ``verify``)."""
    entries = read_archive(f, start, length, what)
    prefix = _prefix(entries, what)
    t = safe_loads(read_entry(f, entries[prefix + "data.pkl"], what).tobytes(), RECORD_ALLOW, what=what,
                   persistent_load=_persistent_load)
    if not isinstance(t, TensorRef):
        raise CorruptCheckpointError(f"{what}: record holds a {type(t).__name__}, expected a tensor")
    name = f"{prefix}data/{t.storage.key}"
    if name not in entries:
        raise CorruptCheckpointError(f"{what}: storage {name} missing from the archive")
    isz = dt.to_numpy(t.dtype, what=what).itemsize
    need = 0 if 0 in t.size else (t.offset + sum((n - 1) * s for n, s in zip(t.size, t.stride)) + 1) * isz
    if entries[name].size < need:
        raise CorruptCheckpointError(f"{what}: storage holds {entries[name].size} bytes, tensor needs {need}")
    if verify:
        _crc_stream(f, entries[name], what)
    return t
