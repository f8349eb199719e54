"""An allowlist unpickler and a tiny pickle writer that names torch classes without importing torch.

Reading: ``pickle.Unpickler`` resolves every global (GLOBAL, STACK_GLOBAL, INST, OBJ, EXT*) through
``find_class``; ours answers only from an explicit ``{(module, name): stand-in}`` table and refuses
everything else, so a checkpoint can never make us import a module or call a function we did not
choose. The stand-ins are plain local classes/functions that record data.

Writing: :func:`dumps` emits protocol-2 opcodes for None/bool/int/float/str/tuple/list/dict plus
:class:`Global` (a ``module.name`` reference), :class:`Reduce` (``callable(*args)``),
:class:`NewObj` (``cls.__new__(cls)`` then ``BUILD state``) and :class:`PersistentId`.
"""

from __future__ import annotations

import io
import pickle
import struct
from typing import Any, Callable, Mapping

from jaxquant.checkpoint.errors import CorruptCheckpointError, UnsafePickleError


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, allow: Mapping[tuple[str, str], Any], what: str,
                 persistent_load: Callable | None):
        super().__init__(io.BytesIO(data))
        self._allow = allow
        self._what = what
        self._pload = persistent_load

    def find_class(self, module, name):
        try:
            return self._allow[(module, name)]
        except KeyError:
            raise UnsafePickleError(
                f"{self._what}: refusing global {module}.{name}: only the DCP/torch classes and tensor "
                f"rebuild functions of the format are allowed (a checkpoint must never run code)") from None

    def persistent_load(self, pid):
        if self._pload is None:
            raise CorruptCheckpointError(f"{self._what}: unexpected persistent id {pid!r}")
        return self._pload(pid)


def safe_loads(data: bytes, allow: Mapping[tuple[str, str], Any], *, what: str,
               persistent_load: Callable | None = None) -> Any:
    """Unpickle ``data`` resolving globals only through ``allow``; errors name ``what``."""
    try:
        return _Unpickler(data, allow, what, persistent_load).load()
    except (UnsafePickleError, CorruptCheckpointError):
        raise
    except Exception as e:  # truncated/garbled stream, wrong arity in a REDUCE, ...
        raise CorruptCheckpointError(f"{what}: not a valid pickle ({type(e).__name__}: {e})") from e


# ---------------------------------------------------------------------------------------- writing

class Global:
    """A reference to ``module.name`` (emitted as the GLOBAL opcode)."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name


class Reduce:
    """``func(*args)`` at load time."""

    def __init__(self, func: Global, args: tuple):
        self.func, self.args = func, tuple(args)


class NewObj:
    """``cls.__new__(cls)`` followed by ``BUILD state`` (how dataclasses pickle); no BUILD if None."""

    def __init__(self, cls: Global, state):
        self.cls, self.state = cls, state


class PersistentId:
    """A persistent id (torch.save uses one per storage)."""

    def __init__(self, pid: tuple):
        self.pid = pid


def dumps(obj) -> bytes:
    """Serialize ``obj`` (see module docstring for the supported vocabulary) as a protocol-2 pickle."""
    out = io.BytesIO()
    out.write(b"\x80\x02")
    _save(out, obj)
    out.write(b".")
    return out.getvalue()


def _save(out, obj):
    w = out.write
    if obj is None:
        w(b"N")
    elif obj is True or obj is False:
        w(b"\x88" if obj else b"\x89")
    elif isinstance(obj, int):
        if 0 <= obj < 256:
            w(b"K" + bytes([obj]))
        elif 0 <= obj < 65536:
            w(b"M" + struct.pack("<H", obj))
        elif -(2 ** 31) <= obj < 2 ** 31:
            w(b"J" + struct.pack("<i", obj))
        else:
            raw = obj.to_bytes((obj.bit_length() + 8) // 8, "little", signed=True)
            w(b"\x8a" + bytes([len(raw)]) + raw)
    elif isinstance(obj, float):
        w(b"G" + struct.pack(">d", obj))
    elif isinstance(obj, str):
        raw = obj.encode("utf-8")
        w(b"X" + struct.pack("<I", len(raw)) + raw)
    elif isinstance(obj, tuple):
        if not obj:
            w(b")")
        else:
            w(b"(")
            for x in obj:
                _save(out, x)
            w(b"t")
    elif isinstance(obj, list):
        w(b"]")
        if obj:
            w(b"(")
            for x in obj:
                _save(out, x)
            w(b"e")
    elif isinstance(obj, dict):
        w(b"}")
        if obj:
            w(b"(")
            for k, v in obj.items():
                _save(out, k)
                _save(out, v)
            w(b"u")
    elif isinstance(obj, Global):
        w(b"c" + obj.module.encode() + b"\n" + obj.name.encode() + b"\n")
    elif isinstance(obj, Reduce):
        _save(out, obj.func)
        _save(out, obj.args)
        w(b"R")
    elif isinstance(obj, NewObj):
        _save(out, obj.cls)
        w(b")\x81")  # EMPTY_TUPLE, NEWOBJ
        if obj.state is not None:
            _save(out, obj.state)
            w(b"b")  # BUILD
    elif isinstance(obj, PersistentId):
        _save(out, obj.pid)
        w(b"Q")
    else:
        raise TypeError(f"safepickle.dumps: cannot serialize {type(obj).__name__}")
