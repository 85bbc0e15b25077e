// The hot entry points of ringcomm._C: collectives on torch tensors straight
// from Python, for the lean path of ringcomm.comm.collectives ([Note: lean path]).
//
// [Note: lean calls] These are METH_FASTCALL functions, not pybind11 ones:
// pybind11's dispatch and argument casting cost more than a whole 8-byte
// all-reduce between two cores. They take the comm as a capsule
// (ShmComm._handle, made once per transport; it holds a reference to the comm,
// see [Note: close and abort] in shm_lifecycle.cpp) and map C++ errors as
// pybind11 does (CallMismatch -> ringcomm._C.CallMismatch, a ValueError;
// invalid_argument -> ValueError; others -> RuntimeError).
//
// *_lean take raw pointers and sizes: the transport's calls, on tensors that
// ringcomm.comm.collectives has checked; *_keyed too, with a caller's key
// (CallKey in shm.h) that the ranks compare with the rest of the call.
// *_tensor(s) take the tensors themselves and check them here, without the
// interpreter between them (no torch headers at build time): through DLPack's
// exchange function where torch has one ([Note: one read by DLPack]), else
// through torch's own Python attributes. A tensor takes this path when it is a
// torch.Tensor itself (no subclass), strided, not nested, on the CPU,
// contiguous, of a ringcomm dtype, and a pair when its sizes match and the two
// do not overlap other than in the exact in-place form (ringcomm.comm.aliasing's
// rule). Otherwise the call returns False having done nothing, and the caller
// takes its checked path, which raises the errors; True means the collective ran.
#include "module_lean.h"

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "dlpack_exchange.h"
#include "shm.h"

namespace ringcomm {
namespace {

// [Note: torch's attributes, read by descriptor] Where torch has no DLPack
// exchange function, the checks read seven of torch.Tensor's attributes per
// tensor (~70 ns each), the biggest part of a lean call's cost. Each is read
// through its descriptor, found once on torch.Tensor at setup:
// attribute lookup on a tensor walks its type's MRO and its instance dict
// before it reaches the same descriptor, and that walk cost ~25% of a read.
// The tensors read are exactly torch.Tensor (read_tensor checks the type), so
// the descriptors are the ones a plain read would find, unless a caller set one
// on the instance itself (t.data_ptr = ...): the lean path ignores that.
struct Attribute {
  PyObject* descriptor = nullptr;  // torch.Tensor.<name>: a getset or a method descriptor
  descrgetfunc get = nullptr;      // a getset's __get__; null for a method (called instead)

  // The attribute's value on `tensor` (a new reference), or null with an error set.
  PyObject* read(PyObject* tensor, PyTypeObject* type) const {
    if (get != nullptr) return get(descriptor, tensor, reinterpret_cast<PyObject*>(type));
    PyObject* args[] = {tensor};
    return PyObject_Vectorcall(descriptor, args, 1, nullptr);
  }
};

// What the checks compare with, from lean_setup (ringcomm.comm.collectives at import).
struct TorchApi {
  PyTypeObject* tensor_type = nullptr;
  PyObject* strided = nullptr;
  std::vector<std::pair<PyObject*, int>> dtype_codes;  // torch dtype -> ringcomm code
  Attribute layout, dtype, is_cpu, is_nested, nbytes;  // properties
  Attribute is_contiguous, data_ptr;                   // methods, called with no arguments
  PyObject* profiler_globals = nullptr;  // the dict of the module whose global says torch's profiler
  PyObject* profiler_flag = nullptr;     // records, and that global's name (ringcomm/core/compat.py names both)
  // torch.Tensor's DLPack exchange function, when torch has one (see [Note: one read by DLPack]).
  dlpack::TensorFromPyObject from_dlpack = nullptr;
};
TorchApi api;
PyObject* call_mismatch = nullptr;  // ringcomm._C.CallMismatch, made once by add_lean_functions

// An owned reference, released at scope exit.
class Ref {
 public:
  explicit Ref(PyObject* object) : object_(object) {}
  ~Ref() { Py_XDECREF(object_); }
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  PyObject* get() const { return object_; }

