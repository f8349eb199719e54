"""benchmarks/bench_flax.py smoke run on 8 simulated CPU devices: the flax NNX Llama without jaxquant, the same model
unchanged under make_train_step (FP8) and the same math hand-written with jq.dense each report a finite step time and
loss, and the configs that start from the same parameters train alike."""

from __future__ import annotations

import functools
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
@pytest.mark.extended
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


def _adapter_takes_an_example_batch() -> bool:
    """Whether this jaxquant's flax adapter is issue 53's (``jq.flax_loss(model, loss, batch=...)``), which
    ``--model einsum`` / ``dense-general`` train through."""
    import inspect

    import jaxquant as jq

    return "batch" in inspect.signature(jq.flax_loss).parameters


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("model", ["einsum"])   # dense-general's adapter path: tests/test_flax_adapter_styles.py
def test_bench_flax_style_models_plain_and_fp8(tmp_path, model):
    """--model einsum / dense-general (tests/flax_styles.py's models, CPU size): flax-plain trains (its loss falls from
    about log(vocab)); flax-jq-fp8 trains alike through the adapter's example-batch API, or, on a jaxquant without it,
    is refused in one line naming what it needs while flax-plain still runs."""
    out = tmp_path / "styles.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_flax.py"), "--tiny", "--model", model,
                           "--steps", "2", "--configs", "flax-plain,flax-jq-fp8", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    report = json.loads(out.read_text())
    results = {r["config"]: r for r in report["results"]}
    assert report["args"]["model"] == model and report["args"]["vocab"] == 64, report["args"]
    plain = results["flax-plain"]
    assert "error" not in plain, plain
    losses = plain["losses"]                  # 2 warm-up and 2 timed steps on one batch
    assert abs(losses[0] - math.log(64)) < 1.0 and losses[-1] < losses[0], losses
    assert f"--model {model} (vocabulary 64): cpu x 8, 2 layers, hidden 64" in proc.stdout, proc.stdout
    fp8 = results["flax-jq-fp8"]
    if _adapter_takes_an_example_batch():
        assert proc.returncode == 0 and "error" not in fp8, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert fp8["losses"][0] == pytest.approx(losses[0], rel=2e-2), (fp8["losses"], losses)   # FP8's error
        assert fp8["losses"][-1] < fp8["losses"][0], fp8["losses"]
    else:
        assert proc.returncode == 1 and "needs jq.flax_loss(model, loss, batch=...)" in fp8["error"], fp8


@pytest.mark.extended   # a benchmark smoke (docs/development.md: the README command's time budget)
def test_head_fp8_config_quantizes_the_untied_head_and_nothing_else_differs():
    """``flax-jq-fp8-head``'s rule (``bench_flax.HEAD_FP8_RECIPES``) on model (b): the head FP8 where the default keeps
    it bf16; every other parameter's recipe as the default's."""
    import jax
    import optax

    import jaxquant as jq
    from jaxquant.training.plan_view import plan_row

    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_flax
    import flax_styles as fs

    cfg = fs.StyleConfig(kv_heads=2, layers=1)
    loss_fn = jq.flax_loss(fs.linen_dense_general_init(cfg), functools.partial(fs.linen_dense_general_loss, cfg=cfg),
                           batch=fs.example_batch(cfg, batch=8, seed=3))
    params = jq.flax_params(loss_fn)
    mesh = jax.make_mesh((len(jax.devices()),), ("fsdp",))
    policy = jq.MixedPrecisionPolicy(compute_weights="fp8")
    recipes = lambda rules: {r.path: plan_row(r)["recipe"] for r in jq.make_train_step(
        loss_fn, optax.sgd(0.1), mesh=mesh, policy=policy, rules=rules).plan(params).rules}
    default, head = recipes(loss_fn.default_rules()), recipes(loss_fn.rules(recipes=bench_flax.HEAD_FP8_RECIPES))
    assert default["head.kernel"] == "bf16" and head["head.kernel"] == "fp8", (default, head)
    assert {k: v for k, v in head.items() if k != "head.kernel"} == {k: v for k, v in default.items()
                                                                     if k != "head.kernel"}
    assert "fp8" in default.values()
