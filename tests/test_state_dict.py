"""The layer-wise step's training state as PyTorch names it (jaxquant/training/state_dict.py), through DCP: the layout
torch's get_state_dict gives, resume on the same mesh continuing bitwise, resharding to 4 and 2 devices,
optax states it cannot map, and (with torch) the checkpoint loaded by torch.distributed.checkpoint +
set_state_dict into torch.optim.Adam, whose next step equals optax's on the same gradient, and back."""

import functools

import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import jaxquant as jq
from ckpt_helpers import common
from jaxquant import checkpoint as ck
from support.torch_twin import ADAM, NEXT_STEP_TOL, torch_required
from support.transformer import D, F, L, MASK, VOCAB, init_params, loss_scan, make_batch

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")


def make(n, opt=None):
    mesh = Mesh(np.array(jax.devices()[:n]), ("fsdp",))
    return jq.make_train_step(loss_scan, opt or optax.adam(ADAM["lr"]), mesh=mesh, quantize_mask=MASK,
                              policy=jq.MixedPrecisionPolicy(compute_weights="fp8"))


def trained(step, steps=3):
    state = step.init(init_params())
    for _ in range(steps):
        state, _ = step(state, make_batch())
    return state


@pytest.mark.slow
def test_layout_is_torchs():
    step = make(8)
    sd = step.state_dict(trained(step), hyperparams=ADAM)
    names = {"embed", "head"} | {f"blocks.{i}.{n}" for i in range(L) for n in ("w1", "w2", "norm")}
    assert set(sd["model"]) == names and set(sd["optim"]["state"]) == names
    w1 = sd["model"]["blocks.1.w1"]
    assert w1.shape == (F, D) and w1.sharding.spec[0] == "fsdp"          # one layer, still row-sharded
    entry = sd["optim"]["state"]["blocks.1.w1"]
    assert set(entry) == {"exp_avg", "exp_avg_sq", "step"} and entry["step"].dtype == np.float32
    assert float(entry["step"]) == 3.0
    group = sd["optim"]["param_groups"][0]
    assert group["betas"] == (0.9, 0.999) and group["lr"] == 1e-2 and sorted(group["params"]) == sorted(names)
    assert group["foreach"] is None and group["amsgrad"] is False


@pytest.mark.slow
def test_save_resume_same_mesh_continues_bitwise(tmp_path):
    step = make(8)
    state = trained(step)
    path = ck.save_dcp(str(tmp_path / "ckpt"), step.state_dict(state, hyperparams=ADAM))
    cont, m_cont = step(state, make_batch())
    like = step.init(init_params())
    resumed = step.load_state_dict(ck.load_dcp(path, step.state_dict_target(like)), like=like)
    assert int(resumed.step) == 3
    resumed, m_res = step(resumed, make_batch())
    assert float(m_res["loss"]) == float(m_cont["loss"])
    jax.tree.map(np.testing.assert_array_equal, step.params(resumed), step.params(cont))


@pytest.mark.parametrize("devices", [4, 2])
@pytest.mark.slow
def test_reshard_on_load(tmp_path, devices):
    """Saved on 8 FSDP ranks, loaded on fewer: identical params and optimizer state."""
    step = make(8)
    state = trained(step)
    sd = step.state_dict(state, hyperparams=ADAM)
    path = ck.save_dcp(str(tmp_path / "ckpt"), sd)
    small = make(devices)
    like = small.init(init_params())
    loaded = small.load_state_dict(ck.load_dcp(path, small.state_dict_target(like)), like=like)
    assert len(loaded.master["blocks"]["w1"].sharding.device_set) == devices
    again = small.state_dict(loaded, hyperparams=ADAM)
    for name, a in sd["model"].items():
        np.testing.assert_array_equal(np.asarray(again["model"][name]), np.asarray(a), err_msg=name)
        for k, v in sd["optim"]["state"][name].items():
            np.testing.assert_array_equal(np.asarray(again["optim"]["state"][name][k]), np.asarray(v), err_msg=k)


TP_SPECS = {"embed": None, "head": None, "blocks": {"w1": "col", "w2": "row", "norm": None}}


def make_tp(fsdp, tp):
    """The layer-wise step on an (fsdp, tp) mesh, w1 column- and w2 row-parallel over "tp" (bf16 weights)."""
    mesh = Mesh(np.array(jax.devices()[:fsdp * tp]).reshape(fsdp, tp), ("fsdp", "tp"))
    loss = functools.partial(loss_scan, tp_axis="tp") if tp > 1 else loss_scan
    return jq.make_train_step(loss, optax.adam(ADAM["lr"]), mesh=mesh, quantize_mask=MASK, tp_axis="tp",
                              param_specs=TP_SPECS, policy=jq.MixedPrecisionPolicy(compute_weights="bf16"))


