"""The one exception hierarchy of the checkpoint bridge.

Every message names the file or key involved and the rule that was broken.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class: anything wrong with a checkpoint, its destination or the arguments."""


class CorruptCheckpointError(CheckpointError):
    """Truncated or corrupt ``.distcp``/``.metadata`` content, or a missing file."""


class UnsafePickleError(CorruptCheckpointError):
    """A pickle referenced a global outside the allowlist; nothing was executed."""


class UnknownDtypeError(CheckpointError):
    """A dtype that has no numpy/ml_dtypes equivalent (or cannot be stored in DCP)."""


class CoverageError(CheckpointError):
    """Chunks of a tensor leave gaps, overlap, or lie outside the tensor."""


class KeyMismatchError(CheckpointError):
    """A key is missing, or its shape/dtype/kind differs from what was asked for."""


class CheckpointNotFoundError(CorruptCheckpointError):
    """The checkpoint directory to read does not exist (or is not a directory)."""


class DestinationError(CheckpointError):
    """The destination cannot be written (read-only file system, permissions, missing parent, ...)."""


class DestinationExistsError(DestinationError):
    """The destination exists and is not an empty directory."""


class MissingDependencyError(CheckpointError):
    """An optional dependency is not installed (Orbax interop: the ``orbax`` extra); the message says how to
    install it."""


class IncompleteCheckpointError(CheckpointError):
    """The directory is a staging directory left by an interrupted write."""
