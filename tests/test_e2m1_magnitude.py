"""The E2M1 rounding of the CUDA cast kernels without hardware FP4 conversion (``e2m1_magnitude_bits``,
docs/numerics.md §2 rule 6) against ``float_to_e2m1`` for all 2^32 fp32 inputs: on the host, and on a GPU
as the device compiles it (a fused multiply-add where the host multiplies, then adds). The GPU tests also
compare the kernels' bytes with the reference."""

import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import requires_gpu

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler")
@pytest.mark.slow
def test_e2m1_magnitude_bits_equals_float_to_e2m1_for_every_fp32(tmp_path):
    exe = tmp_path / "check"
    subprocess.run(["c++", "-std=c++17", "-O2", f"-I{ROOT / 'csrc'}",
                    str(ROOT / "tests/cpp/e2m1_magnitude_exhaustive.cc"), "-o", str(exe)], check=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("0 mismatches"), run.stdout


@requires_gpu
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_device_e2m1_magnitude_bits_equals_float_to_e2m1_for_every_fp32(tmp_path):
    exe = tmp_path / "check_gpu"
    # -arch=native: the GPU this runs on; sm_100a and later use the hardware conversion in the kernels, but
    # this checks the software rounding that every chip compiles here
    subprocess.run(["nvcc", "-std=c++17", "-O3", "-fmad=false", "-arch=native", f"-I{ROOT / 'csrc'}",
                    str(ROOT / "tests/cpp/e2m1_magnitude_exhaustive.cu"), "-o", str(exe)], check=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("0 mismatches"), run.stdout
