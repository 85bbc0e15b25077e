// The lean entry points of ringcomm._C (module_lean.cpp, [Note: lean calls]) and
// the flight recorder's (trace.cpp): the only headers that include pybind11, so
// that the transport's sources compile without parsing it.
#pragma once

#include <pybind11/pybind11.h>

namespace ringcomm {

// The name of the capsule that carries a ShmComm (ShmComm._handle) to them.
constexpr const char* kCommCapsule = "ringcomm.ShmComm";

// Adds all_reduce_lean, ..., all_reduce_tensor, ... and _lean_setup to `m`.
void add_lean_functions(pybind11::module_& m);

// Adds _trace_resize, _trace_next_seq and _trace_entries (on ShmComm._handle) to `m`.
void add_trace_functions(pybind11::module_& m);

}  // namespace ringcomm
