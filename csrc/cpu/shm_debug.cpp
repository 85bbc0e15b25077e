// Test-only fault injection for the shared-memory transport: lets a test act
// as a faulty or hostile peer by writing what such a peer could write into the
// segment. Nothing here is used by the collectives.
#include <stdexcept>
#include <string>

#include "shm.h"

namespace ringcomm {

void ShmComm::debug_post(const OpDesc& desc) {
  OpScope scope(caller_, state_, "_debug_post", rank_);
  post(&desc);
}

void ShmComm::debug_store(const std::string& field, int64_t value) {
  OpScope scope(caller_, state_, "_debug_store", rank_);
  RankHeader* mine = header(rank_);
  if (field == "posted") {
    mine->posted.value.store(static_cast<uint64_t>(value), std::memory_order_release);
  } else if (field == "consumed") {
    mine->consumed.value.store(static_cast<uint64_t>(value), std::memory_order_release);
  } else if (field == "pid") {
    mine->pid = value;
  } else {
    throw std::invalid_argument("shm: _debug_store: unknown field '" + field + "' (posted, consumed, pid)");
  }
}

}  // namespace ringcomm
