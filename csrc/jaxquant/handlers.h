// Binding of the FFI handlers: one list for both platforms. JQ_DEFINE_HANDLERS(Cpu, JQ_NO_CTX)
// expects functions AmaxCpu, Fp8CastCpu, ... in scope; the CUDA file passes a stream context.
#pragma once

#include "xla/ffi/api/ffi.h"

// Target names as Python calls them -> handler symbol stem.
#define JQ_FOR_EACH_TARGET(X)                      \
  X("jq_amax", JqAmax)                             \
  X("jq_fp8_cast", JqFp8Cast)                      \
  X("jq_fp8_cast_t", JqFp8CastT)                   \
  X("jq_nvfp4_tile_amax", JqNvfp4TileAmax)         \
  X("jq_nvfp4_scale", JqNvfp4Scale)                \
  X("jq_nvfp4_cast_partial", JqNvfp4CastPartial)   \
  X("jq_nvfp4_transpose", JqNvfp4Transpose)        \
  X("jq_nvfp4_scale_transpose", JqNvfp4ScaleTranspose) \
  X("jq_fp8_stats", JqFp8Stats)                    \
  X("jq_fp8_quantize", JqFp8Quantize)              \
  X("jq_fp8_quantize_t", JqFp8QuantizeT)           \
  X("jq_nvfp4_stats", JqNvfp4Stats)                \
  X("jq_nvfp4_quantize", JqNvfp4Quantize)          \
  X("jq_nvfp4_quantize_t", JqNvfp4QuantizeT)       \
  X("jq_nvfp4_bf16_operand", JqNvfp4Bf16Operand)  \
  X("jq_nvfp4_group_tile_amax", JqNvfp4GroupTileAmax) \
  X("jq_nvfp4_group_cast", JqNvfp4GroupCast)         \
  X("jq_fp8_group_amax", JqFp8GroupAmax)             \
  X("jq_fp8_group_cast", JqFp8GroupCast)             \
  X("jq_nvfp4_group_scale", JqNvfp4GroupScale)       \
  X("jq_nvfp4_group_columnwise", JqNvfp4GroupColumnwise) \
  X("jq_fp8_group_transpose", JqFp8GroupTranspose) \
  X("jq_group_split", JqGroupSplit)

// Targets only the CUDA module has, and only when build.py found cuBLASLt's header (JQ_HAVE_CUBLASLT): the FP8 GEMM
// and the scaled bf16 GEMM (cuda_gemm.cu). Python declares them CUDA-only and optional
// (jaxquant/primitives/ops/single.py).
#define JQ_FOR_EACH_CUBLASLT_TARGET(X) \
  X("jq_fp8_gemm", JqFp8Gemm)          \
  X("jq_bf16_gemm", JqBf16Gemm)

#define JQ_NO_CTX
// Handlers that only enqueue work on the stream (no host sync, no data-dependent host decisions)
// may be captured into XLA command buffers (CUDA graphs).
#define JQ_CMD_BUFFER {::xla::ffi::Traits::kCmdBufferCompatible}
#define JQ_CUDA_CTX .Ctx<::xla::ffi::PlatformStream<cudaStream_t>>()

