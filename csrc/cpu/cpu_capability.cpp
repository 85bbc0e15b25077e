// Choosing the build of the kernels ([Note: CPU capabilities] in cpu_capability.h).
#include "cpu_capability.h"

#include <cstdlib>
#include <cstring>
#include <stdexcept>

namespace ringcomm {

namespace cpu_default { extern const CpuKernels kKernels; }
#if defined(RINGCOMM_WITH_AVX2)
namespace cpu_avx2 { extern const CpuKernels kKernels; }
#endif
#if defined(RINGCOMM_WITH_AVX512)
namespace cpu_avx512 { extern const CpuKernels kKernels; }
#endif
#if defined(RINGCOMM_WITH_AVX512_BF16)
namespace cpu_avx512_bf16 { extern const CpuKernels kKernels; }
#endif

namespace {

constexpr CpuCapability kAll[] = {CpuCapability::kDefault, CpuCapability::kAvx2, CpuCapability::kAvx512,
                                  CpuCapability::kAvx512Bf16};

// The build's table for a capability, or nullptr where it was not built.
const CpuKernels* table_of(CpuCapability capability) {
  switch (capability) {
    case CpuCapability::kDefault: return &cpu_default::kKernels;
#if defined(RINGCOMM_WITH_AVX2)
    case CpuCapability::kAvx2: return &cpu_avx2::kKernels;
#endif
#if defined(RINGCOMM_WITH_AVX512)
    case CpuCapability::kAvx512: return &cpu_avx512::kKernels;
#endif
#if defined(RINGCOMM_WITH_AVX512_BF16)
    case CpuCapability::kAvx512Bf16: return &cpu_avx512_bf16::kKernels;
#endif
    default: return nullptr;
  }
}

// Whether the CPU (and the OS, which must save the wider registers: the
// compiler's cpuid check includes XGETBV) runs the capability's instructions.
bool cpu_has(CpuCapability capability) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  switch (capability) {
    case CpuCapability::kDefault: return true;
    case CpuCapability::kAvx2: return __builtin_cpu_supports("x86-64-v3");
    case CpuCapability::kAvx512: return __builtin_cpu_supports("x86-64-v4");
    case CpuCapability::kAvx512Bf16: return __builtin_cpu_supports("x86-64-v4") && __builtin_cpu_supports("avx512bf16");
  }
  return false;
#else
  return capability == CpuCapability::kDefault;
#endif
}

CpuCapability choose() {
  CpuCapability best = CpuCapability::kDefault;
  for (CpuCapability capability : supported_capabilities()) best = capability;
  const char* requested = std::getenv("RINGCOMM_CPU_CAPABILITY");
  if (requested == nullptr || *requested == '\0') return best;
  for (CpuCapability capability : kAll) {
    if (std::strcmp(requested, capability_name(capability)) == 0) {
      return static_cast<int>(capability) < static_cast<int>(best) ? capability : best;
    }
  }
  throw std::invalid_argument(std::string("RINGCOMM_CPU_CAPABILITY=") + requested +
                              ": expected one of default, avx2, avx512, avx512_bf16");
}

}  // namespace

const char* capability_name(CpuCapability capability) {
  switch (capability) {
    case CpuCapability::kDefault: return "default";
    case CpuCapability::kAvx2: return "avx2";
    case CpuCapability::kAvx512: return "avx512";
    case CpuCapability::kAvx512Bf16: return "avx512_bf16";
  }
  return "unknown";
}

std::vector<CpuCapability> built_capabilities() {
  std::vector<CpuCapability> built;
  for (CpuCapability capability : kAll) {
    if (table_of(capability) != nullptr) built.push_back(capability);
  }
  return built;
}

std::vector<CpuCapability> supported_capabilities() {
  std::vector<CpuCapability> supported;
  for (CpuCapability capability : built_capabilities()) {
    if (cpu_has(capability)) supported.push_back(capability);
  }
  return supported;
}

CpuCapability active_capability() {
  static const CpuCapability active = choose();
  return active;
}

const CpuKernels& cpu_kernels() {
  static const CpuKernels& kernels = *table_of(active_capability());
  return kernels;
}

}  // namespace ringcomm
