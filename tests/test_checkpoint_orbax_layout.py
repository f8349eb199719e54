"""jaxquant/checkpoint/orbax_layout.py reproduces what the installed Orbax writes for the same flat tree.

This is the test that fails, naming the difference, on an Orbax version whose on-disk layout changed (then
update orbax_layout.py and its SUPPORTED range, and pyproject's orbax extra).
"""

import json
import os
import pathlib
import sys

import ml_dtypes
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from ckpt_helpers import common  # noqa: E402

common.setup_devices()
ocp = pytest.importorskip("orbax.checkpoint", reason="needs orbax-checkpoint (the 'orbax' or 'test' extra)")
import tensorstore as ts  # noqa: E402

from jaxquant.checkpoint import fsutil, orbax_io, orbax_layout  # noqa: E402

TREE = {"w": np.arange(64, dtype=np.float32).reshape(8, 8).astype(ml_dtypes.bfloat16),
        "u": np.arange(16, dtype=np.uint8).reshape(4, 4)}


def _zarray(path, key):
    kv = ts.KvStore.open({"driver": "ocdbt", "base": {"driver": "file", "path": str(path) + "/"}}).result()
    return json.loads(kv.read(f"{key}/.zarray").result().value)


def _json(path, name):
    with open(os.path.join(path, name)) as f:
        return json.load(f)


def test_our_orbax_files_are_the_ones_orbax_writes(tmp_path):
    theirs = tmp_path / "orbax"
    ocp.PyTreeCheckpointer().save(str(theirs), {**TREE, orbax_io.EXTRA_KEY: "{}"})
    ours = str(tmp_path / "ours")
    staging = fsutil.staging_path(ours)
    fsutil.make_staging(staging, ours)
    sink = orbax_io.OrbaxSink(ours, staging)
    for key, arr in TREE.items():
        sink.declare_tensor(key, arr.dtype, arr.shape)
        sink.write_chunk(key, (0, 0), arr)
    sink.commit()
    version = ocp.__version__
    for name in ("_METADATA", "_CHECKPOINT_METADATA", "_strings.json"):
        a, b = _json(ours, name), _json(theirs, name)
        if name == "_CHECKPOINT_METADATA":  # timestamps differ; every field and the handler name must not
            a = {k: v for k, v in a.items() if "timestamp" not in k}
            b = {k: v for k, v in b.items() if "timestamp" not in k}
        if name == "_strings.json":  # the string itself is ours
            a, b = sorted(a), sorted(b)
        assert a == b, f"orbax-checkpoint {version} writes {name} as {b}; orbax_layout.py writes {a}"
    for key in TREE:
        a, b = _zarray(ours, key), _zarray(theirs, key)
        assert a == b, f"orbax-checkpoint {version} stores {key!r} as zarr {b}; orbax_layout.py as {a}"
    assert (pathlib.Path(ours) / "commit_success.txt").exists() == (theirs / "commit_success.txt").exists()
    # and Orbax restores ours (public API) to the same bytes
    got = ocp.PyTreeCheckpointer().restore(ours)
    for key, arr in TREE.items():
        assert common.same_bytes(got[key], arr), key


def test_installed_orbax_is_in_the_supported_range_stated_in_pyproject():
    low, high = orbax_layout.SUPPORTED
    fmt = ".".join
    spec = f"orbax-checkpoint>={fmt(map(str, low))},<{fmt(map(str, high))}"
    pyproject = (pathlib.Path(common.REPO) / "pyproject.toml").read_text()
    assert pyproject.count(f'"{spec}"') == 2, f"pyproject's orbax and test extras should say {spec}"
    installed = tuple(int(x) for x in ocp.__version__.split(".")[:2])
    assert low <= installed < high, f"orbax-checkpoint {ocp.__version__} is outside {spec}: run the layout test above"


def test_no_private_orbax_import_in_jaxquant():
    pkg = pathlib.Path(common.REPO) / "jaxquant"
    hits = [str(p) for p in pkg.rglob("*.py") if "orbax.checkpoint._src" in p.read_text()]
    assert not hits, f"private Orbax modules named in {hits}"
