// The native I/O engine: moves byte ranges between memory and files on a pool of
// worker threads, submitting through io_uring where the kernel allows it and plain
// pread/pwrite otherwise. Torch-free and Python-free; csrc/binding.cpp wraps it.
//
// A request is split into pieces at address multiples of `chunk_bytes`, so several
// workers share a large request. On O_DIRECT files the file offset must be congruent
// to the address modulo kBlock (NOTE [ Zero-copy O_DIRECT from unaligned tensors ] in
// docs/ARCHITECTURE.md): the aligned middle moves straight between the caller's
// memory and the disk, and only the partial first and last blocks pass through a
// per-worker aligned bounce block. On buffered files a write ends with sync_file_range
// on its own blocks and POSIX_FADV_DONTNEED, a read with POSIX_FADV_DONTNEED, as the
// posix engine does (NOTE [ Range sync in buffered mode ] in engine.cpp).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace ssdtrain {

enum class Op { kRead, kWrite };
enum class Backend { kAuto, kUring, kThreads };

// How a request reports its end. complete() is called exactly once, on a worker
// thread, with errno 0 and an empty message on success. It must not throw; it is not
// noexcept only so that a thread ended by pthread_exit inside it (CPython does that to
// a thread taking the GIL while the interpreter finalizes) unwinds instead of aborting.
class Completion {
 public:
  virtual ~Completion() = default;
  virtual void complete(int err, const std::string& message) = 0;

  // Set by the submitter: when the request succeeds, the worker that finishes it
  // stores the CRC32C of the request's bytes (written, or read) in `crc` before it
  // calls complete(), so a checksum costs the caller no thread of its own.
  bool want_crc = false;
  std::uint32_t crc = 0;
};

class Engine {
 public:
  // Throws std::invalid_argument for bad arguments, std::runtime_error when
  // `backend` is kUring and io_uring cannot be used here (the reason is in what()).
  // `watch_us`: while requests keep coming, one idle worker looks at the queue every
  // `watch_us` microseconds, and a submit that finds it wakes nobody (0: never; NOTE
  // [ Waking workers ] in engine.cpp).
  Engine(int threads, std::size_t chunk_bytes, Backend backend, unsigned watch_us = 0);
  // Shuts down (see shutdown()).
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queues a request; never blocks on I/O. The memory at `address` must stay valid
  // until `done` is completed. Throws std::invalid_argument for a non-congruent
  // O_DIRECT request and std::runtime_error after shutdown().
  void submit(Op op, int fd, bool direct, std::uint64_t offset, std::uintptr_t address,
              std::size_t nbytes, std::string path, std::unique_ptr<Completion> done);

  // Refuses new requests, lets the workers finish every queued one (each completion
  // is called) and joins them. Idempotent. Called from a worker thread (from inside
  // a completion), it cannot join that thread: the workers are then detached and
  // finish the queue on their own, keeping the state they share alive.
  void shutdown();

  // For a forked child (see NOTE [ Engines after fork ] in ssdtrain/_fork.py): the
  // workers are threads of the parent and do not exist here, and the shared state's
  // mutex may have been copied locked (a worker held it at the fork) and its condition
  // variables with waiters that will never wake. So this touches neither: the
  // std::thread objects are moved into a deliberately leaked heap vector (their
  // destructors, which would std::terminate on a joinable thread, never run), one
  // reference to the shared state is leaked too (it is never destroyed: destroying a
  // condition variable with waiters can block forever), and the engine is marked
  // abandoned: submit() then throws std::runtime_error, and shutdown() and the
  // destructor return at once. Requests queued before the fork are never completed
  // (their completions are leaked with the state). Never blocks, never throws;
  // idempotent. Calling it in a process whose workers are alive leaks them running.
  void abandon() noexcept;
  bool abandoned() const noexcept;

  Backend backend() const noexcept;

  // How many times submit() woke a worker (a futex call on the submitting thread).
  std::uint64_t wakes() const;

  // Whether the calling thread is one of this engine's workers (then shutdown() and
  // the destructor detach the workers instead of joining them, and never block).
  bool on_worker_thread() const noexcept;
  static const char* backend_name(Backend b) noexcept;

  // Whether io_uring works here; on false, `why` says what failed. Probed once.
  static bool uring_available(std::string* why);

  struct State;  // shared by the engine and its workers (engine.cpp)

 private:
  std::shared_ptr<State> state_;
  std::vector<std::thread> threads_;
  // Read without state_->mu, which abandon() must not take (see there).
  std::atomic<bool> abandoned_{false};
};

}  // namespace ssdtrain
