"""Loads the compiled extension modules; ``register`` registers the declared FFI targets with XLA (called once,
by ``jaxquant.primitives.ops``, with every target its ops declare).

``jaxquant._jaxquant_cpu`` (always built) and ``jaxquant._jaxquant_cuda`` (built when nvcc was
found) each expose ``registrations()`` -> {target name: PyCapsule} and ``jaxlib_version()``, the
jaxlib whose FFI headers they were compiled against.
"""

from __future__ import annotations

import contextlib
import importlib
import os

import numpy as np

import jax
import jax.numpy as jnp
import jaxlib
import jaxlib.xla_client

from jaxquant.primitives.varying import varying_like

try:
    from jax.experimental.xla_metadata import set_xla_metadata
except ImportError:   # a JAX without it: XLA's scheduler keeps its own guess of a custom call's cost
    set_xla_metadata = None

REBUILD_HINT = (
    "Rebuild it against the installed jaxlib with `pip install --no-build-isolation -e .` "
    "(or `python build.py` for an in-place build) from the jaxquant source tree."
)
# Lowercase platform names as jax.lax.platform_dependent spells them -> FFI registration names.
_PLATFORMS = {"cpu": ("_jaxquant_cpu", "cpu"), "cuda": ("_jaxquant_cuda", "CUDA")}


# Every CUDA handler only enqueues work on XLA's stream (no host synchronisation, no data-dependent
# host decisions) and is declared kCmdBufferCompatible in csrc/jaxquant/handlers.h; XLA takes the trait from
# the registration, so it is repeated here for CUDA graphs (tests/test_op_declarations.py checks both).
_TRAITS = {"cuda": {"traits": jaxlib.xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE}}

class ExtensionError(ImportError):
    pass


def _load(module_name: str, required: bool):
    try:
        mod = importlib.import_module(f"jaxquant.{module_name}")
    except ImportError as e:
        if not required:
            return None
        raise ExtensionError(
            f"jaxquant's compiled extension jaxquant.{module_name} could not be loaded ({e}). "
            + REBUILD_HINT) from e
    built = mod.jaxlib_version()
    if built != jaxlib.__version__:
        raise ExtensionError(
            f"jaxquant.{module_name} was built against jaxlib {built} but jaxlib "
            f"{jaxlib.__version__} is installed. " + REBUILD_HINT)
    return mod


def _load_all() -> dict:
    """Platform -> its loaded extension module (the CPU's is required unless JAXQUANT_REFERENCE_ONLY=1, which lets
    the pure-JAX paths run from a source tree with nothing built)."""
    reference_only = os.environ.get("JAXQUANT_REFERENCE_ONLY") == "1"
    loaded = {}
    for platform, (module_name, _) in _PLATFORMS.items():
        mod = _load(module_name, required=(platform == "cpu" and not reference_only))
        if mod is not None:
            loaded[platform] = mod
    return loaded


_MODULES = _load_all()
_REGISTERED: dict[str, frozenset] = {}   # platform -> the targets its loaded extension registered


def register(targets, modules: dict | None = None, *, platforms: dict | None = None, optional=()) -> None:
    """Register the FFI targets ``targets`` (the declared ones, ``jaxquant.primitives.ops.declared_targets``) of
    every loaded extension (``modules``: platform -> module, default the loaded ones) with XLA, CUDA's with the
    command-buffer trait.

    ``platforms``: target -> the platforms whose extension has its handler (a target not named: every platform);
    ``optional``: targets an extension may lack (compiled only where their library was found at build time: the FP8
    GEMM on cuBLASLt); ``impl="auto"`` runs the reference where it does (:func:`auto_platforms`).

    Raises ExtensionError where a module's targets are not ``targets`` (those of its platform, less optional ones
    it lacks): an extension built from other sources than the Python that declares the ops.
    """
    targets, platforms = tuple(targets), platforms or {}
    for platform, mod in (_MODULES if modules is None else modules).items():
        capsules = mod.registrations()
        want = {t for t in targets if platform in platforms.get(t, (platform,))}
        lacks = want - set(optional) - set(capsules)
        if lacks or set(capsules) - want:
            raise ExtensionError(
                f"jaxquant.{_PLATFORMS[platform][0]} registers {sorted(set(capsules) - want)} that no op "
                f"declares and lacks {sorted(lacks)}. " + REBUILD_HINT)
        for name in targets:
            if name in capsules:
                jax.ffi.register_ffi_target(name, capsules[name], platform=_PLATFORMS[platform][1],
                                            **_TRAITS.get(platform, {}))
        if modules is None:
            _REGISTERED[platform] = frozenset(capsules)


def has_target(platform: str, target: str) -> bool:
    """Whether ``platform``'s loaded extension registered ``target`` (an optional one may be missing)."""
    return target in _REGISTERED.get(platform, ())


def built_platforms() -> tuple[str, ...]:
    """Platforms (lax.platform_dependent names) whose custom calls are built and registered."""
    return tuple(_MODULES)


def auto_platforms(*, cpu: bool = True, target: str | None = None) -> tuple[str, ...]:
    """Platforms where ``impl="auto"`` runs a custom call (the reference elsewhere): those it is built for, less the
    CPU where ``cpu`` is False (a target declared ``cpu_auto="reference"``), and with ``target`` those whose
    extension registered it."""
    return tuple(p for p in _MODULES if (cpu or p != "cpu") and (target is None or has_target(p, target)))