 private:
  PyObject* object_;
};

// Whether torch's profiler records: the lean calls then step aside, so that the
// checked path records the call's event ([Note: profiler events] in profiling.py).
// One dict lookup (a borrowed reference), in place of the Python check it replaces.
bool profiler_records() {
  if (api.profiler_globals == nullptr) return false;
  PyObject* flag = PyDict_GetItemWithError(api.profiler_globals, api.profiler_flag);
  if (flag == nullptr) {
    PyErr_Clear();
    return false;
  }
  return flag == Py_True || (flag != Py_False && PyObject_IsTrue(flag) == 1);
}

struct LeanTensor {
  int dtype;
  uintptr_t ptr;
  int64_t nbytes;
};

// [Note: one read by DLPack] Recent torch (2.13 here) gives the whole description
// of a tensor in one C call, DLPack's dltensor_from_py_object_no_sync
// (dlpack_exchange.h): its data pointer, device, dtype, shape and strides, read
// from the tensor itself: ~0.55 us less per tensor than reading its attributes
// on the development machine (8-byte calls at 2 ranks: all_reduce 2.4 -> 1.85
// us, reduce_scatter and all_gather 2.9 -> 1.85 us). It fails (a Python
// error, which no_lean clears) for a tensor without strides or storage:
// sparse, mkldnn and nested ones. A tensor it describes is strided and dense;
// the rest is checked here: on the CPU, a ringcomm dtype, and contiguous by
// torch's rule (every dimension of size other than 1 has the stride of a
// row-major layout; an empty tensor is contiguous).

// The ringcomm dtype code of a DLPack dtype, or -1.
int dtype_code(const dlpack::DataType& dtype) {
  const auto code = [](DType known) { return static_cast<int>(known); };
  if (dtype.lanes != 1) return -1;
  switch (dtype.code) {
    case dlpack::kFloat:
      return dtype.bits == 32   ? code(DType::kFloat32)
             : dtype.bits == 64 ? code(DType::kFloat64)
             : dtype.bits == 16 ? code(DType::kFloat16)
                                : -1;
    case dlpack::kBfloat:
      return dtype.bits == 16 ? code(DType::kBFloat16) : -1;
    case dlpack::kInt:
      return dtype.bits == 32 ? code(DType::kInt32) : dtype.bits == 64 ? code(DType::kInt64) : -1;
    default:
      return -1;
  }
}

bool read_by_dlpack(PyObject* object, LeanTensor* tensor) {
  dlpack::Tensor dl;
  if (api.from_dlpack(object, &dl) != 0) return false;
  if (dl.device.device_type != dlpack::kCpu) return false;
  tensor->dtype = dtype_code(dl.dtype);
  if (tensor->dtype < 0) return false;
  int64_t numel = 1;
  bool contiguous = true;
  for (int32_t d = dl.ndim - 1; d >= 0; --d) {
    if (dl.strides != nullptr && dl.shape[d] != 1 && dl.strides[d] != numel) contiguous = false;
    numel *= dl.shape[d];
  }
  if (!contiguous && numel != 0) return false;
  tensor->ptr = reinterpret_cast<uintptr_t>(dl.data) + dl.byte_offset;
  tensor->nbytes = numel * element_nbytes(to_dtype(tensor->dtype));
  return true;
}

// Whether `object` may take the lean path; fills `tensor` when it may. An
// error from torch leaves a Python error set (see no_lean).
bool read_tensor(PyObject* object, LeanTensor* tensor) {
  PyTypeObject* type = api.tensor_type;
  if (type == nullptr || Py_TYPE(object) != type) return false;
  if (api.from_dlpack != nullptr) return read_by_dlpack(object, tensor);
  const Ref layout(api.layout.read(object, type));
  if (layout.get() != api.strided) return false;
  const Ref dtype(api.dtype.read(object, type));
  tensor->dtype = -1;
  for (const auto& [known, code] : api.dtype_codes)
    if (dtype.get() == known) tensor->dtype = code;
  if (tensor->dtype < 0) return false;
  const Ref is_cpu(api.is_cpu.read(object, type));
  if (is_cpu.get() != Py_True) return false;
  const Ref is_nested(api.is_nested.read(object, type));  // strided, yet no flat buffer
  if (is_nested.get() != Py_False) return false;
  const Ref contiguous(api.is_contiguous.read(object, type));
  if (contiguous.get() != Py_True) return false;
  const Ref ptr(api.data_ptr.read(object, type));
  const Ref nbytes(api.nbytes.read(object, type));
  if (ptr.get() == nullptr || nbytes.get() == nullptr) return false;
  tensor->ptr = static_cast<uintptr_t>(PyLong_AsUnsignedLongLong(ptr.get()));
  tensor->nbytes = PyLong_AsLongLong(nbytes.get());
  return !PyErr_Occurred();
}

// The answer when the checks refused: False for the checked path, which reports
// what a torch attribute raised (an Exception); anything else (KeyboardInterrupt)
// propagates.
PyObject* no_lean() {
  if (PyErr_Occurred()) {
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return nullptr;
    PyErr_Clear();
  }
  Py_RETURN_FALSE;
}

// The (big, small) pair of reduce_scatter (input, output) or all_gather
// (output, input): one dtype, big = world_size * small, and no overlap unless
// small is chunk `rank` of big.
bool pair_takes(const ShmComm& comm, const LeanTensor& big, const LeanTensor& small) {
  if (big.dtype != small.dtype || big.nbytes != comm.world_size() * small.nbytes) return false;
  const bool overlap = small.ptr < big.ptr + big.nbytes && big.ptr < small.ptr + small.nbytes;
  return !overlap || small.ptr == big.ptr + comm.rank() * small.nbytes;
}

bool check_nargs(const char* name, Py_ssize_t nargs, Py_ssize_t expected) {
  if (nargs == expected) return true;
  PyErr_Format(PyExc_TypeError, "%s: expected %zd arguments, got %zd", name, expected, nargs);
  return false;
}

// The caller's reference to the capsule keeps the comm alive for the call.
ShmComm* comm_of(PyObject* capsule) {
  auto* comm = static_cast<std::shared_ptr<ShmComm>*>(PyCapsule_GetPointer(capsule, kCommCapsule));
  return comm == nullptr ? nullptr : comm->get();
}

// Runs `call()` with the GIL released; maps its C++ error to a Python one.
// Returns whether it succeeded (else a Python error is set).
template <typename Call>
bool run_released(Call call) {
  PyObject* error_type = nullptr;
  std::string message;
  Py_BEGIN_ALLOW_THREADS
  try {
    call();
  } catch (const CallMismatch& err) {
    error_type = call_mismatch;
    message = err.what();
  } catch (const std::invalid_argument& err) {
    error_type = PyExc_ValueError;
    message = err.what();
  } catch (const std::exception& err) {
    error_type = PyExc_RuntimeError;
    message = err.what();
  }
  Py_END_ALLOW_THREADS
  if (error_type == nullptr) return true;
  PyErr_SetString(error_type, message.c_str());
  return false;
}

// Admits a lean call (OpScope) before it is recorded as started, so that a call
// the flight recorder shows started is one that close() waits for; false, with
// a Python error set, when the comm refuses it (closed, aborted, another thread's).
bool admit(ShmComm& comm, const char* op, std::optional<OpScope>& scope) {
  try {
    comm.admit(scope, op);
    return true;
  } catch (const std::exception& err) {
    PyErr_SetString(PyExc_RuntimeError, err.what());
    return false;
  }
}

// Reads args[first .. first + count) as ints into `ints`.
bool read_ints(PyObject* const* args, int first, int count, int64_t* ints) {
  for (int i = 0; i < count; ++i) {
    ints[i] = PyLong_AsLongLong(args[first + i]);
    if (ints[i] == -1 && PyErr_Occurred()) return false;
  }
  return true;
}

// Reads a caller's key: a list or tuple of kCallKeyLen ints, or an empty one for none.
bool read_key(PyObject* object, CallKey* key) {
  const Ref sequence(PySequence_Fast(object, "key must be a list or tuple of ints"));
  if (sequence.get() == nullptr) return false;
  const Py_ssize_t size = PySequence_Fast_GET_SIZE(sequence.get());
  *key = CallKey{};
  if (size == 0) return true;
  if (size != kCallKeyLen) {
    PyErr_Format(PyExc_ValueError, "key has %zd values, expected %d (CallKey.values())", size, kCallKeyLen);
    return false;
  }
  PyObject** items = PySequence_Fast_ITEMS(sequence.get());
  for (int i = 0; i < kCallKeyLen; ++i) {
    key->values[i] = PyLong_AsLongLong(items[i]);
    if (key->values[i] == -1 && PyErr_Occurred()) return false;
  }
  return true;
}

// Reads the args of a pointer call, (capsule, int x num_ints, [key,] timeout_s):
// with a key when `key` is not null.
bool read_call(const char* name, PyObject* const* args, Py_ssize_t nargs, int num_ints, ShmComm** comm,
               int64_t* ints, CallKey* key, double* timeout_s) {
  const int key_args = key != nullptr ? 1 : 0;
  if (!check_nargs(name, nargs, num_ints + 2 + key_args)) return false;
  *comm = comm_of(args[0]);
  if (*comm == nullptr || !read_ints(args, 1, num_ints, ints)) return false;
  if (key != nullptr && !read_key(args[num_ints + 1], key)) return false;
  *timeout_s = PyFloat_AsDouble(args[num_ints + 1 + key_args]);
  return !(*timeout_s == -1.0 && PyErr_Occurred());
}

// Calls `call(comm, ints, timeout_s)` for args (capsule, int x num_ints, timeout_s).
template <int num_ints, typename Call>
PyObject* pointer_call(const char* name, PyObject* const* args, Py_ssize_t nargs, Call call) {
  ShmComm* comm;
  int64_t ints[num_ints];
  double timeout_s;
  if (!read_call(name, args, nargs, num_ints, &comm, ints, nullptr, &timeout_s)) return nullptr;
  if (!run_released([&] { call(*comm, ints, timeout_s); })) return nullptr;
  Py_RETURN_NONE;
}

// Calls `call(comm, ints, key, timeout_s)` for args (capsule, int x num_ints, key, timeout_s).
template <int num_ints, typename Call>
PyObject* keyed_call(const char* name, PyObject* const* args, Py_ssize_t nargs, Call call) {
  ShmComm* comm;
  int64_t ints[num_ints];
  CallKey key;
  double timeout_s;
  if (!read_call(name, args, nargs, num_ints, &comm, ints, &key, &timeout_s)) return nullptr;
  if (!run_released([&] { call(*comm, ints, key, timeout_s); })) return nullptr;
  Py_RETURN_NONE;
}

// The (output, input) addresses of a pointer call.
Output output_of(const int64_t* a) { return Output{static_cast<uintptr_t>(a[0])}; }
Input input_of(const int64_t* a) { return Input{static_cast<uintptr_t>(a[1])}; }

// all_reduce_lean(handle, output, input, numel, dtype, op, timeout_s)
PyObject* all_reduce_lean(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return pointer_call<5>("all_reduce_lean", args, nargs, [](ShmComm& comm, const int64_t* a, double timeout_s) {
    comm.all_reduce(output_of(a), input_of(a), a[2], static_cast<int>(a[3]), static_cast<int>(a[4]), timeout_s);
  });
}

// reduce_scatter_lean(handle, output, input, chunk_numel, dtype, op, timeout_s)
PyObject* reduce_scatter_lean(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return pointer_call<5>("reduce_scatter_lean", args, nargs, [](ShmComm& comm, const int64_t* a, double timeout_s) {
    comm.reduce_scatter(output_of(a), input_of(a), a[2], static_cast<int>(a[3]), static_cast<int>(a[4]), timeout_s);
  });
}

// all_gather_lean(handle, output, input, chunk_numel, dtype, timeout_s)
PyObject* all_gather_lean(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return pointer_call<4>("all_gather_lean", args, nargs, [](ShmComm& comm, const int64_t* a, double timeout_s) {
    comm.all_gather(output_of(a), input_of(a), a[2], static_cast<int>(a[3]), timeout_s);
  });
}

// all_gather_keyed(handle, output, input, chunk_numel, dtype, key, timeout_s)
PyObject* all_gather_keyed(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return keyed_call<4>("all_gather_keyed", args, nargs,
                       [](ShmComm& comm, const int64_t* a, const CallKey& key, double timeout_s) {
                         comm.all_gather(output_of(a), input_of(a), a[2], static_cast<int>(a[3]), timeout_s, key);
                       });
}

// all_to_all_keyed(handle, output, input, chunk_numel, dtype, key, timeout_s)
PyObject* all_to_all_keyed(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return keyed_call<4>("all_to_all_keyed", args, nargs,
                       [](ShmComm& comm, const int64_t* a, const CallKey& key, double timeout_s) {
                         comm.all_to_all(output_of(a), input_of(a), a[2], static_cast<int>(a[3]), timeout_s, key);
                       });
}

// all_reduce_tensor(handle, tensor, op, timeout_s) -> bool: in place.
PyObject* all_reduce_tensor(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!check_nargs("all_reduce_tensor", nargs, 4)) return nullptr;
  ShmComm* comm = comm_of(args[0]);
  if (comm == nullptr) return nullptr;
  if (profiler_records()) Py_RETURN_FALSE;
  LeanTensor tensor;
  if (!read_tensor(args[1], &tensor)) return no_lean();
  int64_t op = 0;
  if (!read_ints(args, 2, 1, &op)) return nullptr;
  const double timeout_s = PyFloat_AsDouble(args[3]);
  if (timeout_s == -1.0 && PyErr_Occurred()) return nullptr;
  const int64_t numel = tensor.nbytes / element_nbytes(to_dtype(tensor.dtype));
  std::optional<OpScope> scope;
  if (!admit(*comm, "all_reduce", scope)) return nullptr;
  TraceRing& trace = comm->trace();
  const int64_t slot = trace.begin(static_cast<int32_t>(OpKind::kAllReduce), tensor.dtype, static_cast<int32_t>(op),
                                   numel, numel);
  const bool ok = run_released([&] {
    comm->all_reduce(Output{tensor.ptr}, Input{tensor.ptr}, numel, tensor.dtype, static_cast<int>(op), timeout_s);
  });
  trace.end(slot, ok);
  if (!ok) return nullptr;
  Py_RETURN_TRUE;
}

// reduce_scatter_tensors(handle, output, input, op, timeout_s) and
// all_gather_tensors(handle, output, input, timeout_s) -> bool.
template <bool gather>
PyObject* pair_call(const char* name, PyObject* const* args, Py_ssize_t nargs) {
  constexpr int num_args = gather ? 4 : 5;
  if (!check_nargs(name, nargs, num_args)) return nullptr;
  ShmComm* comm = comm_of(args[0]);
  if (comm == nullptr) return nullptr;
  if (profiler_records()) Py_RETURN_FALSE;
  LeanTensor output, input;
  if (!read_tensor(args[1], &output) || !read_tensor(args[2], &input)) return no_lean();
  const LeanTensor& big = gather ? output : input;
  const LeanTensor& small = gather ? input : output;
  if (!pair_takes(*comm, big, small)) Py_RETURN_FALSE;
  int64_t op = 0;
  if (!gather && !read_ints(args, 3, 1, &op)) return nullptr;
  const double timeout_s = PyFloat_AsDouble(args[num_args - 1]);
  if (timeout_s == -1.0 && PyErr_Occurred()) return nullptr;
  const int64_t chunk_numel = small.nbytes / element_nbytes(to_dtype(small.dtype));
  const int64_t input_numel = gather ? chunk_numel : chunk_numel * comm->world_size();
  const int64_t output_numel = gather ? chunk_numel * comm->world_size() : chunk_numel;
  std::optional<OpScope> scope;
  if (!admit(*comm, gather ? "all_gather" : "reduce_scatter", scope)) return nullptr;
  TraceRing& trace = comm->trace();
  const int64_t slot = trace.begin(static_cast<int32_t>(gather ? OpKind::kAllGather : OpKind::kReduceScatter),
                                   input.dtype, gather ? -1 : static_cast<int32_t>(op), input_numel, output_numel);
  const bool ok = run_released([&] {
    if (gather) {
      comm->all_gather(Output{output.ptr}, Input{input.ptr}, chunk_numel, input.dtype, timeout_s);
    } else {
      comm->reduce_scatter(Output{output.ptr}, Input{input.ptr}, chunk_numel, input.dtype, static_cast<int>(op),
                           timeout_s);
    }
  });
  trace.end(slot, ok);
  if (!ok) return nullptr;
  Py_RETURN_TRUE;
}

PyObject* reduce_scatter_tensors(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return pair_call<false>("reduce_scatter_tensors", args, nargs);
}

PyObject* all_gather_tensors(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return pair_call<true>("all_gather_tensors", args, nargs);
}

template <PyObject* (*fn)(PyObject*, PyObject* const*, Py_ssize_t)>
PyMethodDef fastcall(const char* name, const char* doc) {
  return {name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fn)), METH_FASTCALL, doc};
}

