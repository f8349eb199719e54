"""Orbax side of the conversion: a flat ``{dcp_key: array}`` PyTree plus one JSON string leaf.

The JSON leaf (key ``__jaxquant_dcp__``) carries what Orbax cannot hold as arrays: DCP byte entries
(their pickles, base64), zero-size tensors (dtype and shape), and torch's key paths (planner data).
"""

from __future__ import annotations

import base64
import json
import os

import numpy as np

from jaxquant.checkpoint import dtypes as dt
from jaxquant.checkpoint import fsutil
from jaxquant.checkpoint.errors import CheckpointError, CorruptCheckpointError
from jaxquant.checkpoint.layout import rel_slices, volume
from jaxquant.checkpoint.safepickle import dumps

EXTRA_KEY = "__jaxquant_dcp__"


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
        ocp = _ocp()
        self._ck = ocp.PyTreeCheckpointer()
        try:
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


class OrbaxSink:
    """Assembles each tensor in a file-backed scratch array, then writes one Orbax checkpoint."""

    def __init__(self, dst: str):
        self.dst = os.path.abspath(dst)
        fsutil.check_destination(dst)
        self.staging = fsutil.staging_path(dst)
        self.scratch = self.staging + "-scratch"
        fsutil.make_staging(self.scratch)
        self.arrays, self.values, self.empty, self.planner, self.order = {}, {}, {}, {}, []

    def declare_tensor(self, key, dtype, shape, parts=None):
        self.order.append(key)
        self.planner[key] = list(parts or (key,))
        if volume(shape) == 0:
            self.empty[key] = [dt.to_torch_name(dtype, what=f"key {key!r}"), list(shape)]
            return
        dt.to_torch_name(dtype, what=f"key {key!r}")
        self.arrays[key] = np.memmap(os.path.join(self.scratch, f"{len(self.arrays)}.bin"), dtype=dtype,
                                     mode="w+", shape=tuple(shape))

    def write_chunk(self, key, offsets, arr):
        if key in self.empty:
            return 0
        mm = self.arrays[key]
        hi = tuple(o + s for o, s in zip(offsets, arr.shape))
        mm[rel_slices(offsets, hi, (0,) * len(offsets))] = arr
        return arr.nbytes

    def write_value(self, key, pickled, parts=None):
        self.order.append(key)
        self.planner[key] = list(parts or (key,))
        self.values[key] = base64.b64encode(pickled).decode()

    def commit(self):
        tree = {k: np.asarray(mm) for k, mm in self.arrays.items()}  # plain views of the scratch files
        for mm in self.arrays.values():
            mm.flush()
        tree[EXTRA_KEY] = json.dumps({"version": 1, "values": self.values, "empty": self.empty,
                                      "planner": self.planner, "order": self.order})
        _ocp().PyTreeCheckpointer().save(self.staging, tree)
        self.arrays.clear()
        fsutil.remove(self.scratch)
        fsutil.commit(self.staging, self.dst)

    def abort(self):
        self.arrays.clear()
        fsutil.remove(self.scratch)
        fsutil.remove(self.staging)
