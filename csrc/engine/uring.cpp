#include "engine/uring.h"

#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <vector>

#include "engine/io_error.h"

namespace ssdtrain {
namespace {

int sys_setup(unsigned entries, io_uring_params* p) {
  return static_cast<int>(syscall(__NR_io_uring_setup, entries, p));
}
int sys_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags) {
  return static_cast<int>(
      syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, nullptr, 0));
}
int sys_register(int fd, unsigned opcode, void* arg, unsigned nr_args) {
  return static_cast<int>(syscall(__NR_io_uring_register, fd, opcode, arg, nr_args));
}

unsigned load_acquire(const unsigned* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void store_release(unsigned* p, unsigned v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

template <typename T>
T* at(void* base, std::uint32_t offset) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + offset);
}

}  // namespace

bool Uring::probe(std::string* why) {
  try {
    Uring ring(4);
    const std::size_t bytes = sizeof(io_uring_probe) + 256 * sizeof(io_uring_probe_op);
    std::vector<unsigned char> storage(bytes, 0);  // zeroed, as the kernel requires
    auto* probe = reinterpret_cast<io_uring_probe*>(storage.data());
    if (sys_register(ring.fd_, IORING_REGISTER_PROBE, probe, 256) < 0) {
      if (why) *why = "IORING_REGISTER_PROBE failed: " + describe_errno(errno) + " (kernel < 5.6?)";
      return false;
    }
    for (unsigned op : {unsigned(IORING_OP_READ), unsigned(IORING_OP_WRITE)}) {
      if (op > probe->last_op || !(probe->ops[op].flags & IO_URING_OP_SUPPORTED)) {
        if (why) *why = "the kernel's io_uring lacks IORING_OP_READ/IORING_OP_WRITE";
        return false;
      }
    }
    // A no-op round trip: some sandboxes allow setup but fail or block enter.
    io_uring_sqe* sqe = static_cast<io_uring_sqe*>(ring.sqes_);
    const unsigned tail = *ring.sq_tail_;
    const unsigned idx = tail & *ring.sq_mask_;
    std::memset(&sqe[idx], 0, sizeof(io_uring_sqe));
    sqe[idx].opcode = IORING_OP_NOP;
    sqe[idx].user_data = 42;
    ring.sq_array_[idx] = idx;
    store_release(ring.sq_tail_, tail + 1);
    ring.to_submit_ = 1;
    ring.submit_and_wait(1);
    std::uint64_t ud = 0;
    int res = -1;
    if (!ring.pop(&ud, &res) || ud != 42 || res != 0) {
      if (why) *why = "an io_uring no-op did not complete";
      return false;
    }
  } catch (const IoError& e) {
    if (why) *why = e.what();
    return false;
  }
  if (why) why->clear();
  return true;
}

Uring::Uring(unsigned entries) {
  io_uring_params p;
  std::memset(&p, 0, sizeof p);
  fd_ = sys_setup(entries, &p);
  if (fd_ < 0) {
    throw IoError(errno, "io_uring_setup", 0, 0, "<io_uring>");
  }
  try {
    sq_ring_bytes_ = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    cq_ring_bytes_ = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
    const bool single = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
    if (single && cq_ring_bytes_ > sq_ring_bytes_) sq_ring_bytes_ = cq_ring_bytes_;
    sq_ring_ = mmap(nullptr, sq_ring_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE,
                    fd_, IORING_OFF_SQ_RING);
    if (sq_ring_ == MAP_FAILED) {
      sq_ring_ = nullptr;
      throw IoError(errno, "mmap of the io_uring submission ring", 0, sq_ring_bytes_, "<io_uring>");
    }
    if (single) {
      cq_ring_ = sq_ring_;
    } else {
      cq_ring_ = mmap(nullptr, cq_ring_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE,
                      fd_, IORING_OFF_CQ_RING);
      if (cq_ring_ == MAP_FAILED) {
        cq_ring_ = nullptr;
        throw IoError(errno, "mmap of the io_uring completion ring", 0, cq_ring_bytes_,
                      "<io_uring>");
      }
    }
    sqes_bytes_ = p.sq_entries * sizeof(io_uring_sqe);
    sqes_ = mmap(nullptr, sqes_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_,
                 IORING_OFF_SQES);
    if (sqes_ == MAP_FAILED) {
      sqes_ = nullptr;
      throw IoError(errno, "mmap of the io_uring submission entries", 0, sqes_bytes_,
                    "<io_uring>");
    }
  } catch (...) {
    release();
    throw;
  }
  sq_entries_ = p.sq_entries;
  sq_head_ = at<unsigned>(sq_ring_, p.sq_off.head);
  sq_tail_ = at<unsigned>(sq_ring_, p.sq_off.tail);
  sq_mask_ = at<unsigned>(sq_ring_, p.sq_off.ring_mask);
  sq_array_ = at<unsigned>(sq_ring_, p.sq_off.array);
  cq_head_ = at<unsigned>(cq_ring_, p.cq_off.head);
  cq_tail_ = at<unsigned>(cq_ring_, p.cq_off.tail);
  cq_mask_ = at<unsigned>(cq_ring_, p.cq_off.ring_mask);
  cqes_ = at<void>(cq_ring_, p.cq_off.cqes);
}