// Single-tensor ops (cuda_ops.cu), grouped ops (cuda_group_ops.cu); the CPU file defines both.
#define JQ_DEFINE_TENSOR_HANDLERS(S, CTX)                                                                  \
  namespace F = ::xla::ffi;                                                                         \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(JqAmax##S, Amax##S,                                                 \
                                F::Ffi::Bind() CTX.Arg<F::AnyBuffer>()                              \
                                    .Ret<F::Buffer<F::F32>>()                                       \
                                    .Ret<F::Buffer<F::S32>>(), JQ_CMD_BUFFER);                      \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(JqFp8Cast##S, Fp8Cast##S,                                           \
                                F::Ffi::Bind() CTX.Arg<F::AnyBuffer>()                              \
                                    .Arg<F::Buffer<F::F32>>()                                       \
                                    .Attr<float>("amax_epsilon")                                    \
                                    .Attr<bool>("force_pow_2_scales")                               \
                                    .Ret<F::AnyBuffer>()                                            \
                                    .Ret<F::Buffer<F::F32>>(), JQ_CMD_BUFFER);                      \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(JqFp8CastT##S, Fp8CastT##S,                                         \
                                F::Ffi::Bind() CTX.Arg<F::AnyBuffer>()                              \
                                    .Arg<F::Buffer<F::F32>>()                                       \
                                    .Attr<float>("amax_epsilon")                                    \
                                    .Attr<bool>("force_pow_2_scales")                               \
                                    .Ret<F::AnyBuffer>()                                            \
                                    .Ret<F::Buffer<F::F32>>()                                       \
                                    .Ret<F::AnyBuffer>(), JQ_CMD_BUFFER);                           \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(JqNvfp4TileAmax##S, TileAmax##S,                                    \
                                F::Ffi::Bind() CTX.Arg<F::AnyBuffer>()                              \
                                    .Attr<int64_t>("rows")                                          \
                                    .Attr<int64_t>("cols")                                          \
                                    .Attr<int64_t>("start")                                         \
                                    .Ret<F::Buffer<F::F32>>()                                       \
                                    .Ret<F::Buffer<F::S32>>(), JQ_CMD_BUFFER);                      \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(JqNvfp4Scale##S, Scale##S,                                          \
                                F::Ffi::Bind() CTX.Arg<F::Buffer<F::F32>>()                         \
                                    .Arg<F::Buffer<F::F32>>()                                       \
                                    .Ret<F::Buffer<F::U8>>(), JQ_CMD_BUFFER);                       \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(JqNvfp4CastPartial##S, CastPartial##S,                              \
                                F::Ffi::Bind() CTX.Arg<F::AnyBuffer>()                              \
                                    .Arg<F::Buffer<F::U8>>()                                        \
                                    .Arg<F::Buffer<F::U8>>()                                        \
                                    .Arg<F::Buffer<F::F32>>()                                       \
                                    .Attr<int64_t>("rows")                                          \
                                    .Attr<int64_t>("cols")                                          \
                                    .Attr<int64_t>("start")                                         \
                                    .Ret<F::Buffer<F::U8>>(), JQ_CMD_BUFFER);                       \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(JqNvfp4Transpose##S, Transpose##S,                                  \
                                F::Ffi::Bind() CTX.Arg<F::Buffer<F::U8>>().Ret<F::Buffer<F::U8>>(), JQ_CMD_BUFFER); \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(JqNvfp4ScaleTranspose##S, ScaleTranspose##S,                        \
                                F::Ffi::Bind() CTX.Arg<F::Buffer<F::U8>>()                          \
                                    .Attr<int64_t>("rows")                                          \
                                    .Attr<int64_t>("cols")                                          \
                                    .Ret<F::Buffer<F::U8>>(), JQ_CMD_BUFFER);                       \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(JqFp8Stats##S, Fp8Stats##S,                                         \
                                F::Ffi::Bind() CTX.Arg<F::AnyBuffer>()                              \
                                    .Attr<bool>("round_bf16")                                       \
                                    .Ret<F::Buffer<F::F32>>()                                       \
                                    .Ret<F::Buffer<F::S32>>(), JQ_CMD_BUFFER);                      \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(JqFp8Quantize##S, Fp8Quantize##S,                                   \
                                F::Ffi::Bind() CTX.Arg<F::AnyBuffer>()                              \
                                    .Arg<F::Buffer<F::F32>>()                                       \
                                    .Attr<float>("amax_epsilon")                                    \
                                    .Attr<bool>("force_pow_2_scales")                               \
                                    .Attr<bool>("round_bf16")                                       \
                                    .Ret<F::AnyBuffer>()                                            \
                                    .Ret<F::Buffer<F::F32>>(), JQ_CMD_BUFFER);                      \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(JqFp8QuantizeT##S, Fp8QuantizeT##S,                                 \
                                F::Ffi::Bind() CTX.Arg<F::AnyBuffer>()                              \
                                    .Arg<F::Buffer<F::F32>>()                                       \
                                    .Attr<float>("amax_epsilon")                                    \
                                    .Attr<bool>("force_pow_2_scales")                               \
                                    .Attr<bool>("round_bf16")                                       \
                                    .Ret<F::AnyBuffer>()                                            \
                                    .Ret<F::Buffer<F::F32>>()                                       \
                                    .Ret<F::AnyBuffer>(), JQ_CMD_BUFFER);                           \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(JqNvfp4Stats##S, Nvfp4Stats##S,                                     \
                                F::Ffi::Bind() CTX.Arg<F::AnyBuffer>()                              \
                                    .Attr<bool>("round_bf16")                                       \
                                    .Ret<F::Buffer<F::F32>>()                                       \
                                    .Ret<F::Buffer<F::F32>>()                                       \
                                    .Ret<F::Buffer<F::S32>>(), JQ_CMD_BUFFER);                      \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(JqNvfp4Quantize##S, Nvfp4Quantize##S,                               \
                                F::Ffi::Bind() CTX.Arg<F::AnyBuffer>()                              \
                                    .Arg<F::Buffer<F::F32>>()                                       \
                                    .Arg<F::Buffer<F::F32>>()                                       \
                                    .Attr<bool>("round_bf16")                                       \
                                    .Ret<F::Buffer<F::U8>>()                                        \
                                    .Ret<F::Buffer<F::U8>>(), JQ_CMD_BUFFER);                       \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(JqNvfp4QuantizeT##S, Nvfp4QuantizeT##S,                             \
                                F::Ffi::Bind() CTX.Arg<F::AnyBuffer>()                              \
                                    .Arg<F::Buffer<F::F32>>()                                       \
                                    .Arg<F::Buffer<F::F32>>()                                       \
                                    .Attr<bool>("round_bf16")                                       \
                                    .Ret<F::Buffer<F::U8>>()                                        \
                                    .Ret<F::Buffer<F::U8>>()                                        \
                                    .Ret<F::Buffer<F::U8>>()                                        \
                                    .Ret<F::Buffer<F::U8>>(), JQ_CMD_BUFFER);                       \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(JqNvfp4Bf16Operand##S, Nvfp4Bf16Operand##S,                         \
                                F::Ffi::Bind() CTX.Arg<F::AnyBuffer>()                              \
                                    .Arg<F::Buffer<F::F32>>()                                       \
                                    .Attr<bool>("round_bf16")                                       \
                                    .Ret<F::Buffer<F::BF16>>(), JQ_CMD_BUFFER);

