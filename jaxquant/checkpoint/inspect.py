"""``inspect_dcp``: is a DCP directory sound? Keys, dtypes, shapes, chunks, coverage, bytes present."""

from __future__ import annotations

import os

from jaxquant.checkpoint import dtypes as dt
from jaxquant.checkpoint import torchsave
from jaxquant.checkpoint.errors import CheckpointError
from jaxquant.checkpoint.layout import coverage_problems, volume
from jaxquant.checkpoint.metadata import BytesEntry
from jaxquant.checkpoint.reader import ChunkReader


def inspect_dcp(path: str, *, verify: bool = False) -> dict:
    """A report on the checkpoint at ``path``; ``report["ok"]`` is False when it is not sound.

    Per key: kind, dtype, global shape, number of chunks, stored bytes and problems (coverage gaps,
    overlaps, out-of-bounds chunks, unknown dtype, a chunk whose record is missing, truncated or does not
    match the metadata). ``verify`` also reads every zip entry of every record and checks its CRC-32 (in
    blocks); ``report["verified"]`` then counts what was read (records, zip entries, bytes, files).
    Raises :class:`CheckpointError` when the directory cannot be read at all (missing or unsafe
    ``.metadata``, an interrupted write's staging directory).
    """
    keys, problems = [], []
    verified = {"records": 0, "zip_entries": 0, "bytes": 0, "files": set()}

    def check_crcs(r, storage, what):
        n, nbytes = torchsave.verify_record(r._file(storage.relative_path, what), storage.offset, storage.length,
                                            f"{os.path.join(path, storage.relative_path)}: {what}")
        verified["records"] += 1
        verified["zip_entries"] += n
        verified["bytes"] += nbytes
        verified["files"].add(storage.relative_path)

    with ChunkReader(path, verify) as r:
        for key, e in r.metadata.entries.items():
            row = {"key": key, "problems": []}
            keys.append(row)
            if isinstance(e, BytesEntry):
                row.update(kind="bytes", dtype=None, shape=None, chunks=1, nbytes=0)
                try:
                    if verify and e.storage is not None:
                        check_crcs(r, e.storage, f"byte entry {key!r}")
                    r.value(e) if verify else r.value_pickle(e)
                except CheckpointError as err:
                    row["problems"].append(str(err))
                continue
            row.update(kind="tensor", dtype=e.dtype, shape=list(e.size), chunks=len(e.chunks), nbytes=0)
            try:
                itemsize = dt.to_numpy(e.dtype, what=f"key {key!r}").itemsize
            except CheckpointError as err:
                row["problems"].append(str(err))
                continue
            row["nbytes"] = sum(volume(c.sizes) for c in e.chunks) * itemsize
            row["problems"] += coverage_problems(e)
            for c in e.chunks:
                what = f"key {key!r} chunk at offsets {c.offsets}"
                try:
                    if c.storage is None:
                        raise CheckpointError(f"{what}: no storage entry in .metadata")
                    t = torchsave.probe_tensor(r._file(c.storage.relative_path, key), c.storage.offset,
                                               c.storage.length, f"{c.storage.relative_path}: {what}")
                    if t.dtype != e.dtype or tuple(t.size) != tuple(c.sizes):
                        raise CheckpointError(f"{what}: record holds {t.dtype}{list(t.size)}, metadata says "
                                              f"{e.dtype}{list(c.sizes)}")
                    if verify:
                        check_crcs(r, c.storage, what)
                except CheckpointError as err:
                    row["problems"].append(str(err))
    for row in keys:
        problems += [p if f"key {row['key']!r}" in p else f"key {row['key']!r}: {p}" for p in row["problems"]]
    files = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))
    verified["files"] = len(verified["files"])
    return {"path": path, "ok": not problems, "problems": problems, "keys": keys, "files": files,
            "total_bytes": sum(k["nbytes"] for k in keys), "verified": verified if verify else None}


def format_report(rep: dict) -> str:
    lines = [f"checkpoint {rep['path']}: {len(rep['keys'])} keys, {rep['total_bytes']} bytes in "
             f"{len(rep['files'])} .distcp files"]
    w = max([len(k["key"]) for k in rep["keys"]] + [3])
    lines.append(f"{'key':<{w}}  {'dtype':<14} {'shape':<20} chunks")
    for k in rep["keys"]:
        shape = "bytes" if k["kind"] == "bytes" else str(k["shape"])
        flag = "  !" if k["problems"] else ""
        lines.append(f"{k['key']:<{w}}  {k['dtype'] or '-':<14} {shape:<20} {k['chunks']}{flag}")
    v = rep.get("verified")
    if v is None:
        lines.append("not verified: metadata, coverage and record structure checked; data not read (--verify reads it)")
    else:
        lines.append(f"verified: read all {v['bytes']} bytes of the {v['zip_entries']} zip entries in {v['records']} "
                     f"records ({v['files']} file{'s' if v['files'] != 1 else ''}); the CRC-32 of each was compared with the one stored in the record")
    if rep["ok"]:
        lines.append("OK: every tensor is exactly covered and every chunk's bytes are present"
                     + (", and every CRC-32 matched" if v is not None else ""))
    else:
        lines.append(f"NOT SOUND: {len(rep['problems'])} problem(s)")
        lines += [f"  - {p}" for p in rep["problems"]]
    return "\n".join(lines)
