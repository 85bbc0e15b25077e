// The point-to-point bindings of ringcomm._C (module_p2p.cpp): the only other
// header besides module_lean.h that includes pybind11.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>

#include "shm.h"

namespace ringcomm {

// Adds P2pRequest to `m` and the p2p_* methods to ShmComm.
void add_p2p_bindings(pybind11::module_& m, pybind11::class_<ShmComm, std::shared_ptr<ShmComm>>& comm);

}  // namespace ringcomm
