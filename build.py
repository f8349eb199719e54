#!/usr/bin/env python3
"""Builds jaxquant's XLA FFI extension modules.

  _jaxquant_cpu   always: csrc/cpu_ops.cc + csrc/module.cc with the system C++ compiler.
  _jaxquant_cuda  when nvcc is found (or --cuda on): csrc/cuda_ops.cu + csrc/cuda_group_ops.cu for sm_90
                  (software E2M1 rounding) and sm_100a (hardware FP4 conversion), plus PTX for newer chips; and
                  csrc/cuda_gemm.cu, the FP8 and scaled bf16 GEMMs on cuBLASLt, when cuBLASLt's header is found
                  (find_cublaslt).

Both compile against the XLA FFI headers of the *installed* jaxlib (jax.ffi.include_dir()) and
record its version, which jaxquant checks at import. Used by setup.py during `pip install`, or
directly: `python build.py` builds in place into jaxquant/.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"
CUDA_ARCH_FLAGS = [
    "-gencode=arch=compute_90,code=sm_90",
    "-gencode=arch=compute_100a,code=sm_100a",
    "-gencode=arch=compute_90,code=compute_90",
]
CUDA_ARCHS = "sm_90,sm_100a,compute_90"
BUILD_CACHE = ROOT / "build" / "ext-cache"   # the latest module built of each name, under its inputs' key
CUDA_SOURCES = [CSRC / "cuda_ops.cu", CSRC / "cuda_group_ops.cu", CSRC / "cuda_gemm.cu"]  # single; grouped; GEMM


def find_nvcc() -> str | None:
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def cuda_home(nvcc: str) -> Path:
    path = Path(nvcc).resolve().parent.parent
    if (path / "lib64").exists() or (path / "targets").exists():
        return path
    return Path("/usr/local/cuda")


def _cublaslt_homes(cuda: Path | None):
    """Where cuBLASLt may be, in order: $JAXQUANT_CUBLAS_HOME, the nvidia-cublas wheel of this Python (JAX's CUDA
    plugin depends on it: ``nvidia/cu13``, or ``nvidia/cublas`` for CUDA 12), the CUDA toolkit."""
    if os.environ.get("JAXQUANT_CUBLAS_HOME"):
        yield Path(os.environ["JAXQUANT_CUBLAS_HOME"])
    for entry in sys.path:
        for sub in ("cu13", "cublas"):
            yield Path(entry or ".") / "nvidia" / sub
    if cuda is not None:
        yield cuda
        yield cuda / "targets" / "x86_64-linux"


def find_cublaslt(cuda: Path | None = None) -> tuple[Path, str] | None:
    """(include folder, library file) of the first cuBLASLt found (_cublaslt_homes), or None: the CUDA module then
    has no GEMMs of its own and Python keeps XLA's. The library file is the one of the header's major version (its
    soname), in the same home's lib/ or lib64/; "" when only the header is there (the module opens the library by its
    soname at run time, JAX's copy first: csrc/cuda_gemm.cu), which is also enough to compile."""
    if os.environ.get("JAXQUANT_CUBLASLT") == "off":
        return None
    for home in _cublaslt_homes(cuda):
        header = home / "include" / "cublasLt.h"
        if not header.is_file():
            continue
        major = None
        api = home / "include" / "cublas_api.h"
        for line in (api.read_text(errors="replace").splitlines() if api.is_file() else ()):
            if line.startswith("#define CUBLAS_VER_MAJOR"):
                major = line.split()[-1]
        libs = [home / d / f"libcublasLt.so.{major}" for d in ("lib", "lib64")] if major else []
        library = next((p for p in libs if p.is_file()), None)
        return home / "include", str(library.resolve()) if library else ""
    return None


def want_cuda(mode: str | None = None) -> bool:
    mode = mode or os.environ.get("JAXQUANT_CUDA", "auto")
    if mode not in ("auto", "on", "off"):
        raise SystemExit(f"JAXQUANT_CUDA / --cuda: must be auto, on or off, got {mode!r}")
    if mode == "off":
        return False
    if find_nvcc() is None:
        if mode == "on":
            raise SystemExit("--cuda on: nvcc not found (set CUDA_HOME or put nvcc on PATH)")
        return False
    return True


