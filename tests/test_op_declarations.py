"""Each op is declared once in Python (``jaxquant.primitives.ops.declare.Op``), and what is derived from the
declarations holds: the FFI targets registered with XLA are the declared ones, the same as the C++ handlers
(csrc/jaxquant/handlers.h) and the compiled module's; CUDA's are registered command-buffer compatible, as
every handler declares itself; each op's reference is ``reference.<its name>``; the CPU's ``impl="auto"`` table is
the declared one."""

import re
from pathlib import Path

import jax
import jaxlib.xla_client
import pytest

from jaxquant.primitives import _ffi, ops, reference

HANDLERS = Path(__file__).resolve().parents[1] / "csrc" / "jaxquant" / "handlers.h"
GEMMS = ("jq_fp8_gemm", "jq_bf16_gemm")   # the CUDA-only, optional targets (cuBLASLt: JQ_FOR_EACH_CUBLASLT_TARGET)


def handler_targets() -> list[str]:
    """The targets csrc/jaxquant/handlers.h binds (its JQ_TARGETS X-macro), in order."""
    return re.findall(r'X\("(jq_\w+)"', HANDLERS.read_text())


def test_every_handler_declares_command_buffer_compatibility():
    text = HANDLERS.read_text()
    bindings = re.split(r"XLA_FFI_DEFINE_HANDLER_SYMBOL\(", text)[1:]
    assert len(bindings) == len(handler_targets())   # one binding per target
    missing = [b.split(",", 1)[0] for b in bindings if "JQ_CMD_BUFFER);" not in b.split(";", 1)[0] + ";"]
    assert not missing, f"handlers without JQ_CMD_BUFFER: {missing}"


def test_declared_targets_are_the_handlers_targets():
    declared = ops.declared_targets()
    assert len(set(declared)) == len(declared)
    assert sorted(declared) == sorted(handler_targets())


@pytest.mark.skipif("cpu" not in _ffi.built_platforms(), reason="needs the compiled CPU extension")
def test_the_compiled_module_registers_the_declared_targets():
    import jaxquant._jaxquant_cpu as ext
    assert sorted(ext.registrations()) == sorted(ops.declared_targets("cpu"))
    assert not set(GEMMS) & set(ops.declared_targets("cpu"))   # CUDA only (cuBLASLt)


@pytest.mark.skipif("cuda" not in _ffi.built_platforms(), reason="needs the compiled CUDA extension")
def test_the_cuda_module_registers_its_targets_and_the_gemm_where_built_with_cublaslt():
    import jaxquant._jaxquant_cuda as ext
    got = set(ext.registrations())
    assert got - set(GEMMS) == set(ops.declared_targets("cuda")) - set(GEMMS)
    for target in GEMMS:   # both or neither: one build flag (JQ_HAVE_CUBLASLT) compiles them
        assert (target in got) == _ffi.has_target("cuda", target) == _ffi.has_target("cuda", GEMMS[0])


def test_a_cuda_only_optional_target_may_be_missing_but_never_on_the_cpu(monkeypatch):
    monkeypatch.setattr(jax.ffi, "register_ffi_target", lambda *a, **kw: None)
    targets, kw = ops.declared_targets(), dict(platforms=ops.target_platforms(), optional=ops.optional_targets())
    assert ops.target_platforms() == {t: ("cuda",) for t in GEMMS} and ops.optional_targets() == set(GEMMS)
    cpu, cuda = ops.declared_targets("cpu"), ops.declared_targets("cuda")
    _ffi.register(targets, {"cpu": _Extension(cpu), "cuda": _Extension(cuda)}, **kw)       # with the GEMM
    _ffi.register(targets, {"cpu": _Extension(cpu), "cuda": _Extension(cpu)}, **kw)        # built without cuBLASLt
    with pytest.raises(_ffi.ExtensionError, match="no op declares"):
        _ffi.register(targets, {"cpu": _Extension(cuda)}, **kw)
    with pytest.raises(_ffi.ExtensionError, match="lacks"):
        _ffi.register(targets, {"cuda": _Extension(cpu[:-1])}, **kw)
    with pytest.raises(ValueError, match="no CPU handler"):
        ops.Target("jq_elsewhere", cpu_auto="reference", platforms=("cuda",))


class _Extension:
    """A stand-in for a compiled module: ``registrations()`` of the given targets."""

    def __init__(self, targets):
        self.targets = list(targets)

    def registrations(self):
        return {name: object() for name in self.targets}


def test_cuda_targets_are_registered_command_buffer_compatible_and_cpu_targets_without_traits(monkeypatch):
    calls = []
    monkeypatch.setattr(jax.ffi, "register_ffi_target",
                        lambda name, capsule, platform, **kw: calls.append((name, platform, kw)))
    targets = ops.declared_targets()
    _ffi.register(targets, {"cpu": _Extension(targets), "cuda": _Extension(targets)})
    by_platform = {p: {name: kw for name, platform, kw in calls if platform == p} for p in ("cpu", "CUDA")}
    assert set(by_platform["cpu"]) == set(by_platform["CUDA"]) == set(targets)
    assert all(kw == {} for kw in by_platform["cpu"].values())   # XLA:CPU has no command buffers
    want = jaxlib.xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE
    assert all(kw == {"traits": want} for kw in by_platform["CUDA"].values())


@pytest.mark.parametrize("built", [lambda t: t[:-1], lambda t: t + ("jq_undeclared",)],
                         ids=["a_target_missing", "an_undeclared_target"])
def test_an_extension_whose_targets_differ_from_the_declared_ones_is_refused(monkeypatch, built):
    monkeypatch.setattr(jax.ffi, "register_ffi_target", lambda *a, **kw: None)
    targets = ops.declared_targets()
    with pytest.raises(_ffi.ExtensionError, match="no op declares|lacks"):
        _ffi.register(targets, {"cpu": _Extension(built(targets))})


@pytest.mark.parametrize("name", list(ops.DECLARED))
def test_each_op_is_its_declaration_and_its_reference_is_the_function_of_its_name(name):
    declaration = ops.DECLARED[name]
    assert getattr(ops, name).declaration is declaration
    assert declaration.reference is getattr(reference, name)
    assert ops.DEFINED[name] is getattr(ops, name)
    if declaration.rule is not None:   # the sharding and batching rule the op function carries
        assert getattr(ops, name).rule is declaration.rule


def test_declaring_a_target_twice_is_refused():
    with pytest.raises(ValueError, match="declared twice"):
        ops.Op("amax_again", (ops.Target("jq_amax"),), reference.amax)
    assert "amax_again" not in ops.DECLARED


def test_auto_leaves_out_the_cpu_only_for_targets_declared_to_run_the_reference_there():
    """What the lowered programs show is tests/test_fused_ops.py's (no custom call for those targets on the CPU)."""
    assert _ffi.auto_platforms(cpu=False) == tuple(p for p in _ffi.built_platforms() if p != "cpu")
    assert _ffi.auto_platforms(cpu=True) == _ffi.built_platforms()
