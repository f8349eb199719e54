"""`jaxquant bench` smoke run (what CI executes on the CPU): the table prints and the JSON has its fields."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import jax
import pytest

from jaxquant.cli import bench

from jaxquant import cli

ROOT = Path(__file__).resolve().parent.parent   # the checkout these tests belong to


@pytest.mark.slow
def test_bench_cli_writes_table_and_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    # --no-stages: the per-stage rows are on by default on GPUs only
    assert cli.main(["bench", "--sizes", "32x64", "--iters", "1", "--repeats", "1", "--no-stages",
                     "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["backend"] == jax.default_backend() and result["compute_dtype"] == "bfloat16"
    assert result["source_digest"] == bench.source_digest()
    assert result["copy"][0]["shape"] == "32x64" and result["copy"][0]["copy_gbps"] > 0
    rows = [r for r in result["rows"] if r["dtype"] == "float32"]   # (GPUs also time bfloat16 input)
    assert [r["op"] for r in rows] == ["quantize_fp8", "quantize_fp8+T", "quantize_nvfp4", "quantize_nvfp4+T"]
    for row in rows:
        assert set(bench.ROW_FIELDS) <= set(row) and set(bench.DEVICE_FIELDS) <= set(row), row
        if jax.default_backend() == "gpu":   # kernel time from the profiler: no host dispatch in it
            assert 0 < row["dev_us"]
            assert abs(row["dev_x_floor"] - row["dev_us"] / row["dev_floor_us"]) < 1e-6 * row["dev_x_floor"]
        else:
            assert row["dev_us"] is None and row["dev_x_floor"] is None
        assert row["shape"] == "32x64" and row["dtype"] == "float32" and row["us"] > 0 and row["xla_us"] > 0
        assert abs(row["x_floor"] - row["us"] / row["floor_us"]) < 1e-6 * row["x_floor"]
        assert abs(row["x_xla"] - row["us"] / row["xla_us"]) < 1e-6 * row["x_xla"]
        assert f"{row['op']:18s}" in printed
    n = 32 * 64  # floor bytes: two fp32 reads of x plus the outputs
    assert rows[0]["bytes"] == 2 * n * 4 + n and rows[1]["bytes"] == 2 * n * 4 + 2 * n
    # the master-weight step on the Llama-3-8B layer (dims / 32 off the GPU) against the bf16 gather
    steps = result["group_step"]
    assert [r["op"] for r in steps] == ["step_nvfp4", "step_nvfp4-gathered", "step_nvfp4+T", "step_nvfp4+T-gathered",
                                          "step_fp8", "step_fp8-gathered", "step_fp8+T", "step_fp8+T-gathered"]
    params = sum(m * k for _, (m, k) in bench.LLAMA3_8B_LAYER) // (1 if jax.default_backend() == "gpu" else 32 * 32)
    for row in steps:
        assert set(bench.STEP_FIELDS) <= set(row), row
        assert row["devices"] == len(jax.devices()) and row["params"] == params and row["us"] > 0
        assert abs(row["x_bf16_gather"] - row["us"] / row["bf16_gather_us"]) < 1e-6 * row["x_bf16_gather"]
        assert f"{row['op']:18s}" in printed
    # NVFP4 gathers half a byte per weight plus its scales, FP8 one byte: a quarter / half of bf16's bytes
    assert steps[0]["gathered_mb"] == steps[1]["gathered_mb"] < steps[4]["gathered_mb"] < 2 * params / 2**20


@pytest.mark.slow
def test_bench_cli_ops_selects_rows_by_name_or_pattern(tmp_path):
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--sizes", "32x64", "--iters", "1", "--repeats", "1", "--stages", "--dtypes", "float32",
                     "--no-device-time", "--ops", "quantize_nvfp4,fp8_*", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["op"] for r in result["rows"]] == ["quantize_nvfp4", "fp8_stats", "fp8_quantize", "fp8_quantize+T"]
    assert result["group_step"] == []                     # no step_* op selected
    assert cli.main(["bench", "--sizes", "32x64", "--iters", "1", "--repeats", "1", "--dtypes", "float32",
                     "--no-device-time", "--ops", "step_fp8*", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["rows"] == []
    assert [r["op"] for r in result["group_step"]] == ["step_fp8", "step_fp8-gathered", "step_fp8+T",
                                                       "step_fp8+T-gathered"]


def test_gather_summary_sums_all_gather_kernels_over_streams():
    """An NVFP4 step's profile with 4 gather pieces (2 x H200): one piece on the compute stream, three on another."""
    kernel = "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
    prof = {
        "XLA Ops": {"all-gather-start": (400.0, 4.0)},        # HLO ops: not kernels, not counted
        "Stream #24(Compute)": {kernel: (74.4, 1.0), "group_cast_kernel": (221.1, 4.0)},
        "Stream #104(Compute)": {kernel: (281.5, 3.0)},
        "host": {kernel: (9.0, 1.0)},
    }
    line = bench.gather_summary(prof, 52e6)
    assert line.startswith("all-gather kernels: 355.9 µs per call in 4 launches (AllGather_RING_LL)"), line
    assert line.endswith("52.0 MB received per device: 146 GB/s"), line
    assert bench.gather_summary({"Stream #24(Compute)": {"group_cast_kernel": (221.1, 4.0)}}, 52e6) is None
    assert bench.gather_summary({}, 52e6) is None


