"""The meshes the tests run on, over the first devices of the (8 simulated CPU or real) devices."""

import jax
import numpy as np
from jax.sharding import Mesh


def fsdp_mesh(n: int = 8) -> Mesh:
    """1-D ``("fsdp",)`` mesh of the first ``n`` devices."""
    return Mesh(np.array(jax.devices()[:n]), ("fsdp",))


def fsdp_tp_mesh(fsdp: int, tp: int = 1) -> Mesh:
    """``("fsdp", "tp")`` mesh of the first ``fsdp * tp`` devices, tp minor."""
    return Mesh(np.array(jax.devices()[:fsdp * tp]).reshape(fsdp, tp), ("fsdp", "tp"))


def tp_mesh(tp: int, devices: str = "cpu") -> Mesh:
    """1-D ``("tp",)`` mesh of the first ``tp`` devices of the backend ``devices``."""
    return Mesh(np.array(jax.devices(devices)[:tp]), ("tp",))
