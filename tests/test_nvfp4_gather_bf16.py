"""``JAXQUANT_NVFP4_GATHER_BF16`` (``fsdp.NVFP4_GATHER_BF16``): an NVFP4 weight split over ranks is dequantized before
its gather (``fsdp.dequantizes_once``): each rank makes its rows' bf16 GEMM operand in one pass
(``ops.nvfp4_bf16_operand``, the whole weight's amax from ``TrainState.weight_amax``) and the ranks gather that, in
the forward and again in the backward (reshard after forward), instead of gathering the packed bytes and decoding the
whole weight before each GEMM. A 16x16 tile lies on one rank, so the same bytes reach the GEMMs: training gives the
same bits either way. ``[in, out]`` kernels: tests/test_in_out_kernels.py; padding rows: tests/test_padding.py."""

import re

import pytest

from jaxquant.training import fsdp
from support.sharding import one_shard_spec
from support.transformer import assert_same_training, loss_loop, loss_scan, switched_runs, two_steps_bf16_wire


def test_split_nvfp4_weights_dequantize_before_the_gather_only_with_the_switch(monkeypatch):
    split = lambda **kw: one_shard_spec(**({"recipe": "nvfp4", "gather_axis": "fsdp", "num_shards": 2,
                                            "amax_axes": ("fsdp",)} | kw))
    assert not fsdp.dequantizes_once(split())
    monkeypatch.setattr(fsdp, "NVFP4_GATHER_BF16", True)
    assert fsdp.dequantizes_once(split()) and fsdp.dequantizes_once(split(pad_rows=16))
    assert fsdp.dequantizes_once(split(transposed=True))
    for kw in ({"keep_gathered": True}, {"per_use": False}, {"recipe": "fp8"}, {"recipe": "bf16"}):
        assert not fsdp.dequantizes_once(split(**kw)), kw


def _gathers(text: str) -> dict:
    """Element types of the lowered step's all-gathers, counted."""
    out = {}
    for m in re.finditer(r"stablehlo\.all_gather.*?->\s*tensor<(?:\d+x)*([a-z]+\d+)>", text):
        out[m.group(1)] = out.get(m.group(1), 0) + 1
    return out


# (loss, stacked, nvfp4_bf16_operand calls: w1, w2 of the scan body and the head; of each of 3 layers and the head;
# remat makes the body's again in the backward). The head's 64 rows are padded to 16 a rank.
@pytest.mark.parametrize("loss,stacked,calls", [(loss_scan, True, 3), (loss_loop, False, 7),
                                                (lambda w, b: loss_scan(w, b, remat=True), True, 5)],
                         ids=["scan", "loop", "scan-remat"])
@pytest.mark.fast_cases("scan")
def test_gathering_the_bf16_operand_trains_to_the_same_bits(monkeypatch, loss, stacked, calls):
    """Two NVFP4 steps on 8 ranks (every quantized weight split): the same losses and masters, bit for bit. With the
    switch the step holds one ``nvfp4_bf16_operand`` per weight use, no statistics pass and no packed bytes, and
    gathers bf16 rows where the packed way gathers bytes and scales (forward and backward)."""
    run = lambda: two_steps_bf16_wire(loss, "nvfp4", 8, stacked=stacked)
    runs = switched_runs(monkeypatch, "NVFP4_GATHER_BF16", run)
    text, text0 = runs[True][2], runs[False][2]
    assert text.count("@jq_nvfp4_bf16_operand(") == calls and "jq_nvfp4_bf16_operand" not in text0
    assert "jq_nvfp4_stats" not in text and "ui8" not in text
    # each gather of packed bytes and their scales became one gather of bf16 rows (the embedding's bf16 gather aside)
    gathers, gathers0 = _gathers(text), _gathers(text0)
    assert gathers0["ui8"] % 2 == 0, gathers0
    assert gathers == {"bf16": gathers0["ui8"] // 2 + gathers0["bf16"]}, (gathers, gathers0)
    assert_same_training(runs[True], runs[False])
