"""Which manual mesh axes a value varies over inside ``shard_map`` (JAX's varying-manual-axes type), defined once.

Custom calls, Pallas kernels and freshly made zeros come out typed as invariant; ``check_vma`` and custom VJPs
reject them beside values that vary. Marking is a no-op on values; its transpose sums the cotangent over the
marked axes, which is how a weight replicated over an axis gets the gradient of every activation shard.
"""

import jax


def varying_axes(x) -> frozenset:
    """Manual mesh axes ``x`` varies over inside shard_map (empty outside)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def mark_varying(x, axes):
    """``x`` marked varying over ``axes`` (an axis name or names; those it does not vary over already)."""
    axes = (axes,) if isinstance(axes, str) else axes
    missing = tuple(sorted(frozenset(axes) - varying_axes(x)))
    if not missing:
        return x
    return jax.lax.pcast(x, missing, to="varying")


def vary_like(x, *like):
    """``x`` marked varying over every axis some of ``like`` varies over."""
    return mark_varying(x, frozenset().union(*(varying_axes(a) for a in like)))


def varying_like(outs, ins, extra_axes=()) -> list:
    """``outs`` typed as an elementwise op's results on ``ins`` would be (varying over every axis some input
    varies over), and over ``extra_axes``."""
    extra_axes = (extra_axes,) if isinstance(extra_axes, str) else extra_axes
    axes = frozenset(extra_axes).union(*(varying_axes(a) for a in ins))
    return [mark_varying(o, axes) for o in outs]
