#include "engine/engine.h"
#include "engine/crc32c.h"

#include <fcntl.h>
#include <pthread.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <utility>

#include "engine/aligned_buffer.h"
#include "engine/io_error.h"
#include "engine/uring.h"

namespace ssdtrain {
namespace {

constexpr std::size_t kMaxSyscallBytes = std::size_t{1} << 30;  // Linux caps one call at ~2 GiB
// One SQE moves at most this. As large as one system call of the thread pool: with 1 MiB
// SQEs, writing into a fresh spill file cost twice the CPU per byte of the thread pool
// (each SQE's non-blocking attempt fails on an extending O_DIRECT write and is redone
// by an io-wq worker); with whole pieces (<= chunk_bytes) one SQE does the piece and
// the two back ends cost about the same (see ssdtrain/io/native.py, "auto").
constexpr std::size_t kUringSegmentBytes = kMaxSyscallBytes;
constexpr unsigned kRingEntries = 64;  // SQEs in flight per worker
// NOTE [ Waking workers ]: how long after the last piece any worker took one keeps watching.
constexpr std::chrono::milliseconds kWatchLinger{2};

std::uint64_t align_down(std::uint64_t x, std::uint64_t a = kBlock) { return x - x % a; }
std::uint64_t align_up(std::uint64_t x, std::uint64_t a = kBlock) { return align_down(x + a - 1, a); }

struct Request {
  Op op;
  int fd;
  bool direct;
  std::uint64_t offset;
  std::uintptr_t address;
  std::size_t nbytes;
  std::string path;
  std::unique_ptr<Completion> done;

