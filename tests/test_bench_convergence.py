"""benchmarks/bench_convergence.py (issue 46): at the smoke size on 8 simulated CPU devices, every configuration
(plain flax/JAX bf16, jaxquant bf16 / FP8 / NVFP4) trains the same Llama from the same parameters on the same bytes,
and the results (JSON, markdown table, held-out and training loss plots) say so; bad options are one line before
any work."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("flax")
pytest.importorskip("matplotlib", reason='the benchmark draws with matplotlib: pip install "jaxquant[train]"')

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks" / "bench_convergence.py"
CONFIGS = ("plain-bf16", "jq-bf16", "jq-fp8", "jq-nvfp4")


@pytest.mark.slow
@pytest.mark.extended
def test_bench_convergence_smoke_trains_every_config_alike(tmp_path):
    out = tmp_path / "results"
    env = dict(os.environ, JAX_PLATFORMS="cpu")   # XLA_FLAGS as tests/conftest.py set them (8 devices)
    proc = subprocess.run([sys.executable, str(BENCH), "--size", "smoke", "--steps", "4", "--eval-every", "2",
                           "--out", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "results.json").read_text())
    results = {r["config"]: r for r in report["results"]}
    assert tuple(results) == CONFIGS
    tokens = 16 * 64                                       # the smoke size's batch x seq
    for config, r in results.items():
        assert [t for t, _ in r["heldout"]] == [0, 2 * tokens, 4 * tokens], (config, r["heldout"])
        assert all(math.isfinite(v) for _, v in r["heldout"]) and len(r["train"]) == 4, r
        assert r["steps"] == 4 and r["tokens"] == 4 * tokens and r["tokens_per_s"] > 0, r
        assert r["heldout"][-1][1] < r["heldout"][0][1] - 0.5, (config, r["heldout"])    # it learns
        assert f"[{config}] step 4/4" in proc.stdout
    start = {r["heldout"][0][1] for r in results.values()}
    assert len(start) == 1, start        # the same parameters, evaluated the same way: one starting loss
    plain = results["plain-bf16"]["heldout"][-1][1]
    assert abs(results["jq-bf16"]["heldout"][-1][1] - plain) < 0.01, results      # bf16 either way
    for config in ("jq-fp8", "jq-nvfp4"):
        assert abs(results[config]["heldout"][-1][1] - plain) < 0.1, results      # within the recipes' error
    table = (out / "results.md").read_text()
    for config, r in results.items():
        assert f"| {config} | {r['final_heldout']:.4f} |" in table, table
    for png in ("heldout.png", "train.png"):
        assert (out / png).read_bytes().startswith(b"\x89PNG\r\n\x1a\n"), png


def _bench():
    spec = importlib.util.spec_from_file_location("bench_convergence", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv,message", [
    (["--configs", "jq-fp8,jq-int4"], "--configs: must be a comma-separated subset of"),
    (["--steps", "0"], "--steps: must be at least 1, got 0"),
    (["--batch", "12"], "--batch: 12 sequences do not split over the 8 devices"),
    (["--text", "{tmp}/nowhere"], "--text: {tmp}/nowhere does not exist"),
    (["--out", "{tmp}/f"], "--out: {tmp}/f is not a directory"),
], ids=["configs", "steps", "batch", "text", "out"])
def test_bench_convergence_refuses_bad_options_before_any_work(tmp_path, capsys, argv, message):
    import jax

    if len(jax.devices()) != 8:
        pytest.skip("needs 8 (simulated) devices")
    (tmp_path / "f").write_text("a file")
    fill = lambda s: s.format(tmp=tmp_path)
    rc = _bench().main(["--size", "smoke", "--out", str(tmp_path / "out"), *map(fill, argv)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"bench_convergence.py: error: {fill(message)}"), err
    assert not (tmp_path / "out").exists()


def test_merge_puts_runs_of_the_same_settings_in_one_table_and_refuses_others(tmp_path, capsys):
    """--merge: configurations run apart (e.g. one per GPU at once) in one table and plot, in the benchmark's order;
    runs of other settings are refused in one line."""
    header = "flax NNX Llama (test)"
    settings = dict(size="base", steps=3, batch=4, seq=8, eval_every=1, eval_batches=1, lr=1e-3, seed=0, text=None)

    def run(name, config, final, **changed):
        r = {"config": config, "heldout": [[0, 5.0], [32, final]], "train": [5.0, 4.0, 3.0], "final_heldout": final,
             "final_train": 3.0, "steps": 3, "tokens": 96, "tokens_per_s": 1000.0, "step_ms": 32.0}
        path = tmp_path / name
        path.write_text(json.dumps({"header": header, "settings": settings | changed, "results": [r]}))
        return str(path)

    a, b = run("a.json", "jq-nvfp4", 1.5), run("b.json", "plain-bf16", 1.25)
    out = tmp_path / "merged"
    assert _bench().main(["--merge", a, b, "--out", str(out)]) == 0
    table = (out / "results.md").read_text()
    assert table.index("| plain-bf16 | 1.2500 | +0.0000 |") < table.index("| jq-nvfp4 | 1.5000 | +0.2500 |"), table
    assert (out / "heldout.png").read_bytes().startswith(b"\x89PNG")
    capsys.readouterr()
    c = run("c.json", "jq-fp8", 1.4, seed=1)
    assert _bench().main(["--merge", a, c, "--out", str(tmp_path / "no")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"bench_convergence.py: error: --merge: {c} was run with other settings (seed)"], err
