// This capability's entry in the table of kernels (cpu_capability.h).
#include "cpu_capability.h"
#include "kernels/kernels.h"

namespace ringcomm {
namespace RINGCOMM_CPU_CAPABILITY {

extern const CpuKernels kKernels;
const CpuKernels kKernels{&reduce_n, &copy_bytes, &quantize, &dequantize_sum, &adam_step, &word_sum_bytes};

}  // namespace RINGCOMM_CPU_CAPABILITY
}  // namespace ringcomm
