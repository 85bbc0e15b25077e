// pybind11 bindings of the shared-memory point-to-point channels (shm_p2p.h):
// requests, and the ShmComm methods that post, wait for and test them. Buffers
// are data_ptr() ints; every call that may wait releases the GIL.
#include "module_p2p.h"

#include "shm_p2p.h"

namespace py = pybind11;

namespace ringcomm {

void add_p2p_bindings(py::module_& m, py::class_<ShmComm, std::shared_ptr<ShmComm>>& comm) {
  py::call_guard<py::gil_scoped_release> no_gil;
  py::class_<P2pRequest, std::shared_ptr<P2pRequest>>(m, "P2pRequest",
                                                      "one send or receive on the shared-memory channels")
      .def_property_readonly("done", [](const P2pRequest& r) { return r.state() != P2pRequest::Status::kPending; },
                             "whether it ended (successfully or not)")
      .def_property_readonly("succeeded", [](const P2pRequest& r) { return r.state() == P2pRequest::Status::kDone; },
                             "whether it ended without an error")
      .def_property_readonly("error", [](const P2pRequest& r) {
             return r.state() == P2pRequest::Status::kFailed ? r.error : std::string();
           }, "why it failed ('' unless it did)")
      .def_property_readonly("caller_error", [](const P2pRequest& r) { return r.caller_error; },
                             "whether it failed by the caller's mistake (a ValueError)")
      .def_property_readonly("source", [](const P2pRequest& r) { return r.source.load(); },
                             "a receive's sender once matched, else -1")
      .def_property_readonly("nbytes", [](const P2pRequest& r) { return r.nbytes; });
  comm.def("p2p_isend",
           [](ShmComm& c, uintptr_t buffer, int64_t nbytes, int dst, int64_t tag) {
             return c.p2p().isend(reinterpret_cast<const char*>(buffer), nbytes, dst, tag);
           },
           "post a send of nbytes at buffer to rank dst", py::arg("buffer"), py::arg("nbytes"), py::arg("dst"),
           py::arg("tag"), no_gil)
      .def("p2p_irecv",
           [](ShmComm& c, uintptr_t buffer, int64_t nbytes, int src, int64_t tag) {
             return c.p2p().irecv(reinterpret_cast<char*>(buffer), nbytes, src, tag);
           },
           "post a receive of nbytes into buffer from rank src (-1: any source)", py::arg("buffer"),
           py::arg("nbytes"), py::arg("src"), py::arg("tag"), no_gil)
      .def("p2p_wait", [](ShmComm& c, P2pRequest& request, double timeout_s) { c.p2p().wait(request, timeout_s); },
           "make progress until the request ends (raises its error) or timeout_s passes", py::arg("request"),
           py::arg("timeout_s"), no_gil)
      .def("p2p_test", [](ShmComm& c, P2pRequest& request) { return c.p2p().test(request); },
           "one round of progress; whether the request ended", py::arg("request"), no_gil);
}

}  // namespace ringcomm
