"""Orbax's on-disk layout of a PyTree checkpoint: the one place jaxquant depends on it.

Orbax's public API saves whole in-memory trees; DCP -> Orbax must stream chunk by chunk, so ``OrbaxSink`` writes
the arrays through TensorStore itself and this module says what Orbax would have written around them
(orbax-checkpoint 0.12, ``PyTreeCheckpointer().save`` of a flat ``{key: np.ndarray, key: str}`` dict):

  manifest.ocdbt + d/...   one OCDBT key-value store holding a zarr v2 array per key, at kvstore path ``key``,
                           zstd level 1, data equal to the fill value still stored
  _strings.json            {"<key>": "<string>"} for string leaves
  _METADATA                {"tree_metadata": {"('<key>',)": {...value_type...}}, "use_ocdbt": true, ...}
  _CHECKPOINT_METADATA     handler name + timestamps;  commit_success.txt

Orbax writes the arrays into ``ocdbt.process_<i>/`` and merges them into the top-level store; with one writer we
write the top-level store directly (Orbax restores it the same way). Reading uses Orbax's public API only.
tests/test_checkpoint_orbax_layout.py saves the same tree with Orbax and fails, naming the difference, on an Orbax
version whose layout differs; ``SUPPORTED`` is the range that test passed with (pyproject's ``orbax`` extra).
"""

from __future__ import annotations

import json
import os
import time
import warnings

SUPPORTED = ((0, 12), (0, 13))  # [low, high) of orbax-checkpoint's (major, minor)

TARGET_DATA_FILE_BYTES = 2 ** 31  # Orbax's default OCDBT target data file size, also its zarr chunk cap
_OCDBT_CONFIG = {"max_inline_value_bytes": 1024, "max_decoded_node_bytes": 100000000, "manifest_kind": "single"}


def check_version() -> None:
    """Warn when the installed Orbax is outside the range whose layout was checked."""
    import orbax.checkpoint as ocp

    version = getattr(ocp, "__version__", "0")
    try:
        mm = tuple(int(x) for x in version.split(".")[:2])
    except ValueError:
        mm = (0, 0)
    if not SUPPORTED[0] <= mm < SUPPORTED[1]:
        warnings.warn(f"jaxquant writes Orbax checkpoints in the layout of orbax-checkpoint "
                      f">={'.'.join(map(str, SUPPORTED[0]))},<{'.'.join(map(str, SUPPORTED[1]))}; orbax-checkpoint "
                      f"{version} is installed (run tests/test_checkpoint_orbax_layout.py to check it)", stacklevel=3)


def kvstore_spec(directory: str, cache_pool: str) -> dict:
    """The TensorStore spec of the checkpoint's OCDBT store (``cache_pool``: a context resource name)."""
    base = {"driver": "file", "path": directory.rstrip("/") + "/"}
    return {"driver": "ocdbt", "base": {**base, "file_io_locking": {"mode": "non_atomic"}}, "manifest": base,
            "target_data_file_size": TARGET_DATA_FILE_BYTES, "config": dict(_OCDBT_CONFIG),
            "assume_config": True, "cache_pool": cache_pool}


def array_spec(kvstore: dict, key: str, shape, chunks, ts_dtype: str) -> dict:
    """The zarr array Orbax stores leaf ``key`` as (the chunk grid is ours to choose)."""
    return {"driver": "zarr", "kvstore": {**kvstore, "path": key}, "recheck_cached_data": False,
            "recheck_cached_metadata": False, "store_data_equal_to_fill_value": True,
            "metadata": {"shape": [int(n) for n in shape], "chunks": [int(c) for c in chunks],
                         "compressor": {"id": "zstd", "level": 1}},
            "dtype": ts_dtype}


def _handler_name() -> str:
    import orbax.checkpoint as ocp

    cls = ocp.PyTreeCheckpointHandler  # the public name; Orbax records where the class is defined
    return f"{cls.__module__}.{cls.__qualname__}"


def _write_json(directory: str, name: str, obj) -> None:
    with open(os.path.join(directory, name), "w") as f:
        json.dump(obj, f)


def write_tree_files(directory: str, arrays, strings: dict, init_ns: int, final_path: str) -> None:
    """The files besides the array store: ``arrays`` (keys of np.ndarray leaves), ``strings`` ({key: str})."""
    _write_json(directory, "_strings.json", dict(strings))
    leaves = {k: "np.ndarray" for k in arrays}
    leaves.update({k: "string" for k in strings})
    _write_json(directory, "_METADATA", {
        "tree_metadata": {str((k,)): {"key_metadata": [{"key": k, "key_type": 2}],
                                      "value_metadata": {"value_type": leaves[k], "skip_deserialize": False}}
                          for k in sorted(leaves)},
        "use_ocdbt": True, "use_zarr3": False, "store_array_data_equal_to_fill_value": True,
        "custom_metadata": None})
    _write_json(directory, "_CHECKPOINT_METADATA", {
        "item_handlers": _handler_name(), "metrics": {}, "performance_metrics": {},
        "init_timestamp_nsecs": init_ns, "commit_timestamp_nsecs": time.time_ns(), "custom_metadata": {}})
    with open(os.path.join(directory, "commit_success.txt"), "w") as f:
        f.write(f"Checkpoint commit was successful to {final_path}")