Uring::~Uring() { release(); }

void Uring::release() noexcept {
  if (sqes_ != nullptr) munmap(sqes_, sqes_bytes_);
  if (cq_ring_ != nullptr && cq_ring_ != sq_ring_) munmap(cq_ring_, cq_ring_bytes_);
  if (sq_ring_ != nullptr) munmap(sq_ring_, sq_ring_bytes_);
  sqes_ = cq_ring_ = sq_ring_ = nullptr;
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

void Uring::prepare(bool write, int fd, void* buf, unsigned len, std::uint64_t offset,
                    std::uint64_t user_data) noexcept {
  const unsigned tail = *sq_tail_;  // only this thread writes the tail
  const unsigned idx = tail & *sq_mask_;
  io_uring_sqe* sqe = static_cast<io_uring_sqe*>(sqes_) + idx;
  std::memset(sqe, 0, sizeof *sqe);
  sqe->opcode = write ? IORING_OP_WRITE : IORING_OP_READ;
  sqe->fd = fd;
  sqe->addr = reinterpret_cast<std::uint64_t>(buf);
  sqe->len = len;
  sqe->off = offset;
  sqe->user_data = user_data;
  sq_array_[idx] = idx;
  store_release(sq_tail_, tail + 1);
  ++to_submit_;
}

void Uring::submit_and_wait(unsigned wait_nr) {
  for (;;) {
    const int rc = sys_enter(fd_, to_submit_, wait_nr, IORING_ENTER_GETEVENTS);
    if (rc >= 0) {
      // The kernel consumed `rc` entries; any left stay queued for the next call.
      to_submit_ -= static_cast<unsigned>(rc) < to_submit_ ? static_cast<unsigned>(rc) : to_submit_;
      if (to_submit_ == 0 || load_acquire(cq_tail_) != *cq_head_) return;
      continue;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EBUSY) {
      // Out of kernel resources or completions backed up: wait for one and retry.
      if (load_acquire(cq_tail_) != *cq_head_) return;
      if (sys_enter(fd_, 0, 1, IORING_ENTER_GETEVENTS) < 0 && errno != EINTR) {
        throw IoError(errno, "io_uring_enter", 0, 0, "<io_uring>");
      }
      continue;
    }
    throw IoError(errno, "io_uring_enter", 0, 0, "<io_uring>");
  }
}

bool Uring::pop(std::uint64_t* user_data, int* res) noexcept {
  const unsigned head = *cq_head_;  // only this thread moves the head
  if (head == load_acquire(cq_tail_)) return false;
  const io_uring_cqe* cqe = static_cast<const io_uring_cqe*>(cqes_) + (head & *cq_mask_);
  *user_data = cqe->user_data;
  *res = cqe->res;
  store_release(cq_head_, head + 1);
  return true;
}

}  // namespace ssdtrain