PyMethodDef kLeanMethods[] = {
    fastcall<all_reduce_lean>("all_reduce_lean", "all_reduce_lean(handle, output, input, numel, dtype, op, timeout_s)"),
    fastcall<reduce_scatter_lean>("reduce_scatter_lean",
                                  "reduce_scatter_lean(handle, output, input, chunk_numel, dtype, op, timeout_s)"),
    fastcall<all_gather_lean>("all_gather_lean",
                              "all_gather_lean(handle, output, input, chunk_numel, dtype, timeout_s)"),
    fastcall<all_gather_keyed>("all_gather_keyed",
                               "all_gather_keyed(handle, output, input, chunk_numel, dtype, key, timeout_s)"),
    fastcall<all_to_all_keyed>("all_to_all_keyed",
                               "all_to_all_keyed(handle, output, input, chunk_numel, dtype, key, timeout_s)"),
    fastcall<all_reduce_tensor>("all_reduce_tensor",
                                "all_reduce_tensor(handle, tensor, op, timeout_s) -> whether it ran"),
    fastcall<reduce_scatter_tensors>("reduce_scatter_tensors",
                                     "reduce_scatter_tensors(handle, output, input, op, timeout_s) -> whether it ran"),
    fastcall<all_gather_tensors>("all_gather_tensors",
                                 "all_gather_tensors(handle, output, input, timeout_s) -> whether it ran"),
};

