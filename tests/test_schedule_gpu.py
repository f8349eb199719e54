"""The FSDP step's collectives, as XLA's GPU latency-hiding scheduler places them around jaxquant's custom calls
(``jaxquant/primitives/_ffi.py``, ``LATENCY_HINTS``): compiled for two GPUs of the attached GPU's kind that need not
exist (``jax.experimental.topologies``' compile-only devices), so one GPU runs it; nothing is executed.

The program is benchmarks/bench_e2e.py's FP8 ``scan`` step at the 13B shape's layers (hidden 5120, FFN 13824, 40 heads,
``jax.checkpoint`` saving nothing), 4 of them: a scan body's schedule does not depend on the layer count. Without
an estimate of what a custom call costs, the scheduler (jax 0.11.2) took the step's GEMMs for a few microseconds
each and, at the 40-layer shape, left three of the four weight-gradient reduce-scatters of each backward iteration
synchronous, with nothing to run under: exposed communication in every layer (36.5 ms a step on 2 x H200,
docs/performance.md; the gradients were then scaled before their reduce-scatter, fsdp.scales_after_the_sum). With
the estimates every reduce-scatter and all-gather of the backward loop is asynchronous, with kernels scheduled
between its start and its end, and a weight-gradient reduce-scatter runs under jaxquant's GEMMs.

The 4-layer shape without ``jax.checkpoint`` is not checked so: its weight-gradient GEMMs read slices of the stacked
residuals, and XLA wraps each in a dynamic-slice fusion whose time its scheduler estimates without the GEMM's
attribute; three reduce-scatters of its backward iteration stay synchronous with the estimates too.
"""

import re
import sys
from pathlib import Path

import jax
import pytest

from jaxquant.primitives import _ffi

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU backend"),
              pytest.mark.skipif(not _ffi.has_target("cuda", "jq_fp8_gemm"),
                                 reason="the CUDA extension was built without cuBLASLt (build.py --cuda on says why)")]

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))

COLLECTIVE = r"all-gather|reduce-scatter|all-reduce"


def _compiled_scan_step(monkeypatch) -> str:
    """The step's compiled HLO for two compile-only GPUs, the estimates on (whatever the environment says)."""
    import compile_time

    monkeypatch.setattr(_ffi, "LATENCY_HINTS", True)
    a = compile_time.parse_args(["--topology", "2", "--layers", "4", "--hidden", "5120", "--heads", "40",
                                 "--kv-heads", "40", "--ffn", "13824", "--remat", "nothing_saved"])
    return compile_time.compile_step(a, "jq-fp8")[2]


def _loop_bodies(hlo: str) -> dict:
    """{name: instruction lines in schedule order} of every while loop's body in a scheduled HLO module."""
    names = re.findall(r" while\(.*?body=%([\w.\-]+)", hlo)
    bodies = {}
    for name in names:
        m = re.search(rf"^%{re.escape(name)} \(.*?\{{\n(.*?)^\}}", hlo, re.M | re.S)
        bodies[name] = m.group(1).splitlines()
    return bodies


def _backward_body(hlo: str) -> list:
    """The loop body that reduce-scatters the weight gradients (the backward ``scan``)."""
    found = [lines for lines in _loop_bodies(hlo).values()
             if any(re.search(r" reduce-scatter(-start)?\(", line) for line in lines)]
    assert len(found) == 1, f"{len(found)} loop bodies reduce-scatter"
    return found[0]


def test_every_backward_collective_is_asynchronous_with_the_estimates(monkeypatch):
    lines = _backward_body(_compiled_scan_step(monkeypatch))
    sync = [line.strip()[:160] for line in lines if re.search(rf" ({COLLECTIVE})\(", line)]
    assert not sync, "synchronous collectives in the backward loop:\n" + "\n".join(sync)
    starts = {}
    for i, line in enumerate(lines):
        m = re.match(r"\s*%([\w.\-]+) = .* (all-gather|reduce-scatter)-start\(", line)
        if m:
            starts[m.group(1)] = i
    assert any("reduce-scatter" in lines[i] for i in starts.values())
    gemm_under_a_reduce_scatter = False
    for name, i in starts.items():
        done = next(j for j, line in enumerate(lines) if re.search(rf"-done\(%{re.escape(name)}\)", line))
        under = [line for line in lines[i + 1:done] if re.search(r" (fusion|custom-call)\(", line)]
        assert under, f"{name} has no kernel between its start and its end"
        gemm_under_a_reduce_scatter |= "reduce-scatter" in lines[i] and any(
            'custom_call_target="jq_fp8_gemm"' in line for line in under)
    assert gemm_under_a_reduce_scatter

