// A torch-free, Python-free test of csrc/engine, built and run by `make asan-test`
// under -fsanitize=address,undefined with leak detection on (the Python suite runs
// with leak detection off, since CPython itself does not free everything at exit).
// Exits 0 when every check passes; prints the first failure otherwise.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/aligned_buffer.h"
#include "engine/crc32c.h"
#include "engine/engine.h"

namespace {

using ssdtrain::Backend;
using ssdtrain::Engine;
using ssdtrain::kBlock;
using ssdtrain::Op;

int failures = 0;

#define CHECK(cond)                                                        \
  do {                                                                     \
    if (!(cond)) {                                                         \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                          \
    }                                                                      \
  } while (0)

class PromiseCompletion : public ssdtrain::Completion {
 public:
  explicit PromiseCompletion(std::promise<std::pair<int, std::string>> p) : p_(std::move(p)) {}
  void complete(int err, const std::string& message) override { p_.set_value({err, message}); }

 private:
  std::promise<std::pair<int, std::string>> p_;
};

std::pair<int, std::string> run(Engine& e, Op op, int fd, bool direct, std::uint64_t offset,
                                char* address, std::size_t n) {
  std::promise<std::pair<int, std::string>> p;
  auto f = p.get_future();
  e.submit(op, fd, direct, offset, reinterpret_cast<std::uintptr_t>(address), n, "selftest",
           std::make_unique<PromiseCompletion>(std::move(p)));
  return f.get();
}

// A file in $TMPDIR (or /tmp), unlinked at once; O_DIRECT if asked and supported.
int temp_file(bool direct) {
  const char* dir = std::getenv("TMPDIR");
  std::string path = std::string(dir ? dir : "/tmp") + "/ssdtrain-selftest-XXXXXX";
  std::vector<char> name(path.begin(), path.end());
  name.push_back('\0');
  const int fd = mkostemp(name.data(), direct ? O_DIRECT : 0);
  if (fd >= 0) unlink(name.data());
  return fd;
}

void round_trips(Backend backend, bool direct, unsigned watch_us) {
  const int fd = temp_file(direct);
  if (fd < 0) {
    std::fprintf(stderr, "skip: no %s temp file (%s)\n", direct ? "O_DIRECT" : "buffered",
                 std::strerror(errno));
    return;
  }
  Engine engine(3, 8192, backend, watch_us);  // watch_us: NOTE [ Waking workers ]
  std::mt19937 rng(7);
  std::uint64_t next_block = 1;
  for (std::size_t n : {std::size_t{1}, std::size_t{4095}, std::size_t{4096}, std::size_t{4097},
                        std::size_t{100000}, std::size_t{1} << 20}) {
    for (std::size_t misalign : {0, 1, 64, 4095}) {
      ssdtrain::AlignedBuffer src(kBlock, n + 3 * kBlock), dst(kBlock, n + 3 * kBlock);
      char* s = src.data() + kBlock + misalign;  // a guard block before
      char* d = dst.data() + kBlock + misalign;
      for (std::size_t i = 0; i < n; ++i) s[i] = static_cast<char>(rng());
      std::memset(dst.data(), 0x5A, dst.size());
      const std::uint64_t offset = next_block * kBlock + misalign;
      next_block += (misalign + n + kBlock - 1) / kBlock + 1;
      CHECK(run(engine, Op::kWrite, fd, direct, offset, s, n).first == 0);
      CHECK(run(engine, Op::kRead, fd, direct, offset, d, n).first == 0);
      CHECK(std::memcmp(s, d, n) == 0);
      CHECK(static_cast<unsigned char>(d[-1]) == 0x5A);  // nothing written outside
      CHECK(static_cast<unsigned char>(d[n]) == 0x5A);
    }
  }
  // Past the end of the file: ENODATA, "truncated".
  ssdtrain::AlignedBuffer big(kBlock, 4 * kBlock);
  auto r = run(engine, Op::kRead, fd, direct, next_block * kBlock + kBlock, big.data(), kBlock);
  CHECK(r.first == ENODATA && r.second.find("truncated") != std::string::npos);
  // Requests still queued at shutdown are finished, not dropped.
  std::vector<std::future<std::pair<int, std::string>>> pending;
  for (int i = 0; i < 32; ++i) {
    std::promise<std::pair<int, std::string>> p;
    pending.push_back(p.get_future());
    engine.submit(Op::kWrite, fd, direct, (next_block + i) * kBlock,
                  reinterpret_cast<std::uintptr_t>(big.data()), kBlock, "selftest",
                  std::make_unique<PromiseCompletion>(std::move(p)));
  }
  engine.shutdown();
  for (auto& f : pending) CHECK(f.get().first == 0);
  close(fd);
  // A closed descriptor (a closed SpillFile passes -1; the old number may already be
  // reused, e.g. by the next engine's rings): EBADF, with errno in the message.
  Engine again(1, 8192, backend, watch_us);
  r = run(again, Op::kWrite, -1, direct, 0, big.data(), kBlock);
  CHECK(r.first == EBADF && r.second.find("errno 9") != std::string::npos);
}

void crc() {
  const char check[] = "123456789";
  CHECK(ssdtrain::crc32c(check, 9) == 0xE3069283u);
  CHECK(ssdtrain::crc32c_table(check, 9) == 0xE3069283u);
  CHECK(ssdtrain::crc32c(check + 4, 5, ssdtrain::crc32c(check, 4)) == 0xE3069283u);
}

}  // namespace

int main() {
  crc();
  std::string why;
  const bool uring = Engine::uring_available(&why);
  if (!uring) std::fprintf(stderr, "skip io_uring: %s\n", why.c_str());
  for (Backend b : {Backend::kThreads, Backend::kUring}) {
    if (b == Backend::kUring && !uring) continue;
    for (bool direct : {false, true}) {
      for (unsigned watch_us : {0u, 100u}) round_trips(b, direct, watch_us);
    }
  }
  if (failures != 0) {
    std::fprintf(stderr, "engine_selftest: %d check(s) failed\n", failures);
    return 1;
  }
  std::printf("engine_selftest: ok (io_uring %s)\n", uring ? "tested" : "skipped");
  return 0;
}
