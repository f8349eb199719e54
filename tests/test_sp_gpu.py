"""jaxquant.sp on the GPUs of one host (tp = every GPU): each layer against the single-GPU computation
of the same quantized math, in every overlap mode and for every weight type ([out, in] bf16 array,
Float8Tensor, float weight quantized inside under "fp8", NVFP4Tensor; quantized weights' gradients on
straight-through masters). Skipped unless the default backend is a GPU with
at least 2 devices (tests/test_sp.py covers tp in {2, 4, 8} on simulated CPU devices)."""

from __future__ import annotations

import jax
import pytest

from jaxquant import sp
from test_sp import CASES, _layer_args, _runner, check_layers_match_single_device

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(jax.default_backend() != "gpu" or len(jax.devices()) < 2,
                                 reason="needs 2 or more GPUs")]


@pytest.mark.parametrize("overlap", sp.OVERLAPS)
@pytest.mark.parametrize("recipe,kind", CASES + [("fp8", "float"), ("bf16", "nvfp4")])
def test_layers_on_gpus_match_single_gpu(overlap, recipe, kind):
    tp = len(jax.devices())
    col_args, row_args = _layer_args(tp, recipe, kind)
    results = _runner(tp, overlap, recipe, devices="gpu")(col_args, row_args)
    # cuBLAS picks other kernels (and FP8 accumulation) for the sharded shapes: compare closely,
    # not bitwise; a misplaced chunk or a wrong scale is off by far more than this
    check_layers_match_single_device(results, col_args, row_args, recipe, rtol=1e-2, same_k_rtol=1e-2)
