"""Low-level quantization primitives: validated, jit-able, dispatched to a custom call or the reference.

Every op takes ``impl``:
  "reference"    the pure-JAX reference (``jaxquant.primitives.reference``),
  "custom_call"  the XLA FFI custom call (error if the extension is not built),
  "auto"         the custom call on each platform it is built for, the reference elsewhere; on the CPU the
                 reference also for the targets declared ``cpu_auto="reference"``, whose reference is faster there.

Arguments are checked at trace time; errors name the argument and the rule (docs/numerics.md §5).

The package: ``single`` (the single-tensor ops), ``grouped`` (the grouped ops of the ZeRO step and their table,
``table``), each op declared once there (``declare.Op``: targets, reference, sharding and batching rule, CPU
``auto`` choice); ``checks`` and ``declare`` are the named API other packages build their ops on (zero, tp,
training); ``built_platforms`` / ``backend_summary`` say which custom calls are built and what ``auto`` runs.
Importing it registers the declared FFI targets with XLA. Adding an op: docs/ops.md.
"""

from jaxquant.primitives import _ffi
from jaxquant.primitives._ffi import backend_summary, built_platforms
from jaxquant.primitives.formats import check_nvfp4_shape
from jaxquant.primitives.ops import grouped, single  # noqa: F401  (importing them declares every op)
from jaxquant.primitives.ops.checks import (IMPLS, INPUT_DTYPES, check_amax, check_array, check_array_like,
                                            check_compute_dtype, check_impl, check_input, check_range, not_quantized,
                                            rounds_to_bf16)
from jaxquant.primitives.ops.declare import (DECLARED, DEFINED, Op, Target, cpu_auto_reference, declared_targets,
                                             optional_targets, target_platforms)
from jaxquant.primitives.ops.grouped import group_table
from jaxquant.primitives.ops.table import GROUP_TABLE_FIELDS, GatheredSpace

if list(DEFINED) != list(DECLARED):
    raise ImportError(f"ops declared without a function: {sorted(set(DECLARED) - set(DEFINED))}")
globals().update(DEFINED)   # ops.<name>: every declared op, from its one declaration
_ffi.register(declared_targets(), platforms=target_platforms(), optional=optional_targets())

__all__ = [
    *DEFINED,   # amax, fp8_cast, ..., nvfp4_group_tile_amax, group_split (single.py, then grouped.py)
    "group_table", "GROUP_TABLE_FIELDS", "GatheredSpace", "check_nvfp4_shape",
    # the API other packages' ops build on
    "IMPLS", "INPUT_DTYPES", "check_amax", "check_array", "check_array_like", "check_compute_dtype", "check_impl",
    "check_input", "check_range", "not_quantized", "rounds_to_bf16",
    "DECLARED", "DEFINED", "Op", "Target", "cpu_auto_reference", "declared_targets", "optional_targets",
    "target_platforms",
    # what is built, and what impl="auto" runs here (for the CLI's report)
    "backend_summary", "built_platforms",
]
