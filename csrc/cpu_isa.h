// Which x86 vector instruction sets the CPU passes may use, decided at run time on the CPU that runs
// the process, never on the build machine: every vector version is compiled with a target
// attribute (no -march flag anywhere in CMakeLists.txt), so one build carries the AVX-512 code and
// the portable code side by side, and these checks pick one per call.
//
// BERT_FAST_CPU_ISA caps what is used: "scalar" (portable code only), "avx2", "avx512" or
// "avx512_bf16" (unset or empty: whatever the CPU has). With it, a machine with AVX-512 runs what
// an AVX2-only machine runs (tests/cpu/test_cpu_isa.py), and a user can rule a vector path out.
#pragma once

#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace bert_fast {

// Ordered: each level includes the ones below it.
enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

inline const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx512Bf16:
      return "avx512_bf16";
    default:
      return "scalar";
  }
}

inline Isa parse_isa(const std::string& name, const char* what) {
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16})
    if (name == isa_name(isa)) return isa;
  throw std::invalid_argument(std::string(what) + "=" + name +
                              ": expected one of scalar, avx2, avx512, avx512_bf16");
}

// The widest level this CPU runs. avx512 means F + BW + VL + DQ (what every AVX-512 pass here is
// compiled for); avx2 means AVX2 + FMA.
inline Isa cpu_isa() {
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return __builtin_cpu_supports("avx512bf16") ? Isa::kAvx512Bf16 : Isa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
#endif
  return Isa::kScalar;
}

// BERT_FAST_CPU_ISA, read at every call (a getenv per pass costs nothing next to the pass, and a
// test or a user can change it in a running process).
inline Isa isa_cap() {
  const char* env = std::getenv("BERT_FAST_CPU_ISA");
  if (env == nullptr || *env == '\0') return Isa::kAvx512Bf16;
  return parse_isa(env, "BERT_FAST_CPU_ISA");
}

inline Isa usable_isa() { return std::min(cpu_isa(), isa_cap()); }

inline bool isa_usable(Isa isa) { return static_cast<int>(usable_isa()) >= static_cast<int>(isa); }

// Why `isa` cannot run here, for the error of an explicit request.
inline std::string isa_refusal(const std::string& requested) {
  std::string why = "this CPU cannot run isa=" + requested + " (CPU: " + isa_name(cpu_isa());
  const char* env = std::getenv("BERT_FAST_CPU_ISA");
  if (env != nullptr && *env != '\0') why += ", capped by BERT_FAST_CPU_ISA=" + std::string(env);
  return why + ")";
}

}  // namespace bert_fast