  std::mutex mu;
  std::size_t remaining = 0;  // pieces not yet finished
  int err = 0;                // the first failure wins
  std::string message;
};

struct Piece {
  std::shared_ptr<Request> request;
  std::uint64_t offset;
  std::uintptr_t address;
  std::size_t nbytes;
};

// One contiguous file range moved by one system call (or one SQE, resubmitted on short I/O).
struct Segment {
  char* buf;
  std::size_t len;
  std::uint64_t offset;
  std::size_t done = 0;
};

// A partial O_DIRECT edge block: `len` caller bytes at `user` <-> `bounce`.
struct EdgeCopy {
  char* user;
  char* bounce;
  std::size_t len;
};

// What each worker owns: two bounce blocks (head and tail edges can be in flight at
// once on io_uring) and, on the io_uring back end, its ring.
struct Worker {
  AlignedBuffer head{kBlock, kBlock};
  AlignedBuffer tail{kBlock, kBlock};
  std::unique_ptr<Uring> ring;
};

// Moves all `len` bytes between `buf` and `fd` at `offset` (a pwrite for Op::kWrite, else
// a pread), call after call: one call may move less than asked.
void transfer_all(Op op, int fd, char* buf, std::size_t len, std::uint64_t offset,
                  const std::string& path) {
  const bool write = op == Op::kWrite;
  const char* name = write ? "pwrite" : "pread";
  std::size_t done = 0;
  while (done < len) {
    const std::size_t want = std::min(len - done, kMaxSyscallBytes);
    const auto at = static_cast<off_t>(offset + done);
    const ssize_t n = write ? pwrite(fd, buf + done, want, at) : pread(fd, buf + done, want, at);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw IoError(errno, name, offset + done, len - done, path);
    }
    if (n == 0) {
      const std::string count = std::to_string(done) + " of " + std::to_string(len) + " bytes";
      if (write) {
        throw IoError(EIO, name, offset + done, len - done, path, "short write (" + count + ")");
      }
      // End of file: the spill file is shorter than what was written to it. ENODATA
      // tells the Python side to raise IntegrityError rather than SpillIOError.
      throw IoError(ENODATA, name, offset + done, len - done, path,
                    "short read (" + count + "): spill data truncated");
    }
    done += static_cast<std::size_t>(n);
  }
}

// Splits [address, address + nbytes) of a piece into system-call segments. On O_DIRECT
// files the partial first and last blocks go through the worker's bounce blocks
// (whole blocks: each slot owns its edge blocks); the aligned middle is used in place.
void plan(const Piece& p, Worker& w, std::size_t max_segment, std::vector<Segment>* segments,
          std::vector<EdgeCopy>* edges) {
  char* const base = reinterpret_cast<char*>(p.address);
  auto add_range = [&](std::uintptr_t start, std::uintptr_t stop) {
    while (start < stop) {
      const std::size_t len = std::min<std::size_t>(stop - start, max_segment);
      segments->push_back({base + (start - p.address), len, p.offset + (start - p.address)});
      start += len;
    }
  };
  const std::uintptr_t end = p.address + p.nbytes;
  if (!p.request->direct) {
    add_range(p.address, end);
    return;
  }
  std::uintptr_t lo = align_up(p.address), hi = align_down(end);
  if (lo > hi) lo = hi = end;  // starts and ends inside one block
  auto add_edge = [&](std::uintptr_t start, std::uintptr_t stop, AlignedBuffer& bounce) {
    if (start >= stop) return;
    const std::uintptr_t block = align_down(start);
    char* b = bounce.data() + (start - block);
    edges->push_back({base + (start - p.address), b, stop - start});
    // offset ≡ address (mod kBlock), so the block's file offset is >= 0 and aligned.
    segments->push_back({bounce.data(), kBlock, p.offset - (p.address - block)});
  };
  add_edge(p.address, lo, w.head);
  add_range(lo, hi);
  add_edge(hi, end, w.tail);
}

void run_threads(const Piece& p, const std::vector<Segment>& segments) {
  const Request& r = *p.request;
  for (const Segment& s : segments) transfer_all(r.op, r.fd, s.buf, s.len, s.offset, r.path);
}

// Keeps up to the ring's capacity of segments in flight; a short transfer is
// resubmitted for its remainder. On failure, nothing new is submitted, but the
// function returns only after every submitted SQE has completed: the kernel may
// still be using the memory until then.
void run_uring(Uring& ring, const Piece& p, std::vector<Segment>& segments) {
  const Request& r = *p.request;
  const bool write = r.op == Op::kWrite;
  const char* op = write ? "io_uring write" : "io_uring read";
  std::vector<std::size_t> retry;
  std::unique_ptr<IoError> failure;
  std::size_t next = 0;
  unsigned inflight = 0;
  for (;;) {
    while (!failure && inflight < ring.capacity() && (!retry.empty() || next < segments.size())) {
      std::size_t i;
      if (!retry.empty()) {
        i = retry.back();
        retry.pop_back();
      } else {
        i = next++;
      }
      Segment& s = segments[i];
      ring.prepare(write, r.fd, s.buf + s.done, static_cast<unsigned>(s.len - s.done),
                   s.offset + s.done, i);
      ++inflight;
    }
    if (inflight == 0) break;
    ring.submit_and_wait(1);
    std::uint64_t i;
    int res;
    while (ring.pop(&i, &res)) {
      --inflight;
      Segment& s = segments[i];
      if (failure) continue;
      if (res == -EINTR || res == -EAGAIN) {
        retry.push_back(i);
      } else if (res < 0) {
        failure = std::make_unique<IoError>(-res, op, s.offset + s.done, s.len - s.done, r.path);
      } else if (res == 0) {
        failure = std::make_unique<IoError>(
            write ? EIO : ENODATA, op, s.offset + s.done, s.len - s.done, r.path,
            std::string(write ? "short write (" : "short read (") + std::to_string(s.done) +
                " of " + std::to_string(s.len) + " bytes)" +
                (write ? "" : ": spill data truncated"));
      } else {
        s.done += static_cast<std::size_t>(res);
        if (s.done < s.len) retry.push_back(i);
      }
    }
  }
  if (failure) throw *failure;
}

// Buffered files: write the record's dirty pages out and wait for them, then drop its
// pages (whole blocks: DONTNEED skips partial pages, and the slot owns every block it
// touches) so spilled data really leaves RAM. Same steps as the posix engine.
// NOTE [ Range sync in buffered mode ]: sync_file_range on the record's own blocks,
// not fdatasync: fdatasync waits for every dirty page of the shared spill file (other
// records' writes in flight included) and flushes the device cache, once per record.
// Spill data need not survive a crash (the file is anonymous), only leave the page
// cache, which needs its pages clean: WAIT_BEFORE | WRITE | WAIT_AFTER starts writeback
// of the range and waits for it, and reports a writeback error (EIO, ENOSPC) as
// fdatasync would.
void finish_buffered(const Request& r) {
  const std::uint64_t start = align_down(r.offset);
  const std::uint64_t len = align_up(r.offset + r.nbytes) - start;
  if (r.op == Op::kWrite && len > 0 &&
      sync_file_range(r.fd, static_cast<off64_t>(start), static_cast<off64_t>(len),
                      SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE |
                          SYNC_FILE_RANGE_WAIT_AFTER) != 0) {
    throw IoError(errno, "sync_file_range", r.offset, r.nbytes, r.path);
  }
  const int rc = posix_fadvise(r.fd, static_cast<off_t>(start), static_cast<off_t>(len),
                               POSIX_FADV_DONTNEED);
  if (rc != 0) throw IoError(rc, "posix_fadvise(DONTNEED)", r.offset, r.nbytes, r.path);
}

void piece_done(Request& r, int err, const std::string& message) {
  {
    std::lock_guard<std::mutex> lock(r.mu);
    if (err != 0 && r.err == 0) {
      r.err = err;
      r.message = message;
    }
    if (--r.remaining > 0) return;
  }
  // The last piece: no other worker touches the request any more.
  if (r.err == 0 && !r.direct) {
    try {
      finish_buffered(r);
    } catch (const IoError& e) {
      r.err = e.err();
      r.message = e.what();
    }
  }
  std::unique_ptr<Completion> done = std::move(r.done);
  if (r.err == 0 && done->want_crc) {
    done->crc = crc32c(reinterpret_cast<const void*>(r.address), r.nbytes, 0);
  }
  done->complete(r.err, r.message);
}

void run_piece(Worker& w, const Piece& p) {
  int err = 0;
  std::string message;
  try {
    std::vector<Segment> segments;
    std::vector<EdgeCopy> edges;
    plan(p, w, w.ring ? kUringSegmentBytes : kMaxSyscallBytes, &segments, &edges);
    const bool write = p.request->op == Op::kWrite;
    if (write) {
      for (const EdgeCopy& e : edges) {
        std::memset(e.bounce - (reinterpret_cast<std::uintptr_t>(e.user) % kBlock), 0, kBlock);
        std::memcpy(e.bounce, e.user, e.len);
      }
    }
    if (w.ring) {
      run_uring(*w.ring, p, segments);
    } else {
      run_threads(p, segments);
    }
    if (!write) {
      for (const EdgeCopy& e : edges) std::memcpy(e.user, e.bounce, e.len);
    }
  } catch (const IoError& e) {
    err = e.err();
    message = e.what();
  } catch (const std::exception& e) {
    err = EIO;
    message = std::string("internal error in the native engine: ") + e.what() + "; please report";
  }
  piece_done(*p.request, err, message);
}

}  // namespace

