"""build.py: one line per extension before its (long) compile (on the terminal too when pip captures it);
JAXQUANT_CUDA=off removes a stale CUDA module; a rebuild of unchanged inputs copies the module built from them. No
compiler runs here (the commands are recorded, and each "compile" writes its output)."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture()
def build(monkeypatch, capsys, tmp_path):
    spec = importlib.util.spec_from_file_location("jaxquant_build_under_test", ROOT / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.ran = []  # (stderr printed before the command, the command)

    def run(cmd, verbose):
        mod.ran.append((capsys.readouterr().err, cmd))
        Path(cmd[cmd.index("-o") + 1]).write_text(f"built by command {len(mod.ran)}")

    monkeypatch.setattr(mod, "_run", run)
    monkeypatch.setattr(mod, "BUILD_CACHE", tmp_path / "ext-cache")
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


def test_a_rebuild_of_unchanged_inputs_copies_the_module_built_from_them(build, tmp_path, monkeypatch, capsys):
    """A second ``pip install -e`` (another extra) must not spend nvcc's minute again; a changed source or
    ``--force`` compiles, and the cache keeps one module per name."""
    import shutil

    csrc = tmp_path / "csrc"
    shutil.copytree(build.CSRC, csrc)
    monkeypatch.setattr(build, "CSRC", csrc)
    out = tmp_path / "pkg" / "_jaxquant_cpu.so"
    out.parent.mkdir()
    build.build_cpu(out)
    out.unlink()
    build.build_cpu(out)                                   # the same inputs: copied, no compiler
    assert len(build.ran) == 1 and out.read_text() == "built by command 1"
    assert "the module built from them" in capsys.readouterr().err
    (csrc / "cpu_ops.cc").write_text((csrc / "cpu_ops.cc").read_text() + "\n// changed\n")
    build.build_cpu(out)
    assert len(build.ran) == 2 and out.read_text() == "built by command 2"
    monkeypatch.setenv("JAXQUANT_FORCE_BUILD", "1")
    build.build_cpu(out)
    assert len(build.ran) == 3
    assert [p.read_text() for p in build.BUILD_CACHE.iterdir()] == ["built by command 3"]


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # the child only dup2s and execs
def test_line_reaches_the_terminal_when_pip_captures_the_build():
    """pip (without -v) runs the build with stdout/stderr on a pipe; the line must still reach the user's terminal."""
    import os
    import pty
    import sys

    code = ("import importlib.util; s = importlib.util.spec_from_file_location('b', %r); m = "
            "importlib.util.module_from_spec(s); s.loader.exec_module(m); m._announce('x.so: CUDA handlers')"
            % str(ROOT / "build.py"))
    captured, w = os.pipe()  # as pip: the build's stdout and stderr go to a pipe that pip reads
    pid, term = pty.fork()  # the child's controlling terminal is this pty
    if pid == 0:
        os.dup2(w, 1)
        os.dup2(w, 2)
        os.execv(sys.executable, [sys.executable, "-c", code])
    seen = b""
    while True:
        try:
            chunk = os.read(term, 1024)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    _, status = os.waitpid(pid, 0)
    os.close(w)
    with os.fdopen(captured, "rb") as f:
        piped = f.read()
    assert os.waitstatus_to_exitcode(status) == 0
    assert b"jaxquant build: x.so: CUDA handlers" in seen  # what the user sees
    assert piped.strip() == b"jaxquant build: x.so: CUDA handlers"  # what pip -v shows


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

    from jaxquant.primitives import _ffi

    line = _ffi.backend_summary()
    assert jax.default_backend() in line and "custom calls built for: " in line
    if jax.default_backend() == "cpu":
        want = ("the cpu custom calls, and the pure-JAX reference where that is faster on the CPU (casts, "
                "transposes, rowwise NVFP4 quantization)") if "cpu" in _ffi.built_platforms() else \
            "every op as the pure-JAX reference"
        assert line.endswith(f"impl='auto' runs {want}"), line
        if "cuda" in _ffi.built_platforms():  # built on a machine without a GPU: said to be unused
            assert "cuda: no such device here, so unused" in line, line
