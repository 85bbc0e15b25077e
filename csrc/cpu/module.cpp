// pybind11 bindings of ringcomm._C. Everything takes raw data_ptr() ints and
// releases the GIL; no torch headers are involved. The collectives' hot entry
// points are in module_lean.cpp ([Note: lean calls]).
#include <Python.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <vector>

#include "adam.h"
#include "checksum.h"
#include "cpu_capability.h"
#include "module_lean.h"
#include "module_p2p.h"
#include "process.h"
#include "quant.h"
#include "reduce.h"
#include "shm.h"
#include "shm_map.h"
#include "shm_plan.h"
#include "trace.h"

namespace py = pybind11;
using ringcomm::OpDesc;
using ringcomm::ShmComm;
using ringcomm::ShmConfig;
using ringcomm::ShmWindow;

namespace {

void reduce_n(uintptr_t dst, const std::vector<uintptr_t>& srcs, int64_t numel, int dtype, int op, int64_t divisor) {
  std::vector<const void*> pointers(srcs.size());
  for (size_t i = 0; i < srcs.size(); ++i) pointers[i] = reinterpret_cast<const void*>(srcs[i]);
  ringcomm::reduce_n(reinterpret_cast<void*>(dst), pointers.data(), static_cast<int>(pointers.size()), numel,
                     ringcomm::to_dtype(dtype), ringcomm::to_redop(op), divisor);
}

void copy(uintptr_t dst, uintptr_t src, int64_t nbytes) {
  if (nbytes < 0) throw std::invalid_argument("copy: nbytes=" + std::to_string(nbytes) + " < 0");
  std::memcpy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), static_cast<size_t>(nbytes));
}

// copies: 3 pointers per copy (master, exp_avg, exp_avg_sq); returns their word sums after the step
// (none without copies)
std::vector<uint64_t> adam_step(uintptr_t param, uintptr_t grad, uintptr_t exp_avg, uintptr_t exp_avg_sq, uintptr_t out,
                                int out_dtype, int64_t numel, float lr, float beta1, float beta2, float eps,
                                float weight_decay, int64_t step, float grad_coef, bool adamw, int num_threads,
                                const std::vector<uintptr_t>& copies) {
  ringcomm::AdamCopies targets;
  if (copies.size() % 3 != 0 || copies.size() / 3 > ringcomm::AdamCopies::kMaxCopies) {
    throw std::invalid_argument("adam_step: copies holds " + std::to_string(copies.size()) + " pointers, expected 3 " +
                                "per copy and at most " + std::to_string(ringcomm::AdamCopies::kMaxCopies) + " copies");
  }
  targets.count = static_cast<int>(copies.size() / 3);
  for (size_t i = 0; i < copies.size(); ++i) targets.to[i / 3][i % 3] = reinterpret_cast<float*>(copies[i]);
  ringcomm::adam_step(reinterpret_cast<float*>(param), reinterpret_cast<const float*>(grad),
                      reinterpret_cast<float*>(exp_avg), reinterpret_cast<float*>(exp_avg_sq),
                      reinterpret_cast<void*>(out), ringcomm::to_dtype(out_dtype), numel,
                      ringcomm::AdamHyper{lr, beta1, beta2, eps, weight_decay, step, grad_coef, adamw},
                      copies.empty() ? nullptr : &targets, num_threads);
  if (copies.empty()) return {};
  return {targets.sums[0], targets.sums[1], targets.sums[2]};
}

void quantize(uintptr_t x, int dtype, int64_t numel, uintptr_t data, uintptr_t scales, int bits, int64_t block,
              int num_threads) {
  ringcomm::quantize(reinterpret_cast<const void*>(x), ringcomm::to_dtype(dtype), numel, reinterpret_cast<uint8_t*>(data),
                     reinterpret_cast<float*>(scales), ringcomm::QuantFormat{bits, block}, num_threads);
}

void dequantize_sum(uintptr_t data, uintptr_t scales, int num_rows, uintptr_t out, int dtype, int64_t numel, int bits,
                    int64_t block, int num_threads) {
  ringcomm::dequantize_sum(reinterpret_cast<const uint8_t*>(data), reinterpret_cast<const float*>(scales), num_rows,
                           reinterpret_cast<void*>(out), ringcomm::to_dtype(dtype), numel,
                           ringcomm::QuantFormat{bits, block}, num_threads);
}