// torch.Tensor's descriptor of attribute `name` (see [Note: torch's attributes,
// read by descriptor]); a type's attribute lookup returns the descriptor itself.
Attribute find_attribute(pybind11::type tensor_type, const char* name, bool method) {
  pybind11::object descriptor = tensor_type.attr(name);
  Attribute attribute{descriptor.ptr(), method ? nullptr : Py_TYPE(descriptor.ptr())->tp_descr_get};
  if (!method && attribute.get == nullptr)
    throw pybind11::type_error(std::string("_lean_setup: torch.Tensor.") + name + " is not a property");
  descriptor.release();  // lives as long as the process
  return attribute;
}

// torch.Tensor's dltensor_from_py_object_no_sync ([Note: one read by DLPack]),
// or null where torch has none of DLPack's major version 1.
dlpack::TensorFromPyObject find_from_dlpack(pybind11::type tensor_type) {
  if (!pybind11::hasattr(tensor_type, "__dlpack_c_exchange_api__")) return nullptr;
  pybind11::object capsule = tensor_type.attr("__dlpack_c_exchange_api__");
  if (!PyCapsule_IsValid(capsule.ptr(), dlpack::kExchangeCapsule)) return nullptr;
  const auto* exchange = static_cast<const dlpack::ExchangeApi*>(
      PyCapsule_GetPointer(capsule.ptr(), dlpack::kExchangeCapsule));
  if (exchange->header.version.major != dlpack::kMajorVersion) return nullptr;
  return exchange->dltensor_from_py_object_no_sync;  // the table lives as long as torch
}

}  // namespace