def _host_sd(sd):
    return {"model": {n: np.asarray(a) for n, a in sd["model"].items()},
            "optim": {n: {k: np.asarray(v) for k, v in e.items()} for n, e in sd["optim"]["state"].items()}}


@pytest.mark.slow
def test_reshard_across_tp_layouts(tmp_path):
    """Saved on (fsdp 4, tp 2), loaded on (fsdp 8, tp 1), (fsdp 2, tp 1) and (fsdp 1, tp 2): parameters and Adam
    state bitwise equal to what was saved, in the target's sharding; the next step's loss (a forward pass at the
    loaded parameters) equals the saving layout's within fp32 reordering."""
    src = make_tp(4, 2)
    state = trained(src)
    assert tuple(state.master["blocks"]["w1"].sharding.spec)[1] == ("tp", "fsdp")
    assert tuple(state.master["blocks"]["w2"].sharding.spec) == (None, "fsdp", "tp")
    sd = src.state_dict(state, hyperparams=ADAM)
    path = ck.save_dcp(str(tmp_path / "ckpt"), sd)
    want, want_params = _host_sd(sd), jax.tree.map(np.asarray, src.params(state))
    _, m_src = src(state, make_batch(2))
    for fsdp, tp in ((8, 1), (2, 1), (1, 2)):
        dst = make_tp(fsdp, tp)
        like = dst.init(init_params())
        loaded = dst.load_state_dict(ck.load_dcp(path, dst.state_dict_target(like)), like=like)
        where = f"(fsdp {fsdp}, tp {tp})"
        assert int(loaded.step) == 3, where
        assert len(loaded.master["blocks"]["w1"].sharding.device_set) == fsdp * tp, where
        same_sharding = jax.tree.map(lambda a, b: a.sharding == b.sharding, (loaded.master, loaded.opt_state),
                                     (like.master, like.opt_state))
        assert all(jax.tree.leaves(same_sharding)), where      # master and Adam state: the target's shardings
        got = _host_sd(dst.state_dict(loaded, hyperparams=ADAM))
        for name, a in want["model"].items():
            assert common.same_bytes(got["model"][name], a), f"{where}: {name}"
            for k, v in want["optim"][name].items():
                assert common.same_bytes(got["optim"][name][k], v), f"{where}: {name} {k}"
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b, err_msg=where),
                     dst.params(loaded), want_params)
        _, m = dst(loaded, make_batch(2))
        np.testing.assert_allclose(float(m["loss"]), float(m_src["loss"]), rtol=1e-5, err_msg=where)


@pytest.mark.slow
def test_hyperparams_from_inject_hyperparams_and_sgd_momentum():
    step = make(8, optax.inject_hyperparams(optax.adam)(learning_rate=3e-3, b1=0.8))
    group = step.state_dict(trained(step, 1))["optim"]["param_groups"][0]
    assert group["lr"] == pytest.approx(3e-3) and group["betas"][0] == pytest.approx(0.8)
    sgd = make(8, optax.sgd(0.1, momentum=0.9))
    sd = sgd.state_dict(trained(sgd, 1), hyperparams=dict(lr=0.1, momentum=0.9, weight_decay=0.0))
    assert set(sd["optim"]["state"]["head"]) == {"momentum_buffer"}


@pytest.mark.slow
def test_injected_schedule_resumes_at_the_step_count():
    """optax.inject_hyperparams keeps its own step counter (it drives a schedule): a loaded state's counter
    is the checkpoint's step count, not 0, so the learning rate continues where the run left off."""
    sched = optax.linear_schedule(1e-2, 0.0, transition_steps=10)
    step = make(8, optax.inject_hyperparams(optax.adam)(learning_rate=sched))
    state = trained(step, 2)
    sd = step.state_dict(state)     # its arrays may be the live state's; the loaded state gets its own
    like = step.init(init_params())
    loaded = step.load_state_dict(sd, like=like)
    assert int(loaded.opt_state.count) == int(state.opt_state.count) == 2
    cont, resumed = step(state, make_batch())[0], step(loaded, make_batch())[0]     # lr = sched(2) in both
    assert float(resumed.opt_state.hyperparams["learning_rate"]) == pytest.approx(float(sched(2)), rel=1e-6)
    jax.tree.map(np.testing.assert_array_equal, step.params(resumed), step.params(cont))


