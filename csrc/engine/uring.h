// A minimal io_uring ring over the raw system calls (<linux/io_uring.h> only, so no
// liburing package is needed). One ring per worker thread; never shared.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace ssdtrain {

class Uring {
 public:
  // Whether this kernel (and its seccomp policy / io_uring_disabled sysctl) lets us
  // create a ring that supports IORING_OP_READ and IORING_OP_WRITE. On false, `why`
  // says what failed.
  static bool probe(std::string* why);

  // Throws IoError when the ring cannot be set up.
  explicit Uring(unsigned entries);
  ~Uring();
  Uring(const Uring&) = delete;
  Uring& operator=(const Uring&) = delete;

  unsigned capacity() const noexcept { return sq_entries_; }

  // Queues a read (write=false) or write of `len` bytes at `buf` <-> file `offset`.
  // The caller keeps at most capacity() requests queued or in flight.
  void prepare(bool write, int fd, void* buf, unsigned len, std::uint64_t offset,
               std::uint64_t user_data) noexcept;

  // Submits what was prepared and waits until at least `wait_nr` completions are
  // ready. Throws IoError if io_uring_enter itself fails.
  void submit_and_wait(unsigned wait_nr);

  // Takes one completion if one is ready.
  bool pop(std::uint64_t* user_data, int* res) noexcept;

 private:
  int fd_ = -1;
  void* sq_ring_ = nullptr;
  std::size_t sq_ring_bytes_ = 0;
  void* cq_ring_ = nullptr;  // == sq_ring_ with IORING_FEAT_SINGLE_MMAP
  std::size_t cq_ring_bytes_ = 0;
  void* sqes_ = nullptr;
  std::size_t sqes_bytes_ = 0;

  unsigned sq_entries_ = 0;
  unsigned* sq_head_ = nullptr;
  unsigned* sq_tail_ = nullptr;
  unsigned* sq_mask_ = nullptr;
  unsigned* sq_array_ = nullptr;
  unsigned* cq_head_ = nullptr;
  unsigned* cq_tail_ = nullptr;
  unsigned* cq_mask_ = nullptr;
  void* cqes_ = nullptr;
  unsigned to_submit_ = 0;

  void release() noexcept;
};

}  // namespace ssdtrain
