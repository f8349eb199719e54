"""Quick custom-call vs reference check on the default device (a few shapes, both recipes).

The full suite is tests/test_ops.py; this is the 10-second sanity check after a build.
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxquant as jq


def same(a, b) -> bool:
    return np.array_equal(np.atleast_1d(np.asarray(a)).view(np.uint8), np.atleast_1d(np.asarray(b)).view(np.uint8))


def main() -> int:
    rng = np.random.default_rng(0)
    bad = 0
    for rows, cols in [(16, 16), (48, 80), (144, 48), (1024, 4096), (8192, 8192)]:
        for dt in (jnp.float32, jnp.bfloat16):
            x = (rng.standard_normal((rows, cols)) * rng.choice([1e-3, 1, 1e3], (rows, cols))).astype(np.float32)
            x = jnp.asarray(x).astype(dt)
            for quant, fields in ((jq.quantize_nvfp4, ("data", "scale_inv", "amax", "data_t", "scale_inv_t")),
                                  (jq.quantize_fp8, ("data", "scale_inv", "amax", "data_t"))):
                a = jax.jit(lambda v: quant(v, columnwise=True, impl="reference"))(x)
                b = jax.jit(lambda v: quant(v, columnwise=True, impl="custom_call"))(x)
                for f in fields:
                    if not same(getattr(a, f), getattr(b, f)):
                        bad += 1
                        print(f"MISMATCH {quant.__name__} {rows}x{cols} {jnp.dtype(dt).name} {f}")
    print(f"{jax.devices()[0].device_kind}: {'all equal' if not bad else f'{bad} mismatches'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