void add_lean_functions(pybind11::module_& m) {
  // Also what pybind11 raises for a CallMismatch from the ShmComm methods.
  call_mismatch = pybind11::register_exception<CallMismatch>(m, "CallMismatch", PyExc_ValueError).ptr();
  for (PyMethodDef& def : kLeanMethods)
    m.add_object(def.ml_name, pybind11::reinterpret_steal<pybind11::object>(PyCFunction_New(&def, nullptr)));
  m.def(
      "_lean_setup",
      [](pybind11::type tensor_type, pybind11::object strided, pybind11::dict dtype_codes,
         pybind11::object profiler_owner, pybind11::str profiler_flag, bool dlpack) {
        // Called at import; the references live as long as the process.
        api.dtype_codes.clear();
        api.layout = find_attribute(tensor_type, "layout", false);
        api.dtype = find_attribute(tensor_type, "dtype", false);
        api.is_cpu = find_attribute(tensor_type, "is_cpu", false);
        api.is_nested = find_attribute(tensor_type, "is_nested", false);
        api.nbytes = find_attribute(tensor_type, "nbytes", false);
        api.is_contiguous = find_attribute(tensor_type, "is_contiguous", true);
        api.data_ptr = find_attribute(tensor_type, "data_ptr", true);
        api.from_dlpack = dlpack ? find_from_dlpack(tensor_type) : nullptr;
        api.tensor_type = reinterpret_cast<PyTypeObject*>(tensor_type.release().ptr());
        api.strided = strided.release().ptr();
        for (auto [dtype, code] : dtype_codes)
          api.dtype_codes.emplace_back(pybind11::reinterpret_borrow<pybind11::object>(dtype).release().ptr(),
                                       code.cast<int>());
        api.profiler_globals = pybind11::reinterpret_borrow<pybind11::object>(
            PyModule_GetDict(profiler_owner.ptr())).release().ptr();
        api.profiler_flag = profiler_flag.release().ptr();
      },
      "what the *_tensor(s) checks compare with: torch.Tensor, torch.strided, {torch dtype: ringcomm code}, "
      "and where torch says its profiler records (a module and its attribute's name); dlpack=False reads "
      "tensors by their attributes even where torch has DLPack's exchange function",
      pybind11::arg("tensor_type"), pybind11::arg("strided"), pybind11::arg("dtype_codes"),
      pybind11::arg("profiler_owner"), pybind11::arg("profiler_flag"), pybind11::arg("dlpack") = true);
  m.def(
      "_lean_read",
      [](pybind11::handle tensor) -> pybind11::object {
        LeanTensor read;
        if (read_tensor(tensor.ptr(), &read)) return pybind11::make_tuple(read.dtype, read.ptr, read.nbytes);
        if (PyErr_Occurred()) PyErr_Clear();
        return pybind11::none();
      },
      "test-only: (dtype code, data address, nbytes) as the lean calls read `tensor`, or None where they refuse it",
      pybind11::arg("tensor"));
  m.def("_lean_reads_by_dlpack", [] { return api.from_dlpack != nullptr; },
        "whether the lean calls read tensors through DLPack's exchange function ([Note: one read by DLPack])");
}

}  // namespace ringcomm
