#include "shm_map.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <stdexcept>

namespace ringcomm {

namespace {

std::string octal_mode(mode_t mode) {
  char text[8];
  std::snprintf(text, sizeof(text), "%04o", static_cast<unsigned>(mode & 07777));
  return text;
}

// A new segment: mode 0600 whatever the umask, pages reserved up front.
int create_segment(const std::string& name, int64_t length) {
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) throw std::runtime_error("shm: cannot create segment '" + name + "': " + std::strerror(errno));
  int err = fchmod(fd, 0600) != 0 ? errno : 0;
  if (err == 0) err = ftruncate(fd, length) != 0 ? errno : posix_fallocate(fd, 0, length);
  if (err != 0) {
    close(fd);
    shm_unlink(name.c_str());
    throw std::runtime_error("shm: cannot reserve " + std::to_string(length) + " bytes for segment '" + name +
                             "' in /dev/shm (" + std::strerror(err) +
                             "); free space there, use smaller slots, or set RINGCOMM_TRANSPORT=torch_dist");
  }
  return fd;
}

// An existing segment, only if this user made it as ringcomm does (owner, mode
// 0600) and it has the expected size; checked on the open fd, so the file
// checked is the file mapped.
int open_segment(const std::string& name, int64_t length) {
  const int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) throw std::runtime_error("shm: cannot open segment '" + name + "': " + std::strerror(errno));
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    close(fd);
    throw std::runtime_error("shm: cannot stat segment '" + name + "': " + std::strerror(err));
  }
  if (st.st_uid != geteuid() || (st.st_mode & 07777) != 0600) {
    close(fd);
    throw std::runtime_error("shm: refusing to map segment '" + name + "': it is owned by uid " +
                             std::to_string(st.st_uid) + " with mode " + octal_mode(st.st_mode) +
                             ", but ringcomm maps only segments of its own user (uid " + std::to_string(geteuid()) +
                             ") with mode 0600");
  }
  if (st.st_size != length) {
    close(fd);
    throw std::runtime_error("shm: segment '" + name + "' has " + std::to_string(st.st_size) + " bytes, expected " +
                             std::to_string(length) + " (ranks disagree on its size)");
  }
  return fd;
}

}  // namespace

char* map_segment(const std::string& name, int64_t nbytes, bool create) {
  const int64_t length = nbytes > 0 ? nbytes : 1;
  const int fd = create ? create_segment(name, length) : open_segment(name, length);
  void* data = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);
  if (data == MAP_FAILED) throw std::runtime_error("shm: cannot map segment '" + name + "': " + std::strerror(err));
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