def require(target: str | None = None) -> None:
    if not _MODULES:
        raise ExtensionError("impl='custom_call' needs jaxquant's compiled extension. " + REBUILD_HINT)
    if target is not None and not any(has_target(p, target) for p in _MODULES):
        raise ExtensionError(
            f"impl='custom_call': no built extension has {target} (an optional target: the cuBLASLt GEMMs are built "
            f"into the CUDA extension only where cuBLASLt's header was found: docs/development.md, 'GPU FP8 GEMM'). "
            + REBUILD_HINT)


# XLA's latency-hiding scheduler decides which GEMMs and fusions an all-gather or a reduce-scatter runs under from
# each instruction's estimated time. It has estimates for its own GEMMs and fusions but takes any other custom call
# for a few microseconds, unless the call carries its time in nanoseconds as the frontend attribute
# "latency_metadata". Every jaxquant custom call carries one (JAXQUANT_LATENCY_HINTS=0 leaves them out): the GEMMs
# their FLOPs at a GEMM rate (``ops.single``), the rest, all memory-bound, the bytes they read and write at HBM
# bandwidth. Only the schedule can change, never a byte of a result. Without them XLA (jax 0.11.2) left three of the
# four weight-gradient reduce-scatters of each backward iteration of the 13B-shaped FP8 `scan` synchronous, with
# nothing under them; with them every one is asynchronous, with kernels under it, and the reduce-scatters run under
# GEMMs and elementwise kernels (tests/test_schedule_gpu.py).
LATENCY_HINTS = os.environ.get("JAXQUANT_LATENCY_HINTS", "1") != "0"
# Bytes a nanosecond the memory-bound kernels move: an H200's casts run at ~4.1 TB/s (docs/performance.md,
# "Re-profiled at today's weight path"); an estimate for the scheduler, not a measurement of this device.
HBM_BYTES_PER_NS = 4000.0


def memory_bound_ns(*arrays) -> int:
    """The nanoseconds a kernel that reads or writes each of ``arrays`` (arrays or ``jax.ShapeDtypeStruct`` s) once
    takes at :data:`HBM_BYTES_PER_NS` (at least 1)."""
    moved = sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in arrays)
    return max(1, int(moved / HBM_BYTES_PER_NS))


def call(target: str, results, *args, input_output_aliases=None, cost_ns=None, **attrs):
    """Invoke FFI target ``target``; returns the list of results.

    Inside ``shard_map`` the results vary over every mesh axis some input varies over, as any
    elementwise op's would (ffi_call alone marks them invariant, which check_vma rejects).

    Batching: the ops with a rule in ``jaxquant.primitives.partitioning`` never reach this under ``vmap`` (their
    batching rule folds the batch or loops over it); for the others (flat-range and grouped ops,
    whose handlers take one tensor) the FFI runs the batch item by item ("sequential").

    ``cost_ns``: the call's estimated time for XLA's scheduler (:data:`LATENCY_HINTS`); default
    :func:`memory_bound_ns` of its operands and results.
    """
    fn = jax.ffi.ffi_call(target, list(results), vmap_method="sequential",
                          input_output_aliases=input_output_aliases)
    hint = contextlib.nullcontext()
    if LATENCY_HINTS and set_xla_metadata is not None:
        ns = memory_bound_ns(*args, *results) if cost_ns is None else max(1, int(cost_ns))
        hint = set_xla_metadata(latency_metadata=str(ns))
    with hint:
        out = fn(*args, **attrs)
    return varying_like(list(out) if isinstance(out, (list, tuple)) else [out], args)


def _has_devices(platform: str) -> bool:
    try:
        return bool(jax.devices({"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)))
    except RuntimeError:  # no backend of that kind in this process
        return False


def backend_summary() -> str:
    """One line: which custom calls are built and what ``impl="auto"`` runs on the default JAX backend.

    Every op dispatches the same way (``ops.Op.dispatch``): the custom call of the platform it is compiled for
    when that platform's extension is built, the pure-JAX reference otherwise, except on the CPU for the targets
    declared ``cpu_auto="reference"``, whose reference is faster there.
    """
    device = jax.devices()[0]
    platform = device.platform  # "cpu", "gpu", "tpu", ...
    if platform == "gpu":  # lax.platform_dependent names GPUs by their runtime
        version = str(getattr(getattr(device, "client", None), "platform_version", "")).lower()
        platform = "rocm" if "rocm" in version else "cuda"
    built = ", ".join(built_platforms()) or "none"
    if platform not in _MODULES:
        uses = "every op as the pure-JAX reference"
    elif platform == "cpu":
        uses = ("the cpu custom calls, and the pure-JAX reference where that is faster on the CPU (casts, "
                "transposes, rowwise NVFP4 quantization)")
    else:
        uses = f"every op as the {platform} custom calls"
    idle = [p for p in built_platforms() if not _has_devices(p)]
    unused = f" ({', '.join(idle)}: no such device here, so unused)" if idle else ""
    return (f"custom calls built for: {built}{unused}; default backend {jax.default_backend()} "
            f"({device.device_kind}): impl='auto' runs {uses}")