def test_kernel_time_counts_overlapping_events_once():
    """Kernel time is the time during which any event runs: a kernel launched while the one before it
    drains (programmatic dependent launch) overlaps it, and the overlap counts once; gaps count not at all."""
    events = [(0, 10, "stats"), (5, 12, "cast starts early"), (12, 15, "touching"), (20, 30, "next call"),
              (25, 26, "nested")]
    assert bench._covered_ns(events) == 15 + 10
    assert bench._covered_ns([]) == 0
    assert bench._covered_ns([(3, 4, "one")]) == 1


@pytest.mark.skipif(shutil.which("sha1sum") is None, reason="scripts/source_digest.sh needs sha1sum (coreutils)")
def test_source_digest_matches_the_shell_script_and_follows_the_sources(tmp_path):
    """scripts/source_digest.sh (in GPU reports) and bench.source_digest() (in the JSON) name the
    same code; any edit of a source file changes the digest, a non-source file does not."""
    script = ROOT / "scripts" / "source_digest.sh"
    shell = subprocess.run(["bash", str(script)], capture_output=True, text=True, check=True).stdout.strip()
    assert shell == bench.source_digest(ROOT) and len(shell) == 12
    (tmp_path / "jaxquant").mkdir()
    (tmp_path / "csrc").mkdir()
    (tmp_path / "jaxquant" / "a.py").write_text("x = 1\n")
    (tmp_path / "csrc" / "k.cu").write_text("// kernel\n")
    before = bench.source_digest(tmp_path)
    (tmp_path / "jaxquant" / "notes.txt").write_text("not a source")
    assert bench.source_digest(tmp_path) == before
    (tmp_path / "csrc" / "k.cu").write_text("// kernel, edited\n")
    assert bench.source_digest(tmp_path) != before


@pytest.mark.slow
def test_bench_alternating_times_both_loops_and_names_a_bad_op():
    """benchmarks/bench_alternating.py (the wall-clock A/B behind the FP8 cast grid) on a tiny tensor:
    one line per loop with both times and their ratio; an unknown op is refused by name."""
    import os
    import sys

    script = ROOT / "benchmarks" / "bench_alternating.py"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    run = lambda *a: subprocess.run([sys.executable, str(script), *a], capture_output=True, text=True, timeout=300,
                                    env=env)
    ok = run("fp8_quantize:32x64:float32", "--rounds", "2", "--iters", "1")
    assert ok.returncode == 0, ok.stderr[-2000:]
    lines = [l for l in ok.stdout.splitlines() if l.startswith("fp8_quantize:32x64:float32")]
    assert [l.split()[1] for l in lines] == ["rebind", "keep"], ok.stdout
    for line in lines:
        custom, xla, ratio = (float(line.split()[i]) for i in (3, 6, 9))
        # the times print rounded to 0.1 us and the ratio to 0.001: the ratio of the printed times may differ from
        # the printed ratio by what that rounding moves it
        slack = 0.05 / xla * (1 + custom / xla) + 0.0006
        assert custom > 0 and xla > 0 and abs(ratio - custom / xla) <= slack, line
    bad = run("no_such_op:32x64:float32")
    assert bad.returncode != 0 and "unknown op 'no_such_op'" in bad.stderr