#define JQ_DEFINE_GROUP_HANDLERS(S, CTX)                                                            \
  namespace F = ::xla::ffi;                                                                        \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(JqNvfp4GroupTileAmax##S, GroupTileAmax##S,                          \
                                F::Ffi::Bind() CTX.Arg<F::AnyBuffer>()                              \
                                    .Arg<F::Buffer<F::S32>>()                                       \
                                    .Arg<F::Buffer<F::U32>>()                                       \
                                    .Attr<bool>("round_bf16")                                       \
                                    .Ret<F::Buffer<F::F32>>()                                       \
                                    .Ret<F::Buffer<F::F32>>()                                       \
                                    .Ret<F::Buffer<F::S32>>(), JQ_CMD_BUFFER);                                     \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(JqNvfp4GroupCast##S, GroupCast##S,                                  \
                                F::Ffi::Bind() CTX.Arg<F::AnyBuffer>()                              \
                                    .Arg<F::Buffer<F::S32>>()                                       \
                                    .Arg<F::Buffer<F::U32>>()                                       \
                                    .Arg<F::Buffer<F::U32>>()                                       \
                                    .Arg<F::Buffer<F::F32>>()                                       \
                                    .Attr<bool>("round_bf16")                                       \
                                    .Ret<F::Buffer<F::U8>>(), JQ_CMD_BUFFER);                                      \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(JqFp8GroupAmax##S, Fp8GroupAmax##S,                                 \
                                F::Ffi::Bind() CTX.Arg<F::AnyBuffer>()                              \
                                    .Arg<F::Buffer<F::S32>>()                                       \
                                    .Arg<F::Buffer<F::U32>>()                                       \
                                    .Attr<bool>("round_bf16")                                       \
                                    .Ret<F::Buffer<F::F32>>()                                       \
                                    .Ret<F::Buffer<F::S32>>(), JQ_CMD_BUFFER);                                     \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(JqFp8GroupCast##S, Fp8GroupCast##S,                                 \
                                F::Ffi::Bind() CTX.Arg<F::AnyBuffer>()                              \
                                    .Arg<F::Buffer<F::S32>>()                                       \
                                    .Arg<F::Buffer<F::U32>>()                                       \
                                    .Arg<F::Buffer<F::F32>>()                                       \
                                    .Attr<bool>("round_bf16")                                       \
                                    .Attr<int64_t>("first")                                         \
                                    .Ret<F::AnyBuffer>(), JQ_CMD_BUFFER);                                          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(JqNvfp4GroupScale##S, GroupScale##S,                                \
                                F::Ffi::Bind() CTX.Arg<F::Buffer<F::F32>>()                         \
                                    .Arg<F::Buffer<F::F32>>()                                       \
                                    .Arg<F::Buffer<F::U32>>()                                       \
                                    .Ret<F::Buffer<F::U8>>()                                        \
                                    .Ret<F::Buffer<F::F32>>(), JQ_CMD_BUFFER);                                     \
  /* the transposes: scale_inv (NVFP4), table, the gathered pieces of the data (GatheredSpace); */ \
  /* one result per parameter (NVFP4: all data_t, then all scale_inv_t)                        */ \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(JqNvfp4GroupColumnwise##S, GroupColumnwise##S,                      \
                                F::Ffi::Bind() CTX.Arg<F::Buffer<F::U8>>()                          \
                                    .Arg<F::Buffer<F::U32>>()                                       \
                                    .RemainingArgs()                                                \
                                    .Attr<F::Span<const int64_t>>("ranges")                         \
                                    .Attr<F::Span<const int64_t>>("space")                          \
                                    .RemainingRets(), JQ_CMD_BUFFER);                                              \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(JqFp8GroupTranspose##S, Fp8GroupTranspose##S,                       \
                                F::Ffi::Bind() CTX.Arg<F::Buffer<F::U32>>()                         \
                                    .RemainingArgs()                                                \
                                    .Attr<F::Span<const int64_t>>("ranges")                         \
                                    .Attr<F::Span<const int64_t>>("space")                          \
                                    .RemainingRets(), JQ_CMD_BUFFER);                                              \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(JqGroupSplit##S, GroupSplit##S,                                     \
                                F::Ffi::Bind() CTX.RemainingArgs()                                  \
                                    .RemainingRets()                                                \
                                    .Attr<F::Span<const int64_t>>("plan")                           \
                                    .Attr<bool>("partial"), JQ_CMD_BUFFER);

