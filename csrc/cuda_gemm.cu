// CUDA FFI handlers of the GEMMs on cuBLASLt (jaxquant/primitives/gemm.py scaled_gemm), each with its per-tensor
// factors applied in cuBLASLt's epilogue, so that the product is rounded once, to the result's dtype, inside the GEMM
// (XLA's own GEMMs write fp32 and leave the factors and the cast to the kernels that read it):
//   jq_fp8_gemm   the FP8 GEMM (docs/numerics.md §1): float8 operands, their scale_inv factors;
//   jq_bf16_gemm  the scaled bf16 GEMM that NVFP4 runs on Hopper (§2.8): an NVFP4 operand decoded to its exact bf16
//                 value, the global decode factor multiplying the fp32 accumulator, the result in bf16.
//
// Compiled with JQ_HAVE_CUBLASLT only where build.py found cuBLASLt's header (the CUDA toolkit's or the
// nvidia-cublas wheel's that JAX's CUDA plugin depends on). The library is not linked: it is opened at the first call,
// the copy JAX has already loaded first (by its soname), so that one process holds one cuBLASLt (see load_cublaslt).
#include <cuda_runtime.h>

#include "jaxquant/ffi_checks.h"
#include "jaxquant/handlers.h"

#if JQ_HAVE_CUBLASLT
#include <cublasLt.h>
#include <dlfcn.h>

#include <map>
#include <mutex>
#include <string>
#include <tuple>

namespace jaxquant {
namespace {

// The workspace result's first bytes hold the device scalars (the FP8 factor-product mode's alpha and beta); cuBLASLt
// gets the rest, and its heuristic picks only algorithms that fit in it.
constexpr int64_t kScalarBytes = 256;

// cuBLASLt's entry points, resolved from the loaded library.
struct CublasLt {
  decltype(&cublasLtCreate) create = nullptr;
  decltype(&cublasLtGetVersion) get_version = nullptr;
  decltype(&cublasLtGetStatusString) status_string = nullptr;
  decltype(&cublasLtMatmulDescCreate) desc_create = nullptr;
  decltype(&cublasLtMatmulDescDestroy) desc_destroy = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) desc_set = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) layout_create = nullptr;
  decltype(&cublasLtMatrixLayoutDestroy) layout_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) pref_create = nullptr;
  decltype(&cublasLtMatmulPreferenceDestroy) pref_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) pref_set = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic = nullptr;
  decltype(&cublasLtMatmul) matmul = nullptr;
  std::string path;   // the file it was loaded from
  std::string error;  // why it could not be loaded (empty when it was)
};

// One cuBLASLt per process: the library JAX's CUDA plugin loaded (it links it by this soname, so it is found by the
// soname alone, RTLD_NOLOAD), else the wheel's file found at build time (JQ_CUBLASLT_LIBRARY), else the soname
// through the loader's search path. The major version must be the header's (the ABI this file was compiled for).
CublasLt load_cublaslt() {
  CublasLt lib;
  const std::string soname = "libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR);
  void* handle = dlopen(soname.c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (handle == nullptr && std::string(JQ_CUBLASLT_LIBRARY).size() > 0)
    handle = dlopen(JQ_CUBLASLT_LIBRARY, RTLD_NOW | RTLD_GLOBAL);
  if (handle == nullptr) handle = dlopen(soname.c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (handle == nullptr) {
    lib.error = "cannot load " + soname + " (" + std::string(dlerror()) +
                "); install the nvidia-cublas wheel JAX's CUDA plugin uses, or set gemm.FP8_GEMM_IMPL / "
                "gemm.BF16_GEMM_IMPL to \"xla\"";
    return lib;
  }
  bool missing = false;
  auto sym = [&](auto& fn, const char* name) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(handle, name));
    missing = missing || fn == nullptr;
  };
  sym(lib.create, "cublasLtCreate");
  sym(lib.get_version, "cublasLtGetVersion");
  sym(lib.status_string, "cublasLtGetStatusString");
  sym(lib.desc_create, "cublasLtMatmulDescCreate");
  sym(lib.desc_destroy, "cublasLtMatmulDescDestroy");
  sym(lib.desc_set, "cublasLtMatmulDescSetAttribute");
  sym(lib.layout_create, "cublasLtMatrixLayoutCreate");
  sym(lib.layout_destroy, "cublasLtMatrixLayoutDestroy");
  sym(lib.pref_create, "cublasLtMatmulPreferenceCreate");
  sym(lib.pref_destroy, "cublasLtMatmulPreferenceDestroy");
  sym(lib.pref_set, "cublasLtMatmulPreferenceSetAttribute");
  sym(lib.heuristic, "cublasLtMatmulAlgoGetHeuristic");
  sym(lib.matmul, "cublasLtMatmul");
  Dl_info info;
  if (lib.create != nullptr && dladdr(reinterpret_cast<void*>(lib.create), &info) && info.dli_fname)
    lib.path = info.dli_fname;
  if (missing) {
    lib.error = soname + " at " + lib.path + " lacks a cuBLASLt entry point this handler uses";
  } else if (lib.get_version() / 10000 != CUBLAS_VER_MAJOR) {
    lib.error = lib.path + " is cuBLASLt " + std::to_string(lib.get_version()) + ", built against major " +
                std::to_string(CUBLAS_VER_MAJOR);
  }
  return lib;
}

