#include "process.h"

#include <errno.h>
#include <signal.h>
#include <unistd.h>

#include <fstream>
#include <limits>
#include <string>

namespace ringcomm {

ProcessState process_state(int64_t pid) {
  if (pid <= 0 || pid > std::numeric_limits<pid_t>::max()) return ProcessState::kRunning;
  if (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return ProcessState::kExited;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return ProcessState::kRunning;
  const auto paren = line.rfind(')');  // the command name may hold spaces and parentheses
  if (paren == std::string::npos || paren + 2 >= line.size()) return ProcessState::kRunning;
  switch (line[paren + 2]) {
    case 'Z':
    case 'X':
      return ProcessState::kExited;
    case 'T':
    case 't':
      return ProcessState::kStopped;
    default:
      return ProcessState::kRunning;
  }
}

}  // namespace ringcomm
