"""Named rematerialization policies for a scanned block that calls ``jq.dense`` (MaxText's way of naming what a
``jax.checkpoint`` keeps): ``jax.checkpoint(block, policy=jq.remat_policy(name))``.

``jq.dense`` names two kinds of values for them: every layer's output (``GEMM_OUTPUT``: what the block's
nonlinearities read, so keeping it saves re-running the forward GEMMs in the backward) and the activation it
keeps for its own backward (``QUANTIZED_ACTIVATION``: FP8 bytes and scale for an FP8 layer, the bf16 activation
otherwise; keeping it saves re-quantizing it, at a quarter of an fp32 activation's bytes for FP8).
"""

from __future__ import annotations

import jax

GEMM_OUTPUT = "jaxquant_gemm_output"
QUANTIZED_ACTIVATION = "jaxquant_quantized_activation"

# name -> the names the policy keeps (everything else is recomputed in the backward)
REMAT_POLICIES = {
    "nothing_saved": (),                                   # full remat: only the block's inputs live
    "gemm_outputs": (GEMM_OUTPUT,),                        # the forward GEMMs are not run again
    "quantized_activations": (QUANTIZED_ACTIVATION,),      # the GEMMs' (quantized) inputs are kept
}


def remat_policy(name: str):
    """The ``jax.checkpoint`` policy called ``name`` (one of :data:`REMAT_POLICIES`).

    Args:
      name: ``"nothing_saved"``, ``"gemm_outputs"`` or ``"quantized_activations"``.

    Returns:
      A policy for ``jax.checkpoint(fn, policy=...)`` (e.g. the body of a ``jax.lax.scan`` over stacked layers).
    """
    if name not in REMAT_POLICIES:
        raise ValueError(f"name: must be one of {tuple(REMAT_POLICIES)}, got {name!r}")
    names = REMAT_POLICIES[name]
    if not names:
        return jax.checkpoint_policies.nothing_saveable
    return jax.checkpoint_policies.save_only_these_names(*names)