struct Engine::State {
  std::mutex mu;
  std::condition_variable work;     // a piece was queued, or stopping was set
  std::condition_variable drained;  // a worker exited
  std::deque<Piece> queue;
  bool stopping = false;
  unsigned running = 0;  // workers not yet exited
  unsigned idle = 0;     // workers waiting on `work` (NOTE [ Waking workers ])
  unsigned watching = 0; // a worker that looks at the queue every `watch` (same NOTE)
  std::chrono::microseconds watch{0};  // the watch's period; 0: no watch
  std::chrono::steady_clock::time_point last_taken{};  // when a worker last took a piece
  std::uint64_t wakes = 0;  // notifies by submit() (the submitting thread's futex calls)
  Backend backend = Backend::kThreads;
  std::size_t chunk_bytes = 0;
  std::vector<std::unique_ptr<Worker>> workers;
};

namespace {

// The engine whose worker this thread is, if any (see Engine::shutdown).
thread_local const Engine::State* tls_worker_of = nullptr;

// Holds the shared state, so a detached worker (see Engine::shutdown) keeps it alive.
void worker_main(std::shared_ptr<Engine::State> s, std::size_t index) {
  tls_worker_of = s.get();  // named "ssdtrain-io" by the constructor (Engine::Engine)
#ifdef __linux__
  // The watch's sleeps end on time, not up to the default 50 us of slack later.
  prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL);
#endif
  Worker& w = *s->workers[index];
  std::unique_lock<std::mutex> lock(s->mu);
  for (;;) {
    if (s->queue.empty() && !s->stopping) {
      // NOTE [ Waking workers ]: while requests keep coming, one idle worker watches
      // the queue, so that a submit finds a watch and wakes nobody.
      if (s->watching == 0 && s->watch.count() > 0 &&
          std::chrono::steady_clock::now() - s->last_taken < kWatchLinger) {
        ++s->watching;
        lock.unlock();
        std::this_thread::sleep_for(s->watch);
        lock.lock();
        --s->watching;
        continue;
      }
      ++s->idle;
      s->work.wait(lock, [&] { return s->stopping || !s->queue.empty(); });
      --s->idle;
    }
    if (s->queue.empty()) break;  // stopping, and every queued piece is done
    Piece p = std::move(s->queue.front());
    s->queue.pop_front();
    s->last_taken = std::chrono::steady_clock::now();
    // More queued than this worker takes (a request in several pieces, or submits that
    // found the watch): it wakes one more, on its own time, not the submitter's.
    const bool more = !s->queue.empty() && s->idle > 0;
    lock.unlock();
    if (more) s->work.notify_one();
    run_piece(w, p);
    lock.lock();
  }
  --s->running;
  s->drained.notify_all();
}

}  // namespace

