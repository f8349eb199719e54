"""torch dtype names <-> numpy (ml_dtypes) dtypes, and the storage classes torch.save uses."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from jaxquant.checkpoint.errors import UnknownDtypeError

# canonical torch name -> numpy dtype
_TORCH_TO_NP = {
    "float32": np.dtype(np.float32), "float64": np.dtype(np.float64), "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn), "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "float8_e4m3fnuz": np.dtype(ml_dtypes.float8_e4m3fnuz),
    "float8_e5m2fnuz": np.dtype(ml_dtypes.float8_e5m2fnuz),
    "float8_e8m0fnu": np.dtype(ml_dtypes.float8_e8m0fnu),
    "int8": np.dtype(np.int8), "int16": np.dtype(np.int16), "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64), "uint8": np.dtype(np.uint8), "uint16": np.dtype(np.uint16),
    "uint32": np.dtype(np.uint32), "uint64": np.dtype(np.uint64), "bool": np.dtype(np.bool_),
    "complex64": np.dtype(np.complex64), "complex128": np.dtype(np.complex128),
}
# torch aliases that pickle under another name
_ALIASES = {"float": "float32", "double": "float64", "half": "float16", "long": "int64", "int": "int32",
            "short": "int16", "cfloat": "complex64", "cdouble": "complex128"}
# torch dtypes we recognise but cannot represent (reading them is an UnknownDtypeError, not a pickle error)
UNSUPPORTED_TORCH_DTYPES = frozenset({
    "complex32", "chalf", "qint8", "qint32", "quint8", "quint4x2", "quint2x4", "float4_e2m1fn_x2",
    "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2", "bit",
    *(f"int{i}" for i in range(1, 8)), *(f"uint{i}" for i in range(1, 8))})
KNOWN_TORCH_DTYPES = frozenset(_TORCH_TO_NP) | frozenset(_ALIASES) | UNSUPPORTED_TORCH_DTYPES
_NP_TO_TORCH = {v: k for k, v in _TORCH_TO_NP.items()}

# Dtypes torch.save writes with a legacy typed storage and _rebuild_tensor_v2; all others use
# UntypedStorage and _rebuild_tensor_v3 (torch.storage._new_dtypes()).
LEGACY_STORAGE = {
    "float64": "DoubleStorage", "float32": "FloatStorage", "float16": "HalfStorage", "int64": "LongStorage",
    "int32": "IntStorage", "int16": "ShortStorage", "int8": "CharStorage", "uint8": "ByteStorage",
    "bool": "BoolStorage", "bfloat16": "BFloat16Storage", "complex128": "ComplexDoubleStorage",
    "complex64": "ComplexFloatStorage"}
STORAGE_TO_TORCH = {v: k for k, v in LEGACY_STORAGE.items()}
UNSUPPORTED_STORAGES = frozenset({"QInt8Storage", "QInt32Storage", "QUInt8Storage", "QUInt4x2Storage",
                                  "QUInt2x4Storage"})


class TorchDtype:
    """A torch dtype referenced by name (what the safe unpickler returns for ``torch.<dtype>``)."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = _ALIASES.get(name, name)

    def __eq__(self, other):
        return isinstance(other, TorchDtype) and other.name == self.name

    def __hash__(self):
        return hash(("TorchDtype", self.name))

    def __repr__(self):
        return f"torch.{self.name}"


def to_numpy(name: str, *, what: str) -> np.dtype:
    """numpy dtype for a torch dtype name; ``what`` names the key/file for the error."""
    name = _ALIASES.get(name, name)
    if name not in _TORCH_TO_NP:
        raise UnknownDtypeError(f"{what}: dtype torch.{name} has no numpy/ml_dtypes equivalent; "
                                f"supported: {', '.join(sorted(_TORCH_TO_NP))}")
    return _TORCH_TO_NP[name]


def to_torch_name(dtype, *, what: str) -> str:
    """torch dtype name for a numpy/JAX dtype."""
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise UnknownDtypeError(f"{what}: {dtype!r} is not a dtype") from e
    if dt not in _NP_TO_TORCH:
        raise UnknownDtypeError(f"{what}: dtype {dt} cannot be stored in a DCP checkpoint "
                                f"(no torch equivalent); supported: {', '.join(sorted(_TORCH_TO_NP))}")
    return _NP_TO_TORCH[dt]
