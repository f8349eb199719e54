"""build.py: one line per extension before its (long) compile; JAXQUANT_CUDA=off removes a stale CUDA module.
No compiler runs here (the commands are recorded)."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture()
def build(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("jaxquant_build_under_test", ROOT / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.ran = []  # (stderr printed before the command, the command)
    monkeypatch.setattr(mod, "_run", lambda cmd, verbose: mod.ran.append((capsys.readouterr().err, cmd)))
    return mod


def test_each_extension_is_announced_before_its_compile(build, tmp_path, monkeypatch):
    build.build_cpu(tmp_path / "_jaxquant_cpu.so")
    said, cmd = build.ran[0]
    assert said.strip() == "jaxquant build: _jaxquant_cpu.so: CPU handlers with " + cmd[0]
    monkeypatch.setattr(build, "find_nvcc", lambda: "/opt/fake-cuda/bin/nvcc")
    build.build_cuda(tmp_path / "_jaxquant_cuda.so")
    said, cmd = build.ran[1]  # announced before nvcc starts, not after the link
    assert cmd[0] == "/opt/fake-cuda/bin/nvcc" and "CUDA handlers with /opt/fake-cuda/bin/nvcc" in said
    assert len(said.strip().splitlines()) == 1


def test_cuda_off_removes_a_stale_cuda_extension(build, tmp_path, monkeypatch, capsys):
    pkg = tmp_path / "jaxquant"
    pkg.mkdir()
    stale = pkg / build.ext_filename("_jaxquant_cuda")
    stale.write_bytes(b"left by an earlier build")
    monkeypatch.setattr(build, "ROOT", tmp_path)
    monkeypatch.setenv("JAXQUANT_CUDA", "off")
    built = build.build_inplace()
    assert [p.name for p in built] == [build.ext_filename("_jaxquant_cpu")] and not stale.exists()
    assert f"removed {stale.name}" in capsys.readouterr().err


def test_backend_summary_says_what_auto_runs_here():
    import jax

    from jaxquant import _ffi

    line = _ffi.backend_summary()
    assert jax.default_backend() in line and "custom calls built for: " in line
    if jax.default_backend() == "cpu":
        want = "the cpu custom calls" if "cpu" in _ffi.built_platforms() else "the pure-JAX reference"
        assert line.endswith(f"impl='auto' runs every op as {want}"), line
        if "cuda" in _ffi.built_platforms():  # built on a machine without a GPU: said to be unused
            assert "cuda: no such device here, so unused" in line, line
