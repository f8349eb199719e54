"""Every FFI handler is declared command-buffer compatible in C++ and registered so for CUDA, the two
places XLA reads the trait from (csrc/jaxquant/handlers.h, jaxquant/primitives/_ffi.py)."""

import re
from pathlib import Path

import jaxlib.xla_client

from jaxquant.primitives import _ffi

HANDLERS = Path(__file__).resolve().parents[1] / "csrc" / "jaxquant" / "handlers.h"


def test_every_handler_declares_command_buffer_compatibility():
    text = HANDLERS.read_text()
    bindings = re.split(r"XLA_FFI_DEFINE_HANDLER_SYMBOL\(", text)[1:]
    assert len(bindings) == len(re.findall(r'X\("jq_\w+"', text))   # one binding per target
    missing = [b.split(",", 1)[0] for b in bindings if "JQ_CMD_BUFFER);" not in b.split(";", 1)[0] + ";"]
    assert not missing, f"handlers without JQ_CMD_BUFFER: {missing}"


def test_cuda_targets_are_registered_with_the_trait():
    assert _ffi._TRAITS["cuda"]["traits"] == jaxlib.xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE
    assert "cpu" not in _ffi._TRAITS      # XLA:CPU has no command buffers
