#include "shm_map.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <stdexcept>

namespace ringcomm {

char* map_segment(const std::string& name, int64_t nbytes, bool create) {
  const int64_t length = nbytes > 0 ? nbytes : 1;
  const int fd = create ? shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600) : shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0)
    throw std::runtime_error(std::string(create ? "shm: cannot create segment '" : "shm: cannot open segment '") + name +
                             "': " + std::strerror(errno));
  if (create) {
    const int err = ftruncate(fd, length) != 0 ? errno : posix_fallocate(fd, 0, length);
    if (err != 0) {
      close(fd);
      shm_unlink(name.c_str());
      throw std::runtime_error("shm: cannot reserve " + std::to_string(length) + " bytes for segment '" + name +
                               "' in /dev/shm (" + std::strerror(err) +
                               "); free space there, use smaller slots, or set RINGCOMM_TRANSPORT=torch_dist");
    }
  } else {
    struct stat st;
    if (fstat(fd, &st) != 0 || st.st_size != length) {
      close(fd);
      throw std::runtime_error("shm: segment '" + name + "' has " + std::to_string(st.st_size) + " bytes, expected " +
                               std::to_string(length) + " (ranks disagree on its size)");
    }
  }
  void* data = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (data == MAP_FAILED) throw std::runtime_error("shm: cannot map segment '" + name + "': " + std::strerror(errno));
  return static_cast<char*>(data);
}

void unmap_segment(char* data, int64_t nbytes) {
  if (data != nullptr) munmap(data, nbytes > 0 ? nbytes : 1);
}

void unlink_segment(const std::string& name) { shm_unlink(name.c_str()); }

ShmWindow::ShmWindow(const std::string& name, int64_t nbytes, bool create)
    : data_(map_segment(name, nbytes, create)), nbytes_(nbytes) {}

ShmWindow::~ShmWindow() { unmap_segment(data_, nbytes_); }

}  // namespace ringcomm