@pytest.mark.slow
def test_plain_schedule_and_sgd_resume_at_the_step_count():
    """A schedule passed straight to optax (ScaleByScheduleState, as in optax.adamw(learning_rate=schedule))
    keeps a step counter too: after a load it is the checkpoint's Adam step, so the next update equals the
    uninterrupted run's. PyTorch's SGD keeps no step count: load_state_dict(step_count=...) supplies it."""
    sched = optax.linear_schedule(1e-2, 0.0, transition_steps=10)
    for opt, kw, count in ((optax.adamw(sched, weight_decay=0.0), dict(hyperparams=ADAM), None),
                           (optax.sgd(sched, momentum=0.9), dict(hyperparams=dict(lr=0.1, momentum=0.9,
                                                                                  weight_decay=0.0)), 2)):
        step = make(8, opt)
        state = trained(step, 2)
        loaded = step.load_state_dict(step.state_dict(state, **kw), like=step.init(init_params()), step_count=count)
        counts = [int(c.count) for c in jax.tree.leaves(loaded.opt_state, is_leaf=lambda s: isinstance(
            s, optax.ScaleByScheduleState)) if isinstance(c, optax.ScaleByScheduleState)]
        assert counts == [2] and int(loaded.step) == 2
        cont, resumed = step(state, make_batch())[0], step(loaded, make_batch())[0]     # lr = sched(2) in both
        jax.tree.map(np.testing.assert_array_equal, step.params(resumed), step.params(cont))
    with pytest.raises(ValueError, match="step_count: 3 differs from the checkpoint's Adam step 2"):
        adam = make(8, optax.adamw(sched, weight_decay=0.0))
        adam.load_state_dict(adam.state_dict(trained(adam, 2), hyperparams=ADAM), like=adam.init(init_params()),
                             step_count=3)


@pytest.mark.slow
def test_unmappable_states_are_named():
    step = make(8)
    with pytest.raises(ValueError, match=r"hyperparams: PyTorch's param_groups need \['lr', 'betas', 'eps'"):
        step.state_dict(trained(step, 1))
    lion = make(8, optax.lion(1e-3))
    with pytest.raises(ValueError, match="optimizer: its state ScaleByLionState has no PyTorch counterpart"):
        lion.state_dict(trained(lion, 1), hyperparams=ADAM)


def test_a_donated_state_is_refused_with_one_line():
    step = make(8)
    state = step.init(init_params())
    step(state, make_batch())           # consumes (donates) state
    with pytest.raises(ValueError, match=r"state: its arrays were donated to a training step \(master\."):
        step.state_dict(state, hyperparams=ADAM)



@torch_required
@pytest.mark.slow
def test_torch_adam_loads_it_and_steps_like_optax(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    step = make(8)
    state = trained(step)
    path = ck.save_dcp(str(tmp_path / "jax"), step.state_dict(state, hyperparams=ADAM))

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = torch.nn.Parameter(torch.zeros(F, D))
            self.w2 = torch.nn.Parameter(torch.zeros(D, F))
            self.norm = torch.nn.Parameter(torch.zeros(1, D))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Parameter(torch.zeros(VOCAB, D))
            self.head = torch.nn.Parameter(torch.zeros(VOCAB, D))
            self.blocks = torch.nn.ModuleList([Block() for _ in range(L)])

    model = Model()
    opt = torch.optim.Adam(model.parameters(), lr=1.0)          # lr and betas come from the checkpoint
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path, no_dist=True)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    assert opt.param_groups[0]["lr"] == ADAM["lr"]

    # one more Adam step on the same (random) gradient in torch and in optax
    grads = jax.tree.map(lambda a: np.asarray(jax.random.normal(jax.random.key(5), a.shape), np.float32), state.master)
    updates, _ = optax.adam(ADAM["lr"]).update(grads, state.opt_state, state.master)
    after = jax.device_get(optax.apply_updates(state.master, updates))
    for name, p in model.named_parameters():
        parts = name.split(".")
        g = grads[parts[0]] if len(parts) == 1 else grads["blocks"][parts[2]][int(parts[1])]
        p.grad = torch.from_numpy(np.ascontiguousarray(g))
    opt.step()
    for name, p in model.named_parameters():
        parts = name.split(".")
        want = after[parts[0]] if len(parts) == 1 else after["blocks"][parts[2]][int(parts[1])]
        np.testing.assert_allclose(p.detach().numpy(), want, err_msg=name, **NEXT_STEP_TOL)

    # and back: torch saves its state, JAX resumes from it
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "torch"), no_dist=True)
    like = step.init(init_params())
    back = step.load_state_dict(ck.load_dcp(str(tmp_path / "torch"), step.state_dict_target(like)), like=like)
    assert int(back.step) == 4
    got = jax.device_get(back.master)
    for name, p in model.named_parameters():
        parts = name.split(".")
        have = got[parts[0]] if len(parts) == 1 else got["blocks"][parts[2]][int(parts[1])]
        np.testing.assert_array_equal(have, p.detach().numpy(), err_msg=name)
