"""benchmarks/compile_time.py compiles a config's step on abstract inputs: the abstract state bench_e2e builds for it
(``abstract=True``) is the state it would allocate (structure, shapes, dtypes and shardings), so the program timed
is the program that runs."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

pytest.importorskip("optax")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_e2e  # noqa: E402
import compile_time  # noqa: E402


def _tiny():
    a = compile_time.parse_args(["--tiny", "--layers", "1"])
    a.seq, a.batch = 16, 1
    return a


@pytest.mark.parametrize("config", ["plain-scan", "jq-fp8"])
def test_the_abstract_state_is_the_allocated_one(config):
    if len(jax.devices()) != 8:
        pytest.skip("needs 8 (simulated) devices")
    a, mesh = _tiny(), Mesh(np.array(jax.devices()), ("fsdp",))
    make = ((lambda **kw: bench_e2e._make_plain(a, mesh, True, **kw)) if config == "plain-scan"
            else (lambda **kw: bench_e2e._make_jq(a, mesh, "fp8", True, **kw)))
    _, real = make()
    _, abstract = make(abstract=True)
    real_leaves, real_def = jax.tree.flatten(real)
    abstract_leaves, abstract_def = jax.tree.flatten(abstract)
    assert real_def == abstract_def
    assert all(isinstance(s, jax.ShapeDtypeStruct) for s in abstract_leaves)
    for r, s in zip(real_leaves, abstract_leaves):
        assert (r.shape, r.dtype) == (s.shape, s.dtype)
        assert r.sharding.is_equivalent_to(s.sharding, r.ndim), (r.sharding, s.sharding)


def test_compile_one_times_lowering_and_compiling():
    r = compile_time.compile_one(_tiny(), "jq-fp8-loop")
    assert r["config"] == "jq-fp8-loop" and r["lower_s"] > 0 and r["compile_s"] > 0


def test_parse_args_takes_topology_and_hlo_beside_bench_e2es_options(tmp_path):
    a = compile_time.parse_args(["--topology", "2", "--hlo", str(tmp_path), "--layers", "3", "--configs", "jq-fp8"])
    assert (a.topology, a.hlo, a.layers, a.configs) == (2, str(tmp_path), 3, "jq-fp8")
    assert compile_time.parse_args(["--layers", "3"]).topology == 0


def test_compile_one_writes_the_compiled_hlo(tmp_path):
    a = _tiny()
    a.hlo = str(tmp_path)
    r = compile_time.compile_one(a, "jq-fp8-loop")
    text = (tmp_path / "jq-fp8-loop.hlo.txt").read_text()
    assert text.startswith("HloModule")
    assert compile_time.breakdown.collective_counts(text) == {"sync": r["sync"], "async": r["async"]}
