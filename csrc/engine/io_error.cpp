#include "engine/io_error.h"

#include <cerrno>
#include <cstdlib>
#include <system_error>
#include <utility>

#include "engine/aligned_buffer.h"

namespace ssdtrain {

std::string describe_errno(int err) {
  return std::error_code(err, std::generic_category()).message();
}

IoError::IoError(int err, std::string op, std::uint64_t offset, std::size_t nbytes,
                 std::string path, const std::string& detail)
    : std::runtime_error(op + " of " + std::to_string(nbytes) + " bytes at offset " +
                         std::to_string(offset) + " of " + path + " failed: " +
                         (detail.empty() ? describe_errno(err) : detail) + " (errno " +
                         std::to_string(err) + ")"),
      err_(err),
      op_(std::move(op)),
      offset_(offset),
      path_(std::move(path)) {}

AlignedBuffer::AlignedBuffer(std::size_t alignment, std::size_t nbytes) : size_(nbytes) {
  void* p = nullptr;
  const int rc = posix_memalign(&p, alignment, nbytes);
  if (rc != 0) {
    throw IoError(rc, "posix_memalign", 0, nbytes, "<bounce buffer>");
  }
  data_.reset(static_cast<char*>(p));
}

}  // namespace ssdtrain
