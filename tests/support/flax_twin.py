"""What the flax models' PyTorch-twin tests share (tests/test_flax_twin.py, tests/test_flax_styles_twin.py): a flax
parameter in torch's layout, parameters and Adam moments by their default (dotted) names, the twin compared with
them, and optax's next Adam step."""

import jax
import numpy as np
import optax

from jaxquant.training.rules import dotted_path
from support.torch_twin import ADAM


def torch_layout(default, a):
    """A flax parameter (by default name) as the twin holds it: kernels ``[in, out]`` -> ``[out, in]``."""
    a = np.asarray(a)
    return np.ascontiguousarray(a.T) if default.endswith(".kernel") else a


def by_name(tree, scan, layers=0):
    """{default name: numpy array} of a params-like tree (under ``scan``, a stacked ``layers.*`` leaf split into its
    ``layers`` layers)."""
    out = {}
    for path, a in jax.tree_util.tree_flatten_with_path(jax.device_get(tree))[0]:
        name = dotted_path(path)
        if scan and name.startswith("layers."):
            out.update({f"layers.{i}.{name[len('layers.'):]}": np.asarray(a[i]) for i in range(layers)})
        else:
            out[name] = np.asarray(a)
    return out


def adam_of(opt_state):
    return next(s for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
                if isinstance(s, optax.ScaleByAdamState))


def flat_state(state, scan, layers=0):
    """(master, {"mu", "nu"}) by default name, numpy."""
    adam = adam_of(state.opt_state)
    return by_name(state.master, scan, layers), {"mu": by_name(adam.mu, scan, layers),
                                                 "nu": by_name(adam.nu, scan, layers)}


def assert_twin_holds(model, opt, flat_params, nm, flat_moments=None, **tol):
    """Every twin parameter (and, given ``flat_moments`` = {"mu": ..., "nu": ...}, its exp_avg / exp_avg_sq) is the
    flax value of its default name in torch's layout: bitwise without ``tol``; with it (``NEXT_STEP_TOL``), the
    parameters within it and the moments within its ``rtol``, relative to each element and to the tensor's
    largest entry (m cancels to near 0 in places: b1 m + (1 - b1) g)."""
    for name, p in model.named_parameters():
        default = nm.from_torch[name]
        want = torch_layout(default, flat_params[default])
        if tol:
            np.testing.assert_allclose(p.detach().numpy(), want, err_msg=name, **tol)
        else:
            np.testing.assert_array_equal(p.detach().numpy(), want, err_msg=name)
        for key, field in (("exp_avg", "mu"), ("exp_avg_sq", "nu")) if flat_moments else ():
            want = torch_layout(default, flat_moments[field][default])
            if tol:     # tol's atol is sized for the parameters (~0.1); the moments are ~1e-3 (m) and ~1e-6 (v)
                scale = float(np.max(np.abs(want)))
                np.testing.assert_allclose(opt.state[p][key].numpy(), want, rtol=tol["rtol"],
                                           atol=tol["rtol"] * scale, err_msg=f"{name} {key}")
            else:
                np.testing.assert_array_equal(opt.state[p][key].numpy(), want, err_msg=f"{name} {key}")


@jax.jit
def _adam_next(grads_tree, opt_state, master):
    """Jitted: one program instead of one per op (each compiled on first use, over 8 devices)."""
    updates, new = optax.adam(ADAM["lr"]).update(grads_tree, opt_state, master)
    return optax.apply_updates(master, updates), new


def optax_next(grads_tree, state):
    """optax's next Adam step from ``state`` on ``grads_tree``: (master, {"mu", "nu"}) as trees."""
    master, new = _adam_next(grads_tree, state.opt_state, state.master)
    return master, adam_of(new)
