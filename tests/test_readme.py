"""The README's Python examples run as written (in order, in one namespace) and do what they say."""

import re
from pathlib import Path

import numpy as np
import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.mark.slow
def test_readme_python_examples_run(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 3, "README lost its Python examples"
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), ns)
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
