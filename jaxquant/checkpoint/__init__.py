"""PyTorch Distributed Checkpoint (DCP) bridge: read and write DCP directories without torch.

See docs/checkpoint.md for the on-disk mapping (quantized components, [out, in] vs [in, out]) and the
safety model.
"""

from jaxquant.checkpoint.convert import convert, dcp_to_orbax, orbax_to_dcp
from jaxquant.checkpoint.errors import (CheckpointError, CheckpointNotFoundError, CorruptCheckpointError,
                                        CoverageError, DestinationError, DestinationExistsError,
                                        IncompleteCheckpointError, KeyMismatchError, MissingDependencyError,
                                        UnknownDtypeError, UnsafePickleError)
from jaxquant.checkpoint.interrupt import Interrupted
from jaxquant.checkpoint.inspect import inspect_checkpoint, inspect_dcp, inspect_orbax
from jaxquant.checkpoint.reader import load_dcp
from jaxquant.checkpoint.tree import QUANT_INFO_KEY
from jaxquant.checkpoint.writer import LocalShards, finalize_dcp, save_dcp

__all__ = [
    "save_dcp", "finalize_dcp", "load_dcp", "dcp_to_orbax", "orbax_to_dcp", "convert",
    "inspect_dcp", "inspect_orbax", "inspect_checkpoint", "LocalShards", "QUANT_INFO_KEY",
    "CheckpointError", "CorruptCheckpointError", "UnsafePickleError", "UnknownDtypeError", "CoverageError",
    "KeyMismatchError", "DestinationError", "DestinationExistsError", "IncompleteCheckpointError",
    "CheckpointNotFoundError", "MissingDependencyError", "Interrupted",
]