def _common_flags(module: str, suffix: str, archs: str) -> list[str]:
    import jax
    import jaxlib
    import pybind11

    return [
        "-std=c++17", "-O3", "-fPIC",
        f"-I{CSRC}", f"-I{jax.ffi.include_dir()}", f"-I{pybind11.get_include()}",
        f"-I{sysconfig.get_paths()['include']}",
        f"-DJQ_MODULE={module}", f"-DJQ_SUFFIX={suffix}",
        f'-DJQ_JAXLIB_VERSION="{jaxlib.__version__}"', f'-DJQ_CUDA_ARCHS="{archs}"',
    ]


def _run(cmd: list[str], verbose: bool) -> None:
    if verbose:
        print("+", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=not verbose, text=True)
    if proc.returncode != 0:
        sys.stderr.write((proc.stdout or "") + (proc.stderr or ""))
        raise SystemExit(f"jaxquant build failed: {' '.join(cmd[:2])} ... exited {proc.returncode}")


def _announce(line: str) -> None:
    """One line per extension, before its compile starts (nvcc takes a minute or more).

    On stderr (``python build.py``, ``pip install -v``). pip without ``-v`` captures that and shows only
    "still running...", so when stderr is not a terminal the line also goes to the controlling terminal, if
    there is one (none in CI: then stderr alone).
    """
    text = f"jaxquant build: {line}"
    print(text, file=sys.stderr, flush=True)
    if sys.stderr.isatty():
        return
    try:
        with open("/dev/tty", "w") as term:
            term.write(text + "\n")
    except OSError:
        pass


def _build_key(tools: list[str], flags: list[str]) -> str:
    """What an extension is built from: every file of csrc/, the flags computed at build time (jaxlib's version and
    include path), this file (its commands and fixed flags) and each compiler's version: modules built from one key
    are the same."""
    h = hashlib.sha256()
    for tool in tools:
        try:
            version = subprocess.run([tool, "--version"], capture_output=True, text=True).stdout
        except OSError as e:   # the compile that follows names the problem
            version = f"not runnable: {e}"
        h.update(f"{tool}\0{version}\0".encode())
    h.update("\0".join(flags).encode() + Path(__file__).read_bytes())   # and the commands written here
    for path in sorted(p for p in CSRC.rglob("*") if p.is_file()):
        h.update(f"\0{path.relative_to(CSRC)}\0".encode() + path.read_bytes())
    return h.hexdigest()


def _cache_entry(output: Path, key: str) -> Path:
    return BUILD_CACHE / f"{output.name}.{key[:20]}"


def _from_cache(output: Path, key: str) -> bool:
    """A re-install (``pip install -e .`` again, e.g. for another extra) copies the module built from the same
    inputs instead of compiling again (nvcc takes a minute); ``python build.py --force`` compiles."""
    entry = _cache_entry(output, key)
    if os.environ.get("JAXQUANT_FORCE_BUILD") == "1" or not entry.is_file():
        return False
    output.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(entry, output)
    _announce(f"{output.name}: unchanged csrc/, flags and compilers: the module built from them ({entry})")
    return True


def _built(output: Path, key: str) -> Path:
    """Keeps the module just built as the cache's one entry for its name."""
    BUILD_CACHE.mkdir(parents=True, exist_ok=True)
    for old in BUILD_CACHE.glob(f"{output.name}.*"):
        old.unlink()
    entry = _cache_entry(output, key)
    shutil.copy2(output, entry.with_name(entry.name + ".tmp"))
    os.replace(entry.with_name(entry.name + ".tmp"), entry)
    return output