const CublasLt& cublaslt() {
  static const CublasLt lib = load_cublaslt();
  return lib;
}

// `op`: the op's name, first in every error it returns.
ffi::Error lt_error(const char* op, cublasStatus_t status, const char* what) {
  return ffi::Error(ffi::ErrorCode::kInternal, std::string("jaxquant: ") + op + ": " + what + " failed: " +
                                                   cublaslt().status_string(status));
}

#define JQ_LT_CHECK(op, call, what)                                                  \
  do {                                                                               \
    cublasStatus_t _jq_status = (call);                                              \
    if (_jq_status != CUBLAS_STATUS_SUCCESS) return lt_error(op, _jq_status, what); \
  } while (0)

cudaDataType_t cuda_type(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F8E4M3FN: return CUDA_R_8F_E4M3;
    case ffi::DataType::F8E5M2: return CUDA_R_8F_E5M2;
    case ffi::DataType::BF16: return CUDA_R_16BF;
    default: return CUDA_R_32F;
  }
}

// The objects of one call's description, destroyed with it (a description holds the call's scale pointers, so each
// call builds its own: host work only; the handle and the algorithm are what is cached).
struct Described {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  ~Described() {
    const CublasLt& lt = cublaslt();
    if (d) lt.layout_destroy(d);
    if (b) lt.layout_destroy(b);
    if (a) lt.layout_destroy(a);
    if (desc) lt.desc_destroy(desc);
  }
};

// (device, m, n, k, cuBLASLt's A / B / D types, the op's variant bits): what the heuristic's choice depends on.
using AlgoKey = std::tuple<int, int64_t, int64_t, int64_t, int, int, int, int>;

struct Cache {
  std::mutex mu;
  std::map<int, cublasLtHandle_t> handles;                 // device -> handle
  std::map<AlgoKey, cublasLtMatmulHeuristicResult_t> algos;  // problem on a device -> heuristic's first choice
  std::map<int, void*> zeros;                              // device -> its kZeroBeta (the bf16 GEMM's beta)
};

Cache& cache() {
  static Cache* c = new Cache();   // never destroyed: handles outlive any static destructor order
  return *c;
}

ffi::Error handle_for(const char* op, int device, cublasLtHandle_t* handle) {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  auto it = c.handles.find(device);
  if (it != c.handles.end()) {
    *handle = it->second;
    return ffi::Error::Success();
  }
  JQ_LT_CHECK(op, cublaslt().create(handle), "cublasLtCreate");
  c.handles.emplace(device, *handle);
  return ffi::Error::Success();
}

// The library and this device's handle, or the error that says why there are none.
ffi::Error ready(const char* op, int device, cublasLtHandle_t* handle) {
  const CublasLt& lt = cublaslt();
  if (!lt.error.empty()) return ffi::Error(ffi::ErrorCode::kFailedPrecondition, std::string("jaxquant: ") + op + ": " +
                                                                                     lt.error);
  return handle_for(op, device, handle);
}

// beta = 0 of the scaled bf16 GEMM, whose pointer mode DEVICE reads beta on the device as well as alpha: a constant
// in each device's copy of the module
__device__ const float kZeroBeta = 0.0f;

