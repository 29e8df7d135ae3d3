// pybind11 bindings of bert_fast._C. The module takes raw device/host pointers, sizes, strides and
// a CUDA stream handle from Python (bert_fast/ops validates everything before calling in), so it
// links no libtorch and one build serves any torch version.
#include <pybind11/pybind11.h>

#include "cpu_isa.h"
#include "embedding.h"

namespace py = pybind11;

namespace bert_fast {
void bind_keep_mask(py::module_& m);  // keep_mask_cpu.cpp
void bind_int8(py::module_& m);       // int8_cpu.cpp
void bind_int8_gemm_avx2(py::module_& m);  // int8_gemm_avx2.cpp
void bind_int8_gemm_vnni(py::module_& m);  // int8_gemm_vnni.cpp
void bind_cpu_linear(py::module_& m);  // cpu_linear.cpp
void bind_attention(py::module_& m);  // attention_cpu.cpp
void bind_attention_f32(py::module_& m);  // attention_f32_cpu.cpp
}  // namespace bert_fast

#ifndef BERT_FAST_CUDA_ARCHS
#define BERT_FAST_CUDA_ARCHS ""
#endif
#ifndef BERT_FAST_CUDA_VERSION
#define BERT_FAST_CUDA_VERSION ""
#endif

static py::dict build_info() {
  py::dict info;
#ifdef BERT_FAST_WITH_CUDA
  info["cuda_compiled"] = true;
#else
  info["cuda_compiled"] = false;
#endif
  info["cuda_archs"] = std::string(BERT_FAST_CUDA_ARCHS);
  info["cuda_compiler_version"] = std::string(BERT_FAST_CUDA_VERSION);
  return info;
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "bert_fast native kernels (CUDA embedding + LayerNorm and its CPU twin; the CPU dropout keep-mask; the int8 GEMM's quantize/dequantize passes; bf16 and fp32 attention on the CPU)";
  m.def("build_info", &build_info, "How this module was compiled");
  m.def(
      "cpu_isa",
      []() {
        py::dict d;
        d["cpu"] = std::string(bert_fast::isa_name(bert_fast::cpu_isa()));
        d["usable"] = std::string(bert_fast::isa_name(bert_fast::usable_isa()));
        return d;
      },
      "The widest vector ISA of this CPU, and the one the CPU passes may use (capped by BERT_FAST_CPU_ISA)");
  bert_fast::bind_embedding(m);
  bert_fast::bind_keep_mask(m);
  bert_fast::bind_int8(m);
  bert_fast::bind_int8_gemm_avx2(m);
  bert_fast::bind_int8_gemm_vnni(m);
  bert_fast::bind_cpu_linear(m);
  bert_fast::bind_attention(m);
  bert_fast::bind_attention_f32(m);
}
