"""The Python examples of the README and of the docs pages it sends readers to (docs/flax.md, docs/api.md) run as
written (each page's ```python blocks in order, in one namespace) and do what the text says."""

import re
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def run_blocks(path: Path, at_least: int) -> dict:
    """Runs the page's ```python blocks in order in one namespace and returns it (```py blocks are fragments)."""
    blocks = re.findall(r"```python\n(.*?)```", path.read_text(), re.S)
    assert len(blocks) >= at_least, f"{path.name} lost its Python examples"
    ns: dict = {}
    for block in blocks:
        exec(compile(block, str(path), "exec"), ns)
    return ns


def rows_by_path(rows) -> dict:
    return {r["path"]: r for r in rows}


def test_readme_keeps_the_ci_commands_and_no_test_count():
    """.ci/run reads the first bash line after each marker; the quick start states no test count or CI timing."""
    text = README.read_text()
    for marker in ("<!-- ci:demo -->", "<!-- ci:test -->"):
        after = text.split(marker, 1)[1].lstrip("\n")
        assert after.startswith("```bash\npip install "), marker
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert not re.search(r"\d+ tests\b|\bminutes\b", quick), "the quick start carries a test count or CI timing"


@pytest.mark.slow
def test_readme_flax_model_end_to_end(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ns = run_blocks(README, 2)
    # "the loss falls from about 5.6 to about 3.1"
    losses = ns["losses"]
    assert len(losses) == 10 and all(np.isfinite(losses)), losses
    assert abs(losses[0] - 5.6) < 0.2 and abs(losses[-1] - 3.1) < 0.4, losses
    # the plan: the multi-axis einsum kernel as a 2-D [in, out] fp8 matrix, the head bf16, the rest kept
    rows = rows_by_path(ns["plan"])
    assert rows["blocks.0.qkv.kernel"]["shape"] == (128, 384) and rows["blocks.0.qkv.kernel"]["recipe"] == "fp8"
    assert rows["blocks.0.up.kernel"]["recipe"] == "fp8"
    assert rows["head.kernel"]["recipe"] == "bf16" and "output head" in rows["head.kernel"]["why"]
    for path in ("embed.embedding", "blocks.0.norm.scale", "blocks.0.up.bias"):
        assert rows[path]["recipe"] == "kept", rows[path]
    # merge: the user's own model class, kernels in their own shapes
    trained = ns["trained"]
    assert type(trained).__name__ == "TinyLM"
    assert trained.blocks[0].qkv.kernel[...].shape == (3, 128, 4, 32)
    # the checkpoint: PyTorch names and [out, in] kernels, Adam's state with it
    from jaxquant.checkpoint import inspect_dcp

    report = inspect_dcp(str(tmp_path / "ckpt"))
    assert report["ok"], report["problems"]
    keys = {k["key"]: k for k in report["keys"]}
    assert keys["model.blocks.0.qkv.kernel"]["shape"] == [384, 128]
    assert keys["model.head.kernel"]["shape"] == [256, 128]
    assert "optim.state.blocks.0.qkv.kernel.exp_avg" in keys


@pytest.mark.slow
def test_flax_doc_linen_example():
    ns = run_blocks(ROOT / "docs" / "flax.md", 1)
    rows = rows_by_path(ns["linen_plan"])
    assert rows["head.kernel"]["recipe"] == "bf16"
    assert {r["recipe"] for p, r in rows.items() if p.endswith("kernel") and p != "head.kernel"} == {"nvfp4"}
    assert rows["Embed_0.embedding"]["recipe"] == "kept"
    assert set(ns["variables"]["params"]) == {"Embed_0", "Dense_0", "Dense_1", "head"}


@pytest.mark.slow
def test_api_doc_examples_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ns = run_blocks(ROOT / "docs" / "api.md", 3)
    # What the examples claim.
    assert ns["q4"].data.shape == (4096, 512) and ns["q4"].scale_inv.shape == (4096, 64)
    assert ns["w_hat"].dtype == np.dtype("bfloat16")
    assert ns["weights"][0].data_t is not None
    np.testing.assert_array_equal(np.asarray(ns["rows"][0]),                 # split=False: same weights
                                  np.asarray(ns["weights"][0].dequantize(ns["jnp"].bfloat16)[0]))
    np.testing.assert_array_equal(np.asarray(ns["weights"][0].data), np.asarray(ns["q4"].data))
    w2 = ns["weights2"]                                 # FSDP x TP: aligned splits equal whole-tensor bytes
    np.testing.assert_array_equal(np.asarray(w2[0].data), np.asarray(ns["weights"][0].data))
    np.testing.assert_array_equal(np.asarray(w2[1].scale_inv), np.asarray(ns["weights"][1].scale_inv))
    restored = ns["restored"]
    assert restored["step"] == 100
    np.testing.assert_array_equal(np.asarray(restored["model"]["w"]), np.asarray(ns["w"]))
    np.testing.assert_array_equal(np.asarray(restored["model"]["w_nvfp4"].data), np.asarray(ns["q4"].data))