// The capsule of ShmComm._handle owns a reference to the comm, so a lean call
// that holds it keeps the comm alive ([Note: close and abort]).
void release_comm(PyObject* capsule) {
  delete static_cast<std::shared_ptr<ShmComm>*>(PyCapsule_GetPointer(capsule, ringcomm::kCommCapsule));
}

std::vector<std::string> capability_names(const std::vector<ringcomm::CpuCapability>& capabilities) {
  std::vector<std::string> names;
  for (ringcomm::CpuCapability capability : capabilities) names.emplace_back(ringcomm::capability_name(capability));
  return names;
}

#ifndef RINGCOMM_BUILD_MARCH
#define RINGCOMM_BUILD_MARCH ""
#endif

// Point-to-point defaults for comms made directly (tests); ShmOptions passes its own.
constexpr int64_t kP2pSlotNbytes = 64 << 10;
constexpr int kP2pNumSlots = 4;

ShmConfig make_config(int64_t slot_nbytes, int num_slots, int64_t oneshot_max_nbytes, int64_t spin_ns,
                      int64_t cma_min_nbytes, int64_t cma_reduce_min_nbytes, int64_t p2p_slot_nbytes = kP2pSlotNbytes,
                      int p2p_num_slots = kP2pNumSlots, int64_t p2p_cma_min_nbytes = -1) {
  return ShmConfig{slot_nbytes,    num_slots,           oneshot_max_nbytes, spin_ns, cma_min_nbytes,
                   cma_reduce_min_nbytes, p2p_slot_nbytes, p2p_num_slots,      p2p_cma_min_nbytes};
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "ringcomm C++ kernels and shared-memory transport";
  ringcomm::add_lean_functions(m);
  ringcomm::add_trace_functions(m);
  m.attr("CALL_KEY_LEN") = ringcomm::kCallKeyLen;
  py::call_guard<py::gil_scoped_release> no_gil;
  m.def("reduce_n", &reduce_n, "dst = srcs[0] op srcs[1] op ...", py::arg("dst"), py::arg("srcs"), py::arg("numel"),
        py::arg("dtype"), py::arg("op"), py::arg("divisor") = 1, no_gil);
  m.def("copy", &copy, "memcpy of nbytes", py::arg("dst"), py::arg("src"), py::arg("nbytes"), no_gil);
  m.def("adam_step", &adam_step,
        "fused Adam/AdamW: unscale, update, 16-bit copy-out (out=0: none), copies of the updated master and moments "
        "(3 pointers per copy) and their word sums",
        py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("out"),
        py::arg("out_dtype"), py::arg("numel"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("step"), py::arg("grad_coef"), py::arg("adamw"), py::arg("num_threads"),
        py::arg("copies") = std::vector<uintptr_t>{}, no_gil);
  m.def("word_sum",
        [](uintptr_t data, int64_t nbytes, int64_t first) {
          return ringcomm::word_sum(reinterpret_cast<const void*>(data), nbytes, first);
        },
        "the word sum of nbytes at data, its first word being word `first` (csrc/cpu/checksum.h)", py::arg("data"),
        py::arg("nbytes"), py::arg("first") = 0, no_gil);
  m.def("quantize", &quantize, "blockwise int8/int4 quantization of numel elements into data and scales",
        py::arg("x"), py::arg("dtype"), py::arg("numel"), py::arg("data"), py::arg("scales"), py::arg("bits"),
        py::arg("block"), py::arg("num_threads") = 1, no_gil);
  m.def("dequantize_sum", &dequantize_sum, "out = sum of the dequantized rows, in float32, rounded once",
        py::arg("data"), py::arg("scales"), py::arg("num_rows"), py::arg("out"), py::arg("dtype"), py::arg("numel"),
        py::arg("bits"), py::arg("block"), py::arg("num_threads") = 1, no_gil);

  m.def("cpu_capability", [] { return std::string(ringcomm::capability_name(ringcomm::active_capability())); },
        "the build of the kernels in use: default, avx2, avx512 or avx512_bf16 (csrc/cpu/cpu_capability.h)");
  m.def("cpu_capabilities", [] {
        return py::dict(py::arg("built") = capability_names(ringcomm::built_capabilities()),
                        py::arg("supported") = capability_names(ringcomm::supported_capabilities()),
                        py::arg("march") = std::string(RINGCOMM_BUILD_MARCH));
      }, "the builds of the kernels in this library, those this CPU runs, and the baseline's -march ('' for the compiler's default)");

  m.def("process_state", [](int64_t pid) { return static_cast<int>(ringcomm::process_state(pid)); },
        "what a process of this host does: an index of ringcomm.core.host.PROCESS_STATES", py::arg("pid"));
  // Test-only: the chunk arithmetic of the shared-memory collectives, checked against ringcomm.plan.schedule.
  m.def("_balanced_chunk", [](int64_t numel, int parts, int index) {
        const ringcomm::Span span = ringcomm::balanced_chunk(numel, parts, index);
        return std::make_pair(span.begin, span.numel);
      }, py::arg("numel"), py::arg("parts"), py::arg("index"));

  // Test-only: an op descriptor as a peer writes it into its slot.
  py::class_<OpDesc>(m, "_DebugOpDesc")
      .def(py::init([]() { return OpDesc{0, -1, -1, -1, 0, 0, -1, 0, -1, 0, 0, 0, ringcomm::CallKey{}}; }))
      .def_readwrite("kind", &OpDesc::kind)
      .def_readwrite("dtype", &OpDesc::dtype)
      .def_readwrite("redop", &OpDesc::redop)
      .def_readwrite("root", &OpDesc::root)
      .def_readwrite("numel", &OpDesc::numel)
      .def_readwrite("access", &OpDesc::access)
      .def_readwrite("in_window", &OpDesc::in_window)
      .def_readwrite("in_offset", &OpDesc::in_offset)
      .def_readwrite("out_window", &OpDesc::out_window)
      .def_readwrite("out_offset", &OpDesc::out_offset)
      .def_readwrite("in_addr", &OpDesc::in_addr)
      .def_readwrite("out_addr", &OpDesc::out_addr);

  py::class_<ShmComm, std::shared_ptr<ShmComm>> comm(m, "ShmComm");
  comm.def(py::init([](const std::string& name, int rank, int world_size, int64_t slot_nbytes, int num_slots,
                       int64_t oneshot_max_nbytes, int64_t spin_ns, bool create, int64_t cma_min_nbytes,
                       int64_t cma_reduce_min_nbytes, int64_t p2p_slot_nbytes, int p2p_num_slots,
                       int64_t p2p_cma_min_nbytes) {
             return std::make_shared<ShmComm>(name, rank, world_size,
                                              make_config(slot_nbytes, num_slots, oneshot_max_nbytes, spin_ns,
                                                          cma_min_nbytes, cma_reduce_min_nbytes, p2p_slot_nbytes,
                                                          p2p_num_slots, p2p_cma_min_nbytes),
                                              create);
           }),
           py::arg("name"), py::arg("rank"), py::arg("world_size"), py::arg("slot_nbytes"), py::arg("num_slots"),
           py::arg("oneshot_max_nbytes"), py::arg("spin_ns"), py::arg("create"), py::arg("cma_min_nbytes") = -1,
           py::arg("cma_reduce_min_nbytes") = -1, py::arg("p2p_slot_nbytes") = kP2pSlotNbytes,
           py::arg("p2p_num_slots") = kP2pNumSlots, py::arg("p2p_cma_min_nbytes") = -1)
      .def_static("unlink", &ShmComm::unlink, py::arg("name"))
      .def_static("segment_nbytes",
                  [](int world_size, int64_t slot_nbytes, int num_slots, int64_t p2p_slot_nbytes, int p2p_num_slots) {
                    return ShmComm::segment_nbytes(world_size, make_config(slot_nbytes, num_slots, 0, 0, -1, -1,
                                                                           p2p_slot_nbytes, p2p_num_slots));
                  },
                  py::arg("world_size"), py::arg("slot_nbytes"), py::arg("num_slots"),
                  py::arg("p2p_slot_nbytes") = kP2pSlotNbytes, py::arg("p2p_num_slots") = kP2pNumSlots)
      .def("all_reduce",
           [](ShmComm& comm, uintptr_t output, uintptr_t input, int64_t numel, int dtype, int op, double timeout_s) {
             comm.all_reduce(ringcomm::Output{output}, ringcomm::Input{input}, numel, dtype, op, timeout_s);
           },
           py::arg("output"), py::arg("input"), py::arg("numel"), py::arg("dtype"),
           py::arg("op"), py::arg("timeout_s"), no_gil)
      .def("reduce_scatter",
           [](ShmComm& comm, uintptr_t output, uintptr_t input, int64_t chunk_numel, int dtype, int op,
              double timeout_s) {
             comm.reduce_scatter(ringcomm::Output{output}, ringcomm::Input{input}, chunk_numel, dtype, op, timeout_s);
           },
           py::arg("output"), py::arg("input"), py::arg("chunk_numel"),
           py::arg("dtype"), py::arg("op"), py::arg("timeout_s"), no_gil)
      .def("all_gather",
           [](ShmComm& comm, uintptr_t output, uintptr_t input, int64_t chunk_numel, int dtype, double timeout_s) {
             comm.all_gather(ringcomm::Output{output}, ringcomm::Input{input}, chunk_numel, dtype, timeout_s);
           },
           py::arg("output"), py::arg("input"), py::arg("chunk_numel"),
           py::arg("dtype"), py::arg("timeout_s"), no_gil)
      .def("all_to_all",
           [](ShmComm& comm, uintptr_t output, uintptr_t input, int64_t chunk_numel, int dtype, double timeout_s) {
             comm.all_to_all(ringcomm::Output{output}, ringcomm::Input{input}, chunk_numel, dtype, timeout_s);
           },
           py::arg("output"), py::arg("input"), py::arg("chunk_numel"),
           py::arg("dtype"), py::arg("timeout_s"), no_gil)
      .def("last_calls", &ShmComm::last_calls, "every rank's (kind, dtype, op, root, numel, key...) as this rank "
           "read them in its last check of the calls (after a CallMismatch: what differed)")
      .def("broadcast", &ShmComm::broadcast, py::arg("buffer"), py::arg("numel"), py::arg("dtype"), py::arg("root"),
           py::arg("timeout_s"), no_gil)
      .def("barrier", &ShmComm::barrier, py::arg("timeout_s"), no_gil)
      .def("setup_cma", &ShmComm::setup_cma, "collective: whether every rank can read every other by CMA; '' when "
           "it can, else why not; reductions then read peers through pieces of piece_nbytes per peer",
           py::arg("timeout_s"), py::arg("piece_nbytes") = ringcomm::kDefaultCmaPieceBytes, no_gil)
      .def_property_readonly("cma_enabled", &ShmComm::cma_enabled)
      .def_property_readonly("_handle",
                             [](std::shared_ptr<ShmComm> comm) {
                               return py::capsule(new std::shared_ptr<ShmComm>(std::move(comm)),
                                                  ringcomm::kCommCapsule, &release_comm);
                             },
                             "the comm for the *_lean and *_tensor(s) functions (see [Note: lean calls]); it keeps "
                             "the comm alive")
      .def("close", &ShmComm::close, "refuse new calls, wait up to timeout_s for the one in flight (then abort it); "
           "whether it ended by itself", py::arg("timeout_s"), no_gil)
      .def("abort", &ShmComm::abort, "the call in flight fails at once; later calls are refused", no_gil)
      .def("peer_aborted", &ShmComm::peer_aborted, "'rank N aborted the group' once a peer aborted, else ''",
           no_gil)
      .def_property_readonly("broken", &ShmComm::broken, "why the comm refuses work after a failure ('' if usable)")
      .def("register_window", &ShmComm::register_window, py::arg("id"), py::arg("bases"), py::arg("nbytes"), no_gil)
      .def("unregister_window", &ShmComm::unregister_window, "waits for the op in flight if it may read windows",
           py::arg("id"), no_gil)
      .def("_debug_post", &ShmComm::debug_post, "test-only: post the next round with an unchecked descriptor",
           py::arg("desc"))
      .def("_debug_store", &ShmComm::debug_store, "test-only: store into this rank's header", py::arg("field"),
           py::arg("value"))
      .def_property_readonly("rank", &ShmComm::rank)
      .def_property_readonly("world_size", &ShmComm::world_size)
      .def_property_readonly("rounds", &ShmComm::rounds);
  ringcomm::add_p2p_bindings(m, comm);

  py::class_<ShmWindow>(m, "ShmWindow", py::buffer_protocol())
      .def(py::init<const std::string&, int64_t, bool>(), py::arg("name"), py::arg("nbytes"), py::arg("create"))
      .def_static("unlink", &ringcomm::unlink_segment, py::arg("name"))
      .def_property_readonly("address", [](const ShmWindow& w) { return reinterpret_cast<uintptr_t>(w.data()); })
      .def_property_readonly("nbytes", &ShmWindow::nbytes)
      .def_buffer([](ShmWindow& w) {
        return py::buffer_info(w.data(), 1, py::format_descriptor<uint8_t>::format(), 1, {w.nbytes()}, {1});
      });
}
