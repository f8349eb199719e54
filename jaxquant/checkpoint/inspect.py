"""``inspect_dcp``: is a DCP directory sound? Keys, dtypes, shapes, chunks, coverage, bytes present.
``inspect_orbax``: the keys, dtypes and shapes of an Orbax PyTree checkpoint (what ``convert --to orbax``
writes); ``inspect_checkpoint`` picks one by what the directory holds."""

from __future__ import annotations

import os

from jaxquant.checkpoint import dtypes as dt
from jaxquant.checkpoint import fsutil, torchsave
from jaxquant.checkpoint.errors import CheckpointError
from jaxquant.checkpoint.layout import coverage_problems, volume
from jaxquant.checkpoint.metadata import BytesEntry
from jaxquant.checkpoint.reader import ChunkReader


PLAN_PREFIX = "plan."     # byte entries of step.state_dict's "plan": each parameter's recipe


def inspect_dcp(path: str, *, verify: bool = False) -> dict:
    """A report on whether the DCP checkpoint at ``path`` is sound.

    Args:
      path: the checkpoint directory.
      verify: also read every zip entry of every record and check its CRC-32, in blocks (default False).

    Returns:
      A dict; ``report["ok"]`` is False when the checkpoint is not sound, ``report["problems"]`` lists why.
      Per key (``report["keys"]``): kind, dtype, global shape, number of chunks, tensor data bytes and
      problems (coverage gaps, overlaps, out-of-bounds chunks, unknown dtype, a chunk whose record is
      missing, truncated or does not match the metadata).

    Byte counts, each of one thing: ``total_bytes`` is the tensor data (elements x itemsize of every chunk, the
    sum of the keys' ``nbytes``); ``disk_bytes`` the size on disk of the ``.distcp`` files (each record also
    holds pickles, torch's version records, zip headers and alignment padding), ``metadata_bytes`` that of
    ``.metadata``. ``records`` is the number of records ``.metadata`` points to (one per chunk and per byte
    entry). With ``verify``, ``report["verified"]`` counts the records read whose every CRC-32 matched
    (``records`` of ``records_total``), their zip entries, the bytes of those entries (``bytes``: tensor data
    plus pickles and version records; no zip headers), the tensor data among them (``tensor_bytes``) and the
    files they lie in; a record not read or not matching is also a problem, so the checkpoint is not sound.

    Raises:
      CheckpointError: the directory cannot be read at all (missing or unsafe ``.metadata``, an
        interrupted write's staging directory).
    """
    keys, problems = [], []
    recipes = {}
    records = 0
    verified = {"records": 0, "records_total": 0, "zip_entries": 0, "bytes": 0, "tensor_bytes": 0, "files": set()}

    def check_crcs(r, storage, what, tensor_bytes=0):
        n, nbytes = torchsave.verify_record(r._file(storage.relative_path, what), storage.offset, storage.length,
                                            f"{os.path.join(path, storage.relative_path)}: {what}")
        verified["records"] += 1
        verified["zip_entries"] += n
        verified["bytes"] += nbytes
        verified["tensor_bytes"] += tensor_bytes
        verified["files"].add(storage.relative_path)

    with ChunkReader(path, verify) as r:
        for key, e in r.metadata.entries.items():
            row = {"key": key, "problems": []}
            keys.append(row)
            if isinstance(e, BytesEntry):
                records += 1
                row.update(kind="bytes", dtype=None, shape=None, chunks=1, nbytes=0)
                try:
                    if verify and e.storage is not None:
                        check_crcs(r, e.storage, f"byte entry {key!r}")
                    if key.startswith(PLAN_PREFIX):   # jaxquant's record of each parameter's recipe: shown
                        recipes[key[len(PLAN_PREFIX):]] = r.value(e)
                    else:
                        r.value(e) if verify else r.value_pickle(e)
                except CheckpointError as err:
                    row["problems"].append(str(err))
                continue
            records += len(e.chunks)
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
                        check_crcs(r, c.storage, what, volume(c.sizes) * itemsize)
                except CheckpointError as err:
                    row["problems"].append(str(err))
    for row in keys:
        problems += [p if f"key {row['key']!r}" in p else f"key {row['key']!r}: {p}" for p in row["problems"]]
    verified["files"] = len(verified["files"])
    verified["records_total"] = records
    if verify and verified["records"] < records and not problems:  # (each unread record has its problem already)
        problems.append(f"only {verified['records']} of {records} records were read and matched their CRC-32s")
    files = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))
    for row in keys:    # model.<name>: the recipe its training step used, where the checkpoint records it
        if row["key"].startswith("model.") and row["key"][len("model."):] in recipes:
            row["recipe"] = recipes[row["key"][len("model."):]]
    return {"path": path, "format": "dcp", "ok": not problems, "problems": problems, "keys": keys, "files": files,
            "records": records, "total_bytes": sum(k["nbytes"] for k in keys),
            "disk_bytes": sum(os.path.getsize(os.path.join(path, f)) for f in files),
            "metadata_bytes": os.path.getsize(os.path.join(path, ".metadata")),
            "verified": verified if verify else None}