// This device's kZeroBeta, looked up once per device (cudaGetSymbolAddress on XLA's current device, the call's).
ffi::Error zero_beta(const char* op, int device, void** beta) {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  auto it = c.zeros.find(device);
  if (it != c.zeros.end()) {
    *beta = it->second;
    return ffi::Error::Success();
  }
  if (cudaError_t err = cudaGetSymbolAddress(beta, kZeroBeta); err != cudaSuccess)
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("jaxquant: ") + op + ": beta: " + cudaGetErrorString(err));
  c.zeros.emplace(device, *beta);
  return ffi::Error::Success();
}

// What every GEMM here starts with: this device's handle and a new description of an fp32-accumulated product whose
// cuBLASLt A and B operations are `trans_a` and `trans_b`.
ffi::Error begin(const char* op, int device, cublasOperation_t trans_a, cublasOperation_t trans_b,
                 cublasLtHandle_t* handle, Described* call) {
  JQ_RETURN_IF_ERROR(ready(op, device, handle));
  const CublasLt& lt = cublaslt();
  JQ_LT_CHECK(op, lt.desc_create(&call->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  JQ_LT_CHECK(op, lt.desc_set(call->desc, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof(trans_a)), "TRANSA");
  JQ_LT_CHECK(op, lt.desc_set(call->desc, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof(trans_b)), "TRANSB");
  return ffi::Error::Success();
}

// One described problem run on the stream: the heuristic's first choice for `key` (asked for once per problem and
// device, then cached: host work only on later calls), with the rest of the workspace after the scalars. `shape()`
// names the problem in the error when cuBLASLt has no algorithm for it (built only then, not on every call). XLA's
// own GEMMs are cuBLASLt calls too (__cublas$lt$matmul, the same 32 MiB workspace), on whichever of the heuristic's
// candidates its autotuner timed fastest: a different kernel, whose bytes are the same as long as both accumulate K
// in one pass (no split K), which tests/test_fp8_gemm_gpu.py and tests/test_bf16_gemm_gpu.py check on the shapes the
// training step runs.
template <typename Shape>   // a callable giving the problem's description (a lambda: nothing built or allocated)
ffi::Error run_matmul(const char* op, cudaStream_t stream, cublasLtHandle_t handle, const Described& call,
                      const AlgoKey& key, const void* alpha, const void* beta, const void* lt_a, const void* lt_b,
                      void* d, uint8_t* ws, const Shape& shape) {
  const CublasLt& lt = cublaslt();
  cublasLtMatmulHeuristicResult_t algo;
  {
    Cache& c = cache();
    std::lock_guard<std::mutex> lock(c.mu);
    auto it = c.algos.find(key);
    if (it == c.algos.end()) {
      cublasLtMatmulPreference_t pref = nullptr;
      JQ_LT_CHECK(op, lt.pref_create(&pref), "cublasLtMatmulPreferenceCreate");
      const uint64_t limit = kCublasLtWorkspaceBytes - kScalarBytes;
      cublasStatus_t status = lt.pref_set(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &limit, sizeof(limit));
      int found = 0;
      if (status == CUBLAS_STATUS_SUCCESS)
        status = lt.heuristic(handle, call.desc, call.a, call.b, call.d, call.d, pref, 1, &algo, &found);
      lt.pref_destroy(pref);
      if (status != CUBLAS_STATUS_SUCCESS) return lt_error(op, status, "cublasLtMatmulAlgoGetHeuristic");
      if (found == 0)
        return ffi::Error(ffi::ErrorCode::kUnimplemented, std::string("jaxquant: ") + op +
                                                              ": cuBLASLt has no algorithm for " + shape() +
                                                              " on device " + std::to_string(std::get<0>(key)));
      c.algos.emplace(key, algo);
    } else {
      algo = it->second;
    }
  }
  JQ_LT_CHECK(op, lt.matmul(handle, call.desc, alpha, lt_a, call.a, lt_b, call.b, beta, d, call.d, d, call.d,
                            &algo.algo, ws + kScalarBytes, kCublasLtWorkspaceBytes - kScalarBytes, stream),
              "cublasLtMatmul");
  return ffi::Error::Success();
}

__global__ void factor_product_kernel(const float* a_scale, const float* b_scale, float* alpha_beta) {
  alpha_beta[0] = a_scale[0] * b_scale[0];   // the reference's a_scale * b_scale, one fp32 rounding
  alpha_beta[1] = 0.0f;
}

// XLA runs the handler inside its command buffers by capturing the stream (CUDA graph tracing). Host work that the
// capture's default (thread-local) mode forbids, as a library's first call may do (handle creation, loading kernels),
// is allowed for the call's duration: relaxed mode keeps the capture and only lifts that check.
class RelaxedCapture {
 public:
  RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  ~RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode_); }

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

// Row-major D[M, N] = A[M, K] . B[N, K]^T is, column-major, D^T[N, M] = op(B)=T [N, K] x op(A)=N [K, M]: cuBLASLt's
// A is our b and its B our a, with m = N, n = M, k = K (the TN layout cuBLASLt's FP8 GEMM requires).
ffi::Error Fp8GemmCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer a, ffi::AnyBuffer b,
                       ffi::Buffer<ffi::F32> a_scale, ffi::Buffer<ffi::F32> b_scale, bool fast_accum,
                       bool factor_product, ffi::Result<ffi::AnyBuffer> out,
                       ffi::Result<ffi::Buffer<ffi::U8>> workspace) {
  constexpr const char* op = "fp8_gemm";
  int64_t m, n, k;
  JQ_RETURN_IF_ERROR(check_fp8_gemm(a, b, a_scale, b_scale, *out, &m, &n, &k));
  JQ_RETURN_IF_ERROR(check_count(*workspace, kCublasLtWorkspaceBytes, "workspace"));
  RelaxedCapture relaxed;
  cublasLtHandle_t handle;
  Described call;
  JQ_RETURN_IF_ERROR(begin(op, device, CUBLAS_OP_T, CUBLAS_OP_N, &handle, &call));
  const CublasLt& lt = cublaslt();

  const cudaDataType_t a_type = cuda_type(a.element_type()), b_type = cuda_type(b.element_type());
  const cudaDataType_t out_type = cuda_type(out->element_type());
  const int8_t fast = fast_accum ? 1 : 0;
  JQ_LT_CHECK(op, lt.desc_set(call.desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)), "FAST_ACCUM");
  uint8_t* ws = workspace->typed_data();
  float* alpha_beta = reinterpret_cast<float*>(ws);
  const float one = 1.0f, zero = 0.0f;
  const void* alpha = &one;
  const void* beta = &zero;
  if (factor_product) {   // alpha = a_scale * b_scale on the device, as the reference multiplies them
    factor_product_kernel<<<1, 1, 0, stream>>>(a_scale.typed_data(), b_scale.typed_data(), alpha_beta);
    if (cudaError_t err = cudaGetLastError(); err != cudaSuccess)
      return ffi::Error(ffi::ErrorCode::kInternal,
                        std::string("jaxquant: fp8_gemm: factor kernel: ") + cudaGetErrorString(err));
    const cublasLtPointerMode_t on_device = CUBLASLT_POINTER_MODE_DEVICE;
    JQ_LT_CHECK(op, lt.desc_set(call.desc, CUBLASLT_MATMUL_DESC_POINTER_MODE, &on_device, sizeof(on_device)),
                "POINTER_MODE");
    alpha = alpha_beta;
    beta = alpha_beta + 1;
  } else {   // cuBLASLt's A is our b, its B our a
    const float* lt_a_scale = b_scale.typed_data();
    const float* lt_b_scale = a_scale.typed_data();
    JQ_LT_CHECK(op, lt.desc_set(call.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &lt_a_scale, sizeof(lt_a_scale)),
                "A_SCALE_POINTER");
    JQ_LT_CHECK(op, lt.desc_set(call.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &lt_b_scale, sizeof(lt_b_scale)),
                "B_SCALE_POINTER");
  }
  JQ_LT_CHECK(op, lt.layout_create(&call.a, b_type, k, n, k), "layout of b");
  JQ_LT_CHECK(op, lt.layout_create(&call.b, a_type, k, m, k), "layout of a");
  JQ_LT_CHECK(op, lt.layout_create(&call.d, out_type, n, m, n), "layout of the result");

  const AlgoKey key{device, m, n, k, int(b_type), int(a_type), int(out_type),
                    (fast_accum ? 1 : 0) | (factor_product ? 2 : 0)};
  const auto shape = [=] {
    return "[" + std::to_string(m) + ", " + std::to_string(k) + "] x [" + std::to_string(n) + ", " +
           std::to_string(k) + "]^T with these dtypes";
  };
  return run_matmul(op, stream, handle, call, key, alpha, beta, b.untyped_data(), a.untyped_data(),
                    out->untyped_data(), ws, shape);
}

