// Blockwise symmetric int8/int4 quantization (ZeRO++ qwZ/qgZ), the format of
// [Note: quantized blocks] in ringcomm/kernels/quant.py.
#pragma once

#include <cstdint>

#include "common.h"

namespace ringcomm {

struct QuantFormat {
  int bits;       // 8 or 4
  int64_t block;  // elements per scale; even for 4 bits
};

// Bytes of quantized data for numel elements, and the number of scales.
inline int64_t packed_nbytes(int64_t numel, int bits) { return bits == 4 ? (numel + 1) / 2 : numel; }
inline int64_t num_blocks(int64_t numel, int64_t block) { return (numel + block - 1) / block; }

// x: numel elements of dtype (float32, bfloat16, float16); data: packed_nbytes
// bytes; scales: num_blocks float32. Blocks are split over up to num_threads threads.
void quantize(const void* x, DType dtype, int64_t numel, uint8_t* data, float* scales, QuantFormat format,
              int num_threads);

// out = sum over rows j = 0..num_rows-1, in order, of dequant(row j), in
// float32, rounded once to dtype. Row j of data starts at data + j *
// packed_nbytes(numel), of scales at scales + j * num_blocks(numel).
void dequantize_sum(const uint8_t* data, const float* scales, int num_rows, void* out, DType dtype, int64_t numel,
                    QuantFormat format, int num_threads);

}  // namespace ringcomm
