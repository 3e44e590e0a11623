// Errors of the native engine: an exception carrying errno, the operation, the
// file offset and the path, so the Python side can raise SpillIOError with all four.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace ssdtrain {

class IoError : public std::runtime_error {
 public:
  // `detail` replaces strerror(err) in the message when given (e.g. "short read").
  IoError(int err, std::string op, std::uint64_t offset, std::size_t nbytes, std::string path,
          const std::string& detail = "");

  int err() const noexcept { return err_; }
  const std::string& op() const noexcept { return op_; }
  std::uint64_t offset() const noexcept { return offset_; }
  const std::string& path() const noexcept { return path_; }

 private:
  int err_;
  std::string op_;
  std::uint64_t offset_;
  std::string path_;
};

// strerror without strerror's shared buffer (workers format errors concurrently).
std::string describe_errno(int err);

}  // namespace ssdtrain