// The scaled bf16 GEMM: D = round_to_bf16(fp32_dot(a, b) * factor) (docs/numerics.md §2.8: the global decode factor
// multiplies the fp32 accumulator, once; the product is rounded once). The factor is cuBLASLt's alpha, read on the
// device (pointer mode DEVICE, so no host sync: it comes from the step's amax), beta the module's zero (kZeroBeta).
// cuBLASLt's epilogue computes alpha * acc in fp32 and rounds it to bf16 (RNE): XLA's multiply and convert.
// TN (b [N, K]): as the FP8 GEMM, cuBLASLt's A = b transposed (k x n, ld k). NN (b_kn, b [K, N] row-major, i.e.
// column-major [N, K] with ld N): cuBLASLt's A = b as is (n x k, ld n). Its B = a (k x m, ld k), D = [n, m] ld n.
// These are the operations XLA's own GEMM asks cuBLAS for the same dot with a row-major result.
ffi::Error Bf16GemmCuda(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::BF16> a, ffi::Buffer<ffi::BF16> b,
                        ffi::Buffer<ffi::F32> factor, bool b_kn, ffi::Result<ffi::Buffer<ffi::BF16>> out,
                        ffi::Result<ffi::Buffer<ffi::U8>> workspace) {
  constexpr const char* op = "bf16_gemm";
  int64_t m, n, k;
  JQ_RETURN_IF_ERROR(check_bf16_gemm(a, b, b_kn, factor, *out, &m, &n, &k));
  JQ_RETURN_IF_ERROR(check_count(*workspace, kCublasLtWorkspaceBytes, "workspace"));
  RelaxedCapture relaxed;
  cublasLtHandle_t handle;
  Described call;
  JQ_RETURN_IF_ERROR(begin(op, device, b_kn ? CUBLAS_OP_N : CUBLAS_OP_T, CUBLAS_OP_N, &handle, &call));
  const CublasLt& lt = cublaslt();

  const cublasLtPointerMode_t on_device = CUBLASLT_POINTER_MODE_DEVICE;
  JQ_LT_CHECK(op, lt.desc_set(call.desc, CUBLASLT_MATMUL_DESC_POINTER_MODE, &on_device, sizeof(on_device)),
              "POINTER_MODE");
  if (b_kn) {
    JQ_LT_CHECK(op, lt.layout_create(&call.a, CUDA_R_16BF, n, k, n), "layout of b");
  } else {
    JQ_LT_CHECK(op, lt.layout_create(&call.a, CUDA_R_16BF, k, n, k), "layout of b");
  }
  JQ_LT_CHECK(op, lt.layout_create(&call.b, CUDA_R_16BF, k, m, k), "layout of a");
  JQ_LT_CHECK(op, lt.layout_create(&call.d, CUDA_R_16BF, n, m, n), "layout of the result");

  uint8_t* ws = workspace->typed_data();
  void* beta = nullptr;   // the device's zero: no memset node in every call (and in every command buffer)
  JQ_RETURN_IF_ERROR(zero_beta(op, device, &beta));
  const AlgoKey key{device, m, n, k, CUDA_R_16BF, CUDA_R_16BF, CUDA_R_16BF, b_kn ? 4 : 0};
  const auto shape = [=] {
    return "[" + std::to_string(m) + ", " + std::to_string(k) + "] x " +
           (b_kn ? "[" + std::to_string(k) + ", " + std::to_string(n) + "]"
                 : "[" + std::to_string(n) + ", " + std::to_string(k) + "]^T") + " in bf16";
  };
  return run_matmul(op, stream, handle, call, key, factor.typed_data(), beta, b.untyped_data(), a.untyped_data(),
                    out->untyped_data(), ws, shape);
}

}  // namespace

std::string cublaslt_library() {
  const CublasLt& lib = cublaslt();
  return lib.error.empty() ? lib.path : "";
}

JQ_DEFINE_CUBLASLT_HANDLERS(Cuda, JQ_CUDA_CTX)

}  // namespace jaxquant

#endif  // JQ_HAVE_CUBLASLT
