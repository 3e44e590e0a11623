// A heap buffer with a chosen alignment (O_DIRECT bounce blocks), freed by RAII.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <memory>

namespace ssdtrain {

constexpr std::size_t kBlock = 4096;  // O_DIRECT alignment of memory, offsets and lengths

class AlignedBuffer {
 public:
  // Throws IoError (ENOMEM/EINVAL) when posix_memalign fails.
  AlignedBuffer(std::size_t alignment, std::size_t nbytes);

  char* data() const noexcept { return data_.get(); }
  std::size_t size() const noexcept { return size_; }

 private:
  struct Free {
    void operator()(char* p) const noexcept { std::free(p); }
  };
  std::unique_ptr<char[], Free> data_;
  std::size_t size_;
};

}  // namespace ssdtrain
