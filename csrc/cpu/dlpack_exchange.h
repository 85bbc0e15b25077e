// The part of DLPack's C ABI (dlpack.h, version 1.3 and later) that the lean
// calls use: a tensor library's `__dlpack_c_exchange_api__`, a capsule named
// "dlpack_exchange_api" on its tensor type, whose dltensor_from_py_object_no_sync
// fills a DLTensor on the caller's stack from a Python tensor: no allocation, no
// reference taken, one call in place of seven attribute reads. torch releases of
// 2026 have it (2.13 does). ringcomm builds without torch or DLPack's headers, so
// the layouts the ABI fixes are declared here; only their major version 1 is read.
#pragma once

#include <cstdint>

namespace ringcomm::dlpack {

constexpr uint32_t kMajorVersion = 1;
constexpr const char* kExchangeCapsule = "dlpack_exchange_api";

// DLDeviceType and DLDataTypeCode: the values ringcomm reads.
constexpr int32_t kCpu = 1;
enum TypeCode : uint8_t { kInt = 0, kFloat = 2, kBfloat = 4 };

struct Version {
  uint32_t major, minor;
};

struct Device {
  int32_t device_type;  // DLDeviceType
  int32_t device_id;
};

struct DataType {
  uint8_t code;  // TypeCode
  uint8_t bits;
  uint16_t lanes;
};

struct Tensor {
  void* data;
  Device device;
  int32_t ndim;
  DataType dtype;
  int64_t* shape;
  int64_t* strides;  // null: compact, row-major
  uint64_t byte_offset;
};

struct ExchangeApiHeader {
  Version version;
  ExchangeApiHeader* prev_api;
};

// 0, or -1 with a Python error set. The DLTensor views the tensor's own fields:
// valid while the tensor lives and is not changed.
using TensorFromPyObject = int (*)(void* py_object, Tensor* out);

struct ExchangeApi {
  ExchangeApiHeader header;
  void* managed_tensor_allocator;
  void* managed_tensor_from_py_object_no_sync;
  void* managed_tensor_to_py_object_no_sync;
  TensorFromPyObject dltensor_from_py_object_no_sync;  // may be null
  void* current_work_stream;
};

}  // namespace ringcomm::dlpack
