"""The conversion benchmark script runs end to end (tiny size; the >= 2 GB run is manual)."""

import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from ckpt_helpers import common  # noqa: E402


@pytest.mark.slow
@pytest.mark.extended
def test_bench_ckpt_convert_runs_and_reports_throughput_and_rss():
    r = subprocess.run([sys.executable, os.path.join(common.REPO, "benchmarks", "bench_ckpt_convert.py"),
                        "--size-gb", "0.01", "--tensor-mb", "2"], env=common.env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for name in ("DCP -> DCP", "DCP -> Orbax", "Orbax -> DCP"):
        line = next(l for l in r.stdout.splitlines() if l.startswith(name))
        assert "GB/s" in line and "peak RSS" in line
