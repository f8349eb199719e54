"""The compiled-HLO parsers of the GPU tests, on lines XLA:GPU printed (2 x H200, jaxlib 0.11.2,
2026-11-24), so that CI keeps them working although it has no GPU: replica groups in the mesh-axes
spelling, and Triton GEMM fusions whose operand types sit in the called computation's header."""

from support.hlo import collectives, gemms, replica_group_size

# a quantizer's max all-reduce over both axes of a 1 x 2 mesh (test_sharding_gpu.py)
ALL_REDUCE = ("ROOT %pmax.5.2 = f32[1]{0} all-reduce(%param_0.1), channel_id=1, "
              "replica_groups=mesh['fsdp'=1,'tp'=2] {'fsdp','tp'}, use_global_device_ids=true, "
              "to_apply=%region_0.1._custom_call_lowering_rule")

# one FP8 GEMM of the training step on 2 GPUs (test_train_gpu.py), call site and callee
GEMM_HLO = """
%gemm_fusion_dot_general.18_computation (parameter_0: f8e4m3fn[16,256], parameter_1: f8e4m3fn[1024,256], parameter_2: f32[], parameter_3: f32[]) -> bf16[16,1024] {
}
ENTRY %main {
  %gemm_fusion_dot_general.18 = bf16[16,1024]{1,0} fusion(%get-tuple-element.36.0, %get-tuple-element.22.0, %get-tuple-element.37.0, %get-tuple-element.23.0), kind=kCustom, calls=%gemm_fusion_dot_general.18_computation, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %cublas-gemm.1 = (bf16[64,64]{1,0}, s8[0]{0}) custom-call(bf16[64,32]{1,0} %a, bf16[32,64]{1,0} %b), custom_call_target="__cublas$gemm"
}
"""  # noqa: E501 (verbatim HLO)


def test_replica_group_sizes_in_every_spelling():
    assert replica_group_size(ALL_REDUCE) == 2
    assert replica_group_size("replica_groups=mesh['fsdp'=4,'tp'=2] {'tp'}, x") == 2
    assert replica_group_size("replica_groups=mesh['fsdp'=4,'tp'=2] {'fsdp','tp'}, x") == 8
    assert replica_group_size("replica_groups={{0,1,2},{3,4,5}}, x") == 3
    assert replica_group_size("replica_groups=[2,4]<=[8], x") == 4
    assert replica_group_size("no groups here") == -1
    assert collectives(ALL_REDUCE) == [("all-reduce", "f32[1]{0}", 2)]


def test_gemms_read_fusion_operand_types_from_the_callee():
    assert gemms(GEMM_HLO) == [("triton_gemm", ("f32", "f8e4m3fn")), ("__cublas$gemm", ("bf16",))]