def build_cpu(output: Path, verbose: bool = False) -> Path:
    cxx = os.environ.get("CXX", "c++")
    flags = _common_flags("_jaxquant_cpu", "Cpu", "")
    key = _build_key([cxx], flags)
    if _from_cache(output, key):
        return output
    _announce(f"{output.name}: CPU handlers with {cxx}")
    _run([cxx, *flags, "-shared", str(CSRC / "cpu_ops.cc"), str(CSRC / "module.cc"), "-o", str(output)], verbose)
    return _built(output, key)


def build_cuda(output: Path, verbose: bool = False) -> Path:
    nvcc = find_nvcc()
    if nvcc is None:
        raise SystemExit("CUDA build: nvcc not found")
    home = cuda_home(nvcc)
    cxx = os.environ.get("CXX", "c++")
    flags = _common_flags("_jaxquant_cuda", "Cuda", CUDA_ARCHS)
    cublaslt = find_cublaslt(home)
    if cublaslt is not None:
        include, library = cublaslt
        flags += ["-DJQ_HAVE_CUBLASLT=1", f"-I{include}", f'-DJQ_CUBLASLT_LIBRARY="{library}"']
    key = _build_key([nvcc, cxx], flags)
    if _from_cache(output, key):
        return output
    gemm = (f"the FP8 and scaled bf16 GEMMs on cuBLASLt ({cublaslt[0]})" if cublaslt else
            "no GEMMs on cuBLASLt: its header not found (nvidia-cublas, the CUDA toolkit or $JAXQUANT_CUBLAS_HOME)")
    _announce(f"{output.name}: CUDA handlers with {nvcc} for {CUDA_ARCHS}, {gemm} (about a minute; "
              f"JAXQUANT_CUDA=off skips it)")
    with tempfile.TemporaryDirectory() as tmp:
        objs = []
        for source in CUDA_SOURCES:
            objs.append(str(Path(tmp) / (source.stem + ".o")))
            _run([nvcc, *[f for f in flags if f != "-fPIC"], "-Xcompiler=-fPIC", "-fmad=false",
                  "--threads=0", *CUDA_ARCH_FLAGS, "-c", str(source), "-o", objs[-1]], verbose)
        libdirs = [home / "lib64", home / "targets" / "x86_64-linux" / "lib"]
        _run([cxx, *flags, "-shared", str(CSRC / "module.cc"), *objs, "-o", str(output),
              *[f"-L{d}" for d in libdirs if d.exists()], "-lcudart_static", "-lpthread", "-ldl", "-lrt"],
             verbose)
    return _built(output, key)


def ext_filename(module: str) -> str:
    return module + sysconfig.get_config_var("EXT_SUFFIX")


def remove_stale_cuda(pkg: Path = ROOT / "jaxquant") -> list[Path]:
    """Delete CUDA extensions left in the source tree by an earlier build (when this build makes none): one
    built from older sources or against another jaxlib would be loaded, or refused, at import."""
    stale = sorted(pkg.glob("_jaxquant_cuda*.so")) + sorted(pkg.glob("_jaxquant_cuda*.pyd"))
    for path in stale:
        path.unlink()
        _announce(f"removed {path.name} (left by an earlier build; this one builds no CUDA handlers)")
    return stale


def build_inplace(cuda: str | None = None, verbose: bool = False) -> list[Path]:
    pkg = ROOT / "jaxquant"
    built = [build_cpu(pkg / ext_filename("_jaxquant_cpu"), verbose)]
    if want_cuda(cuda):
        built.append(build_cuda(pkg / ext_filename("_jaxquant_cuda"), verbose))
    else:
        remove_stale_cuda(pkg)
    return built


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cuda", choices=("auto", "on", "off"), default=None,
                        help="build the CUDA handlers: auto (if nvcc is found; default, or $JAXQUANT_CUDA), on, off")
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("--force", action="store_true",
                        help="compile even where the built module's inputs did not change (JAXQUANT_FORCE_BUILD=1)")
    args = parser.parse_args()
    if args.force:
        os.environ["JAXQUANT_FORCE_BUILD"] = "1"
    for path in build_inplace(args.cuda, args.verbose):
        print(f"built {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
