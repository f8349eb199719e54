// Python module exposing the FFI handlers as PyCapsules. Compiled once per platform with
// JQ_MODULE (module name) and JQ_SUFFIX (handler suffix: Cpu or Cuda) defined by build.py.
#include <pybind11/pybind11.h>

#include "jaxquant/gathered_space.h"
#include "jaxquant/group_table.h"
#include "jaxquant/handlers.h"

#define JQ_CAT2(a, b) a##b
#define JQ_CAT(a, b) JQ_CAT2(a, b)
#define JQ_STR2(a) #a
#define JQ_STR(a) JQ_STR2(a)

namespace jaxquant {
#define JQ_DECLARE(name, stem) XLA_FFI_DECLARE_HANDLER_SYMBOL(JQ_CAT(stem, JQ_SUFFIX));
JQ_FOR_EACH_TARGET(JQ_DECLARE)
#if JQ_HAVE_CUBLASLT
JQ_FOR_EACH_CUBLASLT_TARGET(JQ_DECLARE)
std::string cublaslt_library();  // cuda_gemm.cu: the file the GEMMs' cuBLASLt was loaded from
#endif
#undef JQ_DECLARE
}  // namespace jaxquant

namespace py = pybind11;

PYBIND11_MODULE(JQ_MODULE, m) {
  m.doc() = "jaxquant XLA FFI handlers (" JQ_STR(JQ_SUFFIX) ")";
  m.def("registrations", []() {
    py::dict d;
#define JQ_ENTRY(name, stem) d[name] = py::capsule(reinterpret_cast<void*>(&jaxquant::JQ_CAT(stem, JQ_SUFFIX)));
    JQ_FOR_EACH_TARGET(JQ_ENTRY)
#if JQ_HAVE_CUBLASLT
    JQ_FOR_EACH_CUBLASLT_TARGET(JQ_ENTRY)
#endif
#undef JQ_ENTRY
    return d;
  });
  m.def("group_table_fields", []() {  // the group table's column names, in order
    py::tuple t(static_cast<size_t>(jaxquant::GroupTable::kFields));
    int i = 0;
#define JQ_FIELD_NAME(e, name) t[i++] = py::str(name);
    JQ_GROUP_TABLE_FIELDS(JQ_FIELD_NAME)
#undef JQ_FIELD_NAME
    return t;
  });
  m.def("gathered_space_limits", []() {  // (gather pieces, shards) a GatheredSpace holds at most
    return py::make_tuple(jaxquant::kMaxGatherPieces, jaxquant::kMaxGatherShards);
  });
  m.def("jaxlib_version", []() { return std::string(JQ_JAXLIB_VERSION); });
  // The file of the cuBLASLt the GEMMs use (loading it if no GEMM has yet); "" where it cannot be loaded or the
  // module is built without it.
  m.def("cublaslt_library", []() {
#if JQ_HAVE_CUBLASLT
    return jaxquant::cublaslt_library();
#else
    return std::string();
#endif
  });
  m.def("cuda_archs", []() { return std::string(JQ_CUDA_ARCHS); });
}