def test_bench_defaults_are_the_ones_help_names_and_no_json_unless_asked(tmp_path, monkeypatch, capsys):
    """The iteration counts that run are the defaults --help names for this backend, and without --json no
    file is written (in the working directory or anywhere)."""
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if isinstance(getattr(a, "choices", None), dict))
    bench_parser = subparsers.choices["bench"]
    helps = {a.dest: a.help for a in bench_parser._actions}
    gpu = jax.default_backend() == "gpu"
    assert f"default {bench.GPU_ITERS} on a GPU, {bench.CPU_ITERS} elsewhere" in helps["iters"]
    assert f"default {bench.GPU_REPEATS} on a GPU, {bench.CPU_REPEATS} elsewhere" in helps["repeats"]
    assert f"default {bench.GPU_SIZES} on a GPU, {bench.CPU_SIZES} elsewhere" in helps["sizes"]
    assert "no JSON file" in helps["json"] and bench_parser.get_default("json") is None
    iters, repeats = (bench.GPU_ITERS, bench.GPU_REPEATS) if gpu else (bench.CPU_ITERS, bench.CPU_REPEATS)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "--sizes", "32x64", "--dtypes", "float32", "--ops", "quantize_fp8", "--no-group",
                     "--no-device-time"]) == 0
    printed = capsys.readouterr().out
    assert f"times: median of {repeats} x {iters} dispatches" in printed
    assert "no JSON written (--json PATH writes one)" in printed
    assert list(tmp_path.iterdir()) == []
    # explicit counts are used as given, on every backend
    assert cli.main(["bench", "--sizes", "32x64", "--dtypes", "float32", "--ops", "quantize_fp8", "--no-group",
                     "--no-device-time", "--iters", "4", "--repeats", "2"]) == 0
    assert "times: median of 2 x 4 dispatches" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--sizes", "foo"], "--sizes: each size must be ROWSxCOLS"),
    (["--sizes", "0x0"], "--sizes: both dimensions must be positive, got '0x0'"),
    (["--sizes", "20x32"], "--sizes: NVFP4 2D block scaling needs M (rows) to be a positive multiple of 16"),
    (["--sizes", "32x20", "--ops", "quantize_nvfp4"], "--sizes: NVFP4 2D block scaling needs K (cols)"),
    (["--sizes", "20x32", "--ops", "fp8_*", "--stages"], "multiple of 16"),   # the stage rows start from NVFP4's stats
    (["--dtypes", "int8"], "--dtypes: each must be one of the quantizers' input dtypes float32, bfloat16; got 'int8'"),
    (["--ops", "nonexistent"], "--ops: 'nonexistent' selects none of this run's ops (quantize_fp8,"),
    (["--ops", "step_*", "--no-group"], "--group adds step_*"),
    (["--iters", "0"], "--iters: must be at least 1, got 0"),
    (["--repeats", "0"], "--repeats: must be at least 1, got 0"),
    (["--json", "{tmp}/missing/bench.json"], "--json: {tmp}/missing does not exist"),
    (["--json", "{tmp}"], "--json: {tmp} is a directory"),
])
def test_bench_refuses_bad_options_before_any_work(tmp_path, capsys, monkeypatch, argv, message):
    """One line on stderr naming the option and its rule, exit 2, nothing timed (no table) and nothing written."""
    monkeypatch.chdir(tmp_path)
    rc = cli.main(["bench", *(a.format(tmp=tmp_path) for a in argv)])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert lines[0].startswith("jaxquant bench: error: --") and message.format(tmp=tmp_path) in lines[0], lines[0]
    assert captured.out == "" and list(tmp_path.iterdir()) == []


def test_bench_times_fp8_alone_on_any_shape(tmp_path, capsys):
    """The 16-multiple rule is NVFP4's: FP8 rows of a 20x30 tensor are timed."""
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--sizes", "20x30", "--ops", "quantize_fp8", "--iters", "1", "--repeats", "1",
                     "--no-group", "--no-device-time", "--dtypes", "float32", "--json", str(out)]) == 0
    assert [(r["op"], r["shape"]) for r in json.loads(out.read_text())["rows"]] == [("quantize_fp8", "20x30")]


def test_stage_rows_need_the_16_grid_only_when_selected():
    """On a GPU the stage rows are on by default; an --ops that selects none of them takes any shape (the rule is
    the stage rows' NVFP4 statistics'), one that selects one refuses a shape off the 16-grid."""
    import argparse

    from jaxquant.cli import bench

    args = lambda ops: argparse.Namespace(sizes="20x30", dtypes="float32", iters=1, repeats=1, stages=None, ops=ops,
                                          group=False, json=None)
    assert bench.check_args(args("quantize_fp8"), gpu=True)["stages"] is False
    with pytest.raises(ValueError, match="--sizes"):
        bench.check_args(args("fp8_stats"), gpu=True)