bool Engine::uring_available(std::string* why) {
  static const std::pair<bool, std::string> probed = [] {
    std::string reason;
    const bool ok = Uring::probe(&reason);
    return std::make_pair(ok, reason);
  }();
  if (why) *why = probed.second;
  return probed.first;
}

const char* Engine::backend_name(Backend b) noexcept {
  switch (b) {
    case Backend::kUring: return "uring";
    case Backend::kThreads: return "threads";
    case Backend::kAuto: return "auto";
  }
  return "?";
}

Engine::Engine(int threads, std::size_t chunk_bytes, Backend backend, unsigned watch_us)
    : state_(std::make_shared<State>()) {
  if (threads < 1 || threads > 1024) {
    throw std::invalid_argument("threads must be in [1, 1024], got " + std::to_string(threads));
  }
  if (chunk_bytes == 0 || chunk_bytes % kBlock != 0) {
    throw std::invalid_argument("chunk_bytes must be a positive multiple of " +
                                std::to_string(kBlock) + ", got " + std::to_string(chunk_bytes));
  }
  if (watch_us > 100000) {
    throw std::invalid_argument("watch_us must be in [0, 100000], got " +
                                std::to_string(watch_us));
  }
  state_->chunk_bytes = chunk_bytes;
  state_->watch = std::chrono::microseconds(watch_us);
  Backend chosen = Backend::kThreads;
  if (backend != Backend::kThreads) {
    std::string why;
    if (uring_available(&why)) {
      chosen = Backend::kUring;
    } else if (backend == Backend::kUring) {
      throw std::runtime_error("io_uring is not usable here: " + why);
    }
  }
  for (int i = 0; i < threads; ++i) {
    auto w = std::make_unique<Worker>();
    if (chosen == Backend::kUring) {
      try {
        w->ring = std::make_unique<Uring>(kRingEntries);
      } catch (const IoError& e) {  // e.g. RLIMIT_MEMLOCK on old kernels
        if (backend == Backend::kUring) {
          throw std::runtime_error(std::string("io_uring is not usable here: ") + e.what());
        }
        chosen = Backend::kThreads;
        for (auto& other : state_->workers) other->ring.reset();
      }
    }
    state_->workers.push_back(std::move(w));
  }
  state_->backend = chosen;
  try {
    for (int i = 0; i < threads; ++i) {
      {
        std::lock_guard<std::mutex> lock(state_->mu);
        ++state_->running;
      }
      try {
        threads_.emplace_back(worker_main, state_, static_cast<std::size_t>(i));
#ifdef __linux__
        // Named as the posix engine's threads are, so top, perf, py-spy and profilers
        // (and benchmarks/step_overhead.py's I/O-thread CPU column) can tell them from
        // compute. Named here, not by the worker itself: the name is then there when the
        // constructor returns, not whenever the new thread first runs (on a loaded
        // machine, after tools and tests had looked).
        pthread_setname_np(threads_.back().native_handle(), "ssdtrain-io");
#endif
      } catch (const std::system_error& e) {
        // pthread_create's errno (EAGAIN: a limit of threads, or no memory for a stack),
        // kept as the code so the binding raises OSError(errno) and Python names the
        // cause (not a back end that "cannot start").
        throw std::system_error(e.code(), "starting I/O worker thread " + std::to_string(i + 1) +
                                              " of " + std::to_string(threads));
      }
    }
  } catch (...) {
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      --state_->running;  // the thread that failed to start
    }
    shutdown();
    throw;
  }
}

Engine::~Engine() { shutdown(); }

std::uint64_t Engine::wakes() const {
  if (abandoned_.load()) return 0;
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->wakes;
}

void Engine::abandon() noexcept {
  if (abandoned_.exchange(true)) return;
  // Leaked on purpose (see the declaration): neither vector nor state is ever destroyed.
  auto* threads = new (std::nothrow) std::vector<std::thread>(std::move(threads_));
  if (threads == nullptr) {
    // Out of memory: end the vector's lifetime by reusing its storage, which forgets
    // the std::thread objects without running their destructors.
    new (&threads_) std::vector<std::thread>();
  }
  // The workers' own copies (on their stacks, copied into this process but never
  // unwound) already keep the state alive; this one says so explicitly.
  (void)new (std::nothrow) std::shared_ptr<State>(state_);
}

bool Engine::abandoned() const noexcept { return abandoned_.load(); }

Backend Engine::backend() const noexcept { return state_->backend; }

bool Engine::on_worker_thread() const noexcept { return tls_worker_of == state_.get(); }