#define JQ_DEFINE_HANDLERS(S, CTX) \
  JQ_DEFINE_TENSOR_HANDLERS(S, CTX)  \
  JQ_DEFINE_GROUP_HANDLERS(S, CTX)

// (the stream, XLA's device ordinal: the key of the cached handle and algorithm) a, b and their factors -> the
// result and cuBLASLt's workspace (a result: XLA allocates it with the program's
// buffers, so the call holds no allocation of its own and replays in a command buffer unchanged).
#define JQ_DEFINE_CUBLASLT_HANDLERS(S, CTX)                                                          \
  namespace F = ::xla::ffi;                                                                         \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(JqFp8Gemm##S, Fp8Gemm##S,                                           \
                                F::Ffi::Bind() CTX.Ctx<F::DeviceOrdinal>()                          \
                                    .Arg<F::AnyBuffer>()                                            \
                                    .Arg<F::AnyBuffer>()                                            \
                                    .Arg<F::Buffer<F::F32>>()                                       \
                                    .Arg<F::Buffer<F::F32>>()                                       \
                                    .Attr<bool>("fast_accum")                                       \
                                    .Attr<bool>("factor_product")                                   \
                                    .Ret<F::AnyBuffer>()                                            \
                                    .Ret<F::Buffer<F::U8>>(), JQ_CMD_BUFFER);                       \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(JqBf16Gemm##S, Bf16Gemm##S,                                         \
                                F::Ffi::Bind() CTX.Ctx<F::DeviceOrdinal>()                          \
                                    .Arg<F::Buffer<F::BF16>>()                                      \
                                    .Arg<F::Buffer<F::BF16>>()                                      \
                                    .Arg<F::Buffer<F::F32>>()                                       \
                                    .Attr<bool>("b_kn")                                             \
                                    .Ret<F::Buffer<F::BF16>>()                                      \
                                    .Ret<F::Buffer<F::U8>>(), JQ_CMD_BUFFER);