def inspect_orbax(path: str, *, verify: bool = False) -> dict:
    """A report on the Orbax PyTree checkpoint at ``path``. Needs the ``orbax`` extra.

    Args:
      path: the checkpoint directory.
      verify: restore every tensor and value through Orbax, one at a time (memory: the largest tensor);
        a key that cannot be read is a problem (default False).

    Returns:
      A dict with the fields of :func:`inspect_dcp`'s (``format`` "orbax"): per key its kind, dtype, shape,
      number of zarr chunks (None where Orbax records no chunk shape) and bytes. Nested keys are joined
      with '.'; DCP byte entries that ``convert --to orbax`` keeps in its metadata leaf are listed as bytes.

    Byte counts: ``total_bytes`` is the tensor data (elements x itemsize), ``disk_bytes`` the size on disk of
    every file of the checkpoint (zstd-compressed arrays and Orbax's metadata files); with ``verify``,
    ``report["verified"]`` counts the keys restored (``keys`` of ``keys_total``) and their tensor data (``bytes``).

    Raises:
      CheckpointNotFoundError: ``path`` is not a directory; IncompleteCheckpointError: it is an
        interrupted write's staging directory; MissingDependencyError: Orbax is not installed.
    """
    from jaxquant.checkpoint.orbax_io import OrbaxSource

    fsutil.check_source_dir(path)
    source = OrbaxSource(path)
    keys, problems = [], []
    verified = {"keys": 0, "keys_total": 0, "bytes": 0}
    for key in source.keys():
        row = {"key": key, "problems": []}
        keys.append(row)
        if source.kind(key) == "value":
            row.update(kind="bytes", dtype=None, shape=None, chunks=1, nbytes=0)
            read = lambda: source.value_pickle(key)  # noqa: E731
        else:
            dtype, shape = source.tensor_meta(key)
            chunk = source.chunk_shape(key)
            nchunks = None if chunk is None else volume(-(-n // max(c, 1)) for n, c in zip(shape, chunk))
            row.update(kind="tensor", dtype=dtype.name, shape=list(shape), chunks=nchunks,
                       nbytes=volume(shape) * dtype.itemsize)
            read = lambda: source.full(key)  # noqa: E731
        if verify:
            try:
                out = read()
                verified["keys"] += 1
                verified["bytes"] += getattr(out, "nbytes", 0) if row["kind"] == "tensor" else 0
                del out
            except Exception as err:  # Orbax/TensorStore raise their own types
                row["problems"].append(f"cannot be read ({type(err).__name__}: {err})")
    source.close()
    problems += [f"key {row['key']!r}: {p}" for row in keys for p in row["problems"]]
    verified["keys_total"] = len(keys)
    files = sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)
    return {"path": path, "format": "orbax", "ok": not problems, "problems": problems, "keys": keys, "files": files,
            "total_bytes": sum(k["nbytes"] for k in keys),
            "disk_bytes": sum(os.path.getsize(os.path.join(path, f)) for f in files),
            "verified": verified if verify else None}


def inspect_checkpoint(path: str, *, verify: bool = False) -> dict:
    """A report on the checkpoint at ``path``, whichever format it is.

    Args:
      path: the checkpoint directory.
      verify: as in :func:`inspect_dcp` / :func:`inspect_orbax` (default False).

    Returns:
      :func:`inspect_orbax`'s report for an Orbax checkpoint (no DCP ``.metadata``, Orbax's ``_METADATA``
      or ``_CHECKPOINT_METADATA`` present), else :func:`inspect_dcp`'s.

    Raises:
      CheckpointError: as the function it picks.
    """
    from jaxquant.checkpoint.orbax_io import is_orbax

    if not os.path.exists(os.path.join(path, ".metadata")) and is_orbax(path):
        return inspect_orbax(path, verify=verify)
    return inspect_dcp(path, verify=verify)


def _plural(n: int, word: str, words: str | None = None) -> str:
    return f"{n:,} {word if n == 1 else words or word + 's'}"


def _key_table(keys) -> list:
    """One line per key (dtype, shape, chunks, and the training recipe where the checkpoint records it; "!" marks a
    key with problems), under a header. jaxquant's own recipe records (``plan.*``) are shown as that column."""
    shown = [k for k in keys if not (k["key"].startswith(PLAN_PREFIX) and k["kind"] == "bytes" and not k["problems"])]
    w = max([len(k["key"]) for k in shown] + [3])
    with_recipe = any("recipe" in k for k in shown)
    lines = [f"{'key':<{w}}  {'dtype':<14} {'shape':<20} chunks" + ("  recipe" if with_recipe else "")]
    for k in shown:
        shape = "bytes" if k["kind"] == "bytes" else str(k["shape"])
        chunks = "-" if k["chunks"] is None else k["chunks"]
        recipe = f"  {k.get('recipe', ''):<6}" if with_recipe else ""
        lines.append(f"{k['key']:<{w}}  {k['dtype'] or '-':<14} {shape:<20} {chunks:<6}{recipe}"
                     f"{'  !' if k['problems'] else ''}".rstrip())
    if with_recipe:
        counts = {}
        for k in shown:
            if "recipe" in k:
                counts[k["recipe"]] = counts.get(k["recipe"], 0) + 1
        lines.append("recipes the training step used (its plan.* entries): " +
                     ", ".join(f"{r} {n}" for r, n in sorted(counts.items())))
    return lines


def format_report(rep: dict) -> str:
    if rep.get("format") == "orbax":
        return _format_orbax(rep)
    lines = [f"checkpoint {rep['path']}: {_plural(len(rep['keys']), 'key')} in {_plural(rep['records'], 'record')}; "
             f"{rep['total_bytes']:,} bytes of tensor data (elements x itemsize); on disk {rep['disk_bytes']:,} bytes "
             f"in {_plural(len(rep['files']), '.distcp file')} (tensor data, pickles, zip headers, padding) "
             f"and {rep['metadata_bytes']:,} in .metadata"]
    lines += _key_table(rep["keys"])
    v = rep.get("verified")
    if v is None:
        lines.append("not verified: metadata, coverage and record structure checked; data not read (--verify reads it)")
    else:
        read = f"{v['records']:,} of {_plural(v['records_total'], 'record')} read"
        counts = (f"{_plural(v['zip_entries'], 'zip entry', 'zip entries')} of {v['bytes']:,} bytes: "
                  f"{v['tensor_bytes']:,} of tensor data, the rest pickles and torch's version records; "
                  f"{_plural(v['files'], 'file')}")
        if v["records"] == v["records_total"]:
            lines.append(f"verified: {read} ({counts}); every entry's CRC-32 matched the one stored in its record")
        else:
            bad = v["records_total"] - v["records"]
            lines.append(f"verified: {read} with matching CRC-32s ({counts}); {_plural(bad, 'record')} failed "
                         f"or could not be read (see the problems)")
    if rep["ok"]:
        lines.append("OK: every tensor is exactly covered and every chunk's bytes are present"
                     + (", and every CRC-32 matched" if v is not None else ""))
    else:
        lines.append(f"NOT SOUND: {len(rep['problems'])} problem(s)")
        lines += [f"  - {p}" for p in rep["problems"]]
    return "\n".join(lines)


def _format_orbax(rep: dict) -> str:
    lines = [f"Orbax checkpoint {rep['path']}: {_plural(len(rep['keys']), 'key')}; {rep['total_bytes']:,} bytes of "
             f"tensor data (elements x itemsize); on disk {rep['disk_bytes']:,} bytes in "
             f"{_plural(len(rep['files']), 'file')} (compressed arrays and Orbax's metadata)"]
    lines += _key_table(rep["keys"])
    v = rep.get("verified")
    if v is None:
        lines.append("not verified: Orbax's metadata read; data not read (--verify restores every key)")
    else:
        lines.append(f"verified: restored {v['keys']:,} of {_plural(v['keys_total'], 'key')} through Orbax "
                     f"({v['bytes']:,} bytes of tensor data)")
    if rep["ok"]:
        lines.append("OK" + (": every key was restored" if v is not None else ""))
    else:
        lines.append(f"NOT SOUND: {len(rep['problems'])} problem(s)")
        lines += [f"  - {p}" for p in rep["problems"]]
    return "\n".join(lines)