void Engine::submit(Op op, int fd, bool direct, std::uint64_t offset, std::uintptr_t address,
                    std::size_t nbytes, std::string path, std::unique_ptr<Completion> done) {
  if (direct && offset % kBlock != address % kBlock) {
    throw std::invalid_argument("O_DIRECT request with offset " + std::to_string(offset) +
                                " not congruent to address " + std::to_string(address) +
                                " modulo " + std::to_string(kBlock));
  }
  if (!done) throw std::invalid_argument("a request needs a completion");
  if (abandoned_.load()) {
    throw std::runtime_error("ssdtrain: the native I/O engine was abandoned (it belongs to the "
                             "process this one was forked from); create a new engine here");
  }
  auto r = std::make_shared<Request>();
  r->op = op;
  r->fd = fd;
  r->direct = direct;
  r->offset = offset;
  r->address = address;
  r->nbytes = nbytes;
  r->path = std::move(path);
  r->done = std::move(done);
  std::vector<Piece> pieces;
  const std::size_t chunk = state_->chunk_bytes;
  std::uintptr_t start = address;
  const std::uintptr_t end = address + nbytes;
  do {  // an empty request is one empty piece, so it completes (and syncs) like any other
    const std::uintptr_t stop = std::min<std::uintptr_t>(align_down(start + chunk, chunk), end);
    pieces.push_back({r, offset + (start - address), start, stop - start});
    start = stop;
  } while (start < end);
  r->remaining = pieces.size();
  unsigned idle, watching;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (state_->stopping) {
      throw std::runtime_error("ssdtrain: the native I/O engine was shut down; no request can be "
                               "submitted after shutdown()");
    }
    for (Piece& p : pieces) state_->queue.push_back(std::move(p));
    idle = state_->idle;
    watching = state_->watching;
    if (idle > 0 && watching == 0) ++state_->wakes;
  }
  // NOTE [ Waking workers ]
  // A wake-up is a futex system call, and on a virtual machine a cross-CPU wake is
  // costly (measured here: 30-200 us of the submitting thread, the training thread,
  // when the woken worker takes its CPU; 12 us a submit at the median in
  // tools/launch_breakdown.py's loop, 2026-11-28). So the submitter wakes a worker only
  // when nobody would otherwise look at the queue:
  // * A busy worker takes the next piece when it is done (it looks at the queue under
  //   `mu` before it waits): while every worker is busy a submit queues and returns.
  // * The watch: with `watch_us` set, a worker that finds the queue empty within
  //   kWatchLinger of the last piece any worker took sleeps `watch_us` (with 1 ns of
  //   timer slack) and looks again, instead of waiting on `work`; one worker at a time
  //   (`watching`). A submit that finds a watch queues and returns, and the piece waits
  //   at most `watch_us` to start. While requests keep coming (a training step's saves,
  //   milliseconds apart at most) the training thread wakes nobody; the watch's timer
  //   wakes run on the I/O workers' time (about 6% of a core with saves 0.5 ms apart,
  //   docs/results/launch_loop_watch_cpu_2026-11-28.md). After kWatchLinger without a
  //   piece the watch waits on `work` like the others, and the next submit wakes it.
  // * A worker that takes a piece and leaves more queued wakes one more idle worker
  //   itself (a request in several pieces, or submits that found the watch).
  // `idle` and `watching` are read under `mu`, where workers change them, and a watch
  // looks at the queue under the same hold of `mu` in which it stops watching, so no
  // piece is left in the queue with every worker asleep. `wakes` counts the submits'
  // notifies (tests/test_native_engine.py checks a steady stream makes none).
  if (idle == 0 || watching > 0) return;
  if (pieces.size() == 1) {
    state_->work.notify_one();
  } else {
    state_->work.notify_all();
  }
}

void Engine::shutdown() {
  if (abandoned_.load()) return;  // a forked child: no worker to stop (see abandon())
  std::vector<std::thread> mine;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->stopping = true;
    mine.swap(threads_);  // a concurrent shutdown() gets none and only waits below
  }
  state_->work.notify_all();
  if (on_worker_thread()) {
    // Called from inside a completion (e.g. the last reference to the engine dropped
    // there). A worker cannot join itself, nor wait for the others while they may
    // wait for it: detach them; they finish the queue and exit on their own.
    for (std::thread& t : mine) t.detach();
    return;
  }
  for (std::thread& t : mine) t.join();
  // Also waits for workers that another caller took (or a worker detached).
  std::unique_lock<std::mutex> lock(state_->mu);
  state_->drained.wait(lock, [&] { return state_->running == 0; });
}

}  // namespace ssdtrain
