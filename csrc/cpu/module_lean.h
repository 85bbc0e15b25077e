// The lean entry points of ringcomm._C (module_lean.cpp, [Note: lean calls]).
#pragma once

#include <pybind11/pybind11.h>

namespace ringcomm {

// The name of the capsule that carries a ShmComm (ShmComm._handle) to them.
constexpr const char* kCommCapsule = "ringcomm.ShmComm";

// Adds all_reduce_lean, ..., all_reduce_tensor, ... and _lean_setup to `m`.
void add_lean_functions(pybind11::module_& m);

}  // namespace ringcomm
