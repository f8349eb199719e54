"""benchmarks/bench_flax.py smoke run on 8 simulated CPU devices: the flax NNX Llama without jaxquant, the same model
unchanged under make_train_step (FP8) and the same math hand-written with jq.dense each report a finite step time and
loss, and the configs that start from the same parameters train alike."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("flax")

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ("flax-plain", "flax-jq-fp8", "hand-jq-fp8")


@pytest.mark.slow
def test_bench_flax_tiny_reports_every_config_and_the_losses_agree(tmp_path):
    out = tmp_path / "flax.json"
    # the children compile as this session does (tests/conftest.py's XLA_FLAGS: 8 devices, LLVM's optimisation off)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_flax.py"), "--tiny", "--steps", "2",
                           "--configs", ",".join(CONFIGS), "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = {r["config"]: r for r in json.loads(out.read_text())["results"]}
    assert set(results) == set(CONFIGS)
    for config, r in results.items():
        assert "error" not in r, (config, r)
        assert r["devices"] == 8 and r["flags"] == "default", r
        assert math.isfinite(r["step_ms"]) and r["step_ms"] > 0, r
        assert math.isfinite(r["loss"]) and r["loss"] > 0, r
        assert f"| default | {config} | {r['step_ms']:.2f} |" in proc.stdout
    flax, hand, plain = (results[c]["loss"] for c in ("flax-jq-fp8", "hand-jq-fp8", "flax-plain"))
    # the same parameters (the hand-written ones are the flax kernels transposed) and batch: after the 2 warm-up and
    # 2 timed steps the FP8 losses agree within bf16 rounding (their first steps' losses are equal; Adam's
    # normalized updates carry the GEMMs' last-bit differences between the two layouts forward)
    assert flax == pytest.approx(hand, rel=2 ** -8), (flax, hand)
    # the unquantized model: within FP8's error of the two
    assert plain == pytest.approx(hand, rel=2e-2), (plain, hand)
    assert "flax-jq-fp8 " in proc.stdout and "vs hand-jq-fp8" in proc.stdout and "x flax-plain" in proc.stdout
