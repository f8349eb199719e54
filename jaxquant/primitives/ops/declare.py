"""An op's one declaration: its FFI targets, its pure-JAX reference, its sharding and batching rule, and what
``impl="auto"`` runs on the CPU. Registration with XLA, the CPU's ``auto`` table and the tests' op list are
derived from the declarations (``DECLARED``); docs/ops.md walks through adding an op.

The dispatch every op shares (``Op.dispatch``), by ``impl``:
  "reference"    the pure-JAX reference (``jaxquant.primitives.reference``),
  "custom_call"  the XLA FFI custom call (error if the extension is not built),
  "auto"         the custom call on each platform it is built for, the reference elsewhere; on the CPU the
                 reference also for the targets declared ``cpu_auto="reference"`` (faster there).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax

from jaxquant.primitives import _ffi
from jaxquant.primitives.ops.checks import check_impl
from jaxquant.primitives.partitioning import Rule, sharded

CPU_AUTO = ("custom_call", "reference")


@dataclasses.dataclass(frozen=True)
class Target:
    """One FFI target of an op.

    name: the target as ``csrc/jaxquant/handlers.h`` (``JQ_TARGETS``) registers it.
    cpu_auto: what ``impl="auto"`` runs on the CPU: "custom_call" (default) or "reference", for the targets whose
      reference XLA compiles into faster CPU code than the handler (docs/performance.md, "The CPU backend"; the
      bytes are the same either way, the handler stays for ``impl="custom_call"`` and as the CUDA kernel's twin).
    platforms: the extensions that have a handler for it (``_ffi`` platform names); None (default): every one.
    optional: the handler is compiled only where the library it calls was found at build time (cuBLASLt for the FP8
      GEMM, csrc/jaxquant/handlers.h ``JQ_FOR_EACH_CUBLASLT_TARGET``): an extension without it is accepted, and
      ``impl="auto"`` runs the reference there.
    """

    name: str
    cpu_auto: str = "custom_call"
    platforms: Optional[tuple[str, ...]] = None
    optional: bool = False

    def __post_init__(self):
        if self.cpu_auto not in CPU_AUTO:
            raise ValueError(f"cpu_auto: must be one of {CPU_AUTO}, got {self.cpu_auto!r}")
        if self.cpu_auto == "reference" and not self.on("cpu"):
            raise ValueError(f"cpu_auto: {self.name} has no CPU handler, so no CPU choice to declare")

    def on(self, platform: str) -> bool:
        """Whether ``platform``'s extension has (or, optional, may have) a handler for it."""
        return self.platforms is None or platform in self.platforms


DECLARED: dict[str, "Op"] = {}   # op name -> its declaration, in declaration order
DEFINED: dict[str, Callable] = {}   # op name -> its function (``Op.define``), what ``jaxquant.primitives.ops`` exports


@dataclasses.dataclass(frozen=True)
class Op:
    """An op, declared once, next to the function that validates its arguments and builds its calls.

    name: the public function, ``jaxquant.primitives.ops.<name>``.
    targets: its FFI targets (one, or a rowwise one and its columnwise variant).
    reference: the pure-JAX function its custom calls match bit for bit, ``jaxquant.primitives.reference.<name>``.
    rule: its sharding and batching rule (``partitioning.Rule``: a partitioned call per device under ``jit``, and
      ``rule.fold`` or ``lax.map`` under ``vmap``); None for the ops over a flat range or a group buffer, which
      have no block structure to shard: under ``jit`` they run replicated, under ``vmap`` the FFI runs the batch
      item by item (``_ffi.call``'s "sequential").

    ``Op(...).define`` decorates the op's function; declaring a name or a target twice raises.
    """

    name: str
    targets: tuple[Target, ...]
    reference: Callable
    rule: Optional[Rule] = None

    def __post_init__(self):
        if self.rule is not None and self.rule.name != self.name:
            raise ValueError(f"rule: {self.name}'s rule is named {self.rule.name!r}")
        taken = {t.name for op in DECLARED.values() for t in op.targets}
        clash = [t.name for t in self.targets if t.name in taken]
        if self.name in DECLARED or clash or not self.targets:
            raise ValueError(f"op {self.name}: declared twice, no targets, or targets already declared: {clash}")
        DECLARED[self.name] = self

    @property
    def batching(self) -> str:
        """How ``vmap`` runs the op: "fold" (the rule maps a batch onto one call where it can, else lax.map),
        "map" (the rule runs the batch with lax.map) or "sequential" (the FFI calls the handler per item)."""
        if self.rule is None:
            return "sequential"
        return "fold" if self.rule.fold is not None else "map"

    def define(self, fn: Callable) -> Callable:
        """Decorator: the op's function, with its sharding and batching rule when it has one."""
        if fn.__name__ != self.name or self.name in DEFINED:
            raise ValueError(f"op {self.name}: defined twice or by a function of another name ({fn.__name__})")
        op = sharded(self.rule)(fn) if self.rule is not None else fn
        op.declaration = self
        DEFINED[self.name] = op
        return op

    def target(self, name: str | None = None) -> Target:
        """The op's target ``name`` (default: its only or first target); KeyError for a target it did not declare."""
        if name is None:
            return self.targets[0]
        for t in self.targets:
            if t.name == name:
                return t
        raise KeyError(f"op {self.name} declares no target {name!r}")

    def call(self, target: str, results, *args, input_output_aliases=None, cost_ns=None, **attrs) -> list:
        """The FFI call of the declared ``target`` (``_ffi.call``, ``cost_ns`` its time estimate for XLA's scheduler);
        returns the list of results."""
        return _ffi.call(self.target(target).name, results, *args, input_output_aliases=input_output_aliases,
                         cost_ns=cost_ns, **attrs)

    def dispatch(self, impl: str, custom: Callable, ref: Callable, *args, target: str | None = None):
        """Run ``custom`` (which calls ``target``, default the op's first) or ``ref`` on ``args`` by ``impl``."""
        check_impl(impl)
        if impl == "reference":
            return ref(*args)
        declared = self.target(target)
        if impl == "custom_call":
            _ffi.require(declared.name)
            return custom(*args)
        on_cpu = declared.cpu_auto == "custom_call"
        branches = {p: custom for p in _ffi.auto_platforms(cpu=on_cpu, target=declared.name)}
        if not branches:
            return ref(*args)
        return jax.lax.platform_dependent(*args, default=ref, **branches)


def declared_targets(platform: str | None = None) -> tuple[str, ...]:
    """Every declared FFI target (of ``platform``'s extension: ``Target.platforms``), in declaration order (what
    ``_ffi.register`` registers)."""
    return tuple(t.name for op in DECLARED.values() for t in op.targets if platform is None or t.on(platform))


def target_platforms() -> dict:
    """Target -> the platforms whose extension has its handler, for the targets not on every platform."""
    return {t.name: t.platforms for op in DECLARED.values() for t in op.targets if t.platforms is not None}


def optional_targets() -> frozenset:
    """The targets an extension may lack (``Target.optional``)."""
    return frozenset(t.name for op in DECLARED.values() for t in op.targets if t.optional)


def cpu_auto_reference() -> frozenset:
    """The targets whose ``impl="auto"`` runs the reference on the CPU."""
    return frozenset(t.name for op in DECLARED.values() for t in op.targets if t.cpu_auto == "reference")
