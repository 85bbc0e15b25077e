// Creating, opening and mapping POSIX shared-memory segments.
#pragma once

#include <cstdint>
#include <string>

namespace ringcomm {

// Creates (mode 0600, pages reserved up front so a full /dev/shm fails here and
// not as SIGBUS later) or opens the segment `name` of `nbytes` and maps it.
// Opening refuses a segment of another user or with a mode other than 0600.
char* map_segment(const std::string& name, int64_t nbytes, bool create);
void unmap_segment(char* data, int64_t nbytes);
void unlink_segment(const std::string& name);

// Memory of one rank that every rank of its group maps: the storage of tensors
// allocated with ringcomm.empty, which collectives read without staging copies.
class ShmWindow {
 public:
  ShmWindow(const std::string& name, int64_t nbytes, bool create);
  ~ShmWindow();
  ShmWindow(const ShmWindow&) = delete;
  ShmWindow& operator=(const ShmWindow&) = delete;

  char* data() const { return data_; }
  int64_t nbytes() const { return nbytes_; }

 private:
  char* data_;
  int64_t nbytes_;
};

}  // namespace ringcomm
