"""What the tests that hold the state dict to PyTorch's share: torch's Adam hyperparameters, the tolerance of one
optimizer step torch against optax, the skip without torch, and torch's own way to load and save a DCP checkpoint."""

import importlib.util
import os

import pytest

from ckpt_helpers import common

ADAM = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
# torch's next Adam step vs optax's on the same fp32 state and gradient
NEXT_STEP_TOL = dict(rtol=1e-6, atol=1e-7)

torch_required = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None and os.environ.get("JAXQUANT_REQUIRE_TORCH") != "1",
    reason="torch Adam interop " + common.TORCH_SKIP_REASON)


def torch_load(model, opt, path):
    """torch's way in: dcp.load into get_state_dict's template, then set_state_dict (strict)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path, no_dist=True)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd, options=StateDictOptions(strict=True))
    missing, unexpected = model.load_state_dict(msd, strict=True)
    assert not missing and not unexpected


def torch_save(model, opt, path):
    """torch's way out: dcp.save of get_state_dict."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path, no_dist=True)
