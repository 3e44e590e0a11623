#include "engine/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <nmmintrin.h>
#define SSDTRAIN_CRC_X86 1
#endif

namespace ssdtrain {
namespace {

constexpr std::uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

using Tables = std::array<std::array<std::uint32_t, 256>, 8>;

Tables make_tables() {
  Tables t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (kPoly & (0u - (c & 1u)));
    t[0][i] = c;
  }
  for (std::uint32_t i = 0; i < 256; ++i) {
    for (int k = 1; k < 8; ++k) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xFF];
  }
  return t;
}

const Tables& tables() {
  static const Tables t = make_tables();
  return t;
}

// The CRC register (no pre/post inversion) after `n` bytes at `p`, from `crc`: the
// table method, slice by 8.
std::uint32_t raw_table(std::uint32_t crc, const unsigned char* p, std::size_t n) noexcept {
  const Tables& t = tables();
  while (n >= 8) {  // little-endian words assembled byte by byte
    const std::uint32_t lo = crc ^ (std::uint32_t(p[0]) | std::uint32_t(p[1]) << 8 |
                                    std::uint32_t(p[2]) << 16 | std::uint32_t(p[3]) << 24);
    crc = t[7][lo & 0xFF] ^ t[6][(lo >> 8) & 0xFF] ^ t[5][(lo >> 16) & 0xFF] ^ t[4][lo >> 24] ^
          t[3][p[4]] ^ t[2][p[5]] ^ t[1][p[6]] ^ t[0][p[7]];
    p += 8;
    n -= 8;
  }
  while (n-- > 0) crc = (crc >> 8) ^ t[0][(crc ^ *p++) & 0xFF];
  return crc;
}

#ifdef SSDTRAIN_CRC_X86
// NOTE [ Three CRC streams ]
// One _mm_crc32_u64 chain runs at one instruction per 3 cycles (its latency): about
// 6.4 GB/s here. The loop below runs three independent chains over three adjacent
// lanes of kLane bytes each and joins them: the register is linear, so
//   reg(x, A || B) = shift(reg(x, A)) ^ reg(0, B),  shift(v) = reg(v, kLane zero bytes),
// and shift is a 32x32 matrix over GF(2), applied as 4 lookups in tables of 256
// entries built once from its 32 columns. Lanes of 8 KiB keep the join (8 lookups per
// 24 KiB) negligible and the three streams in the L1 cache's reach.
constexpr std::size_t kLane = 8192;

using ShiftTables = std::array<std::array<std::uint32_t, 256>, 4>;

ShiftTables make_shift() {
  static const std::array<unsigned char, kLane> zeros{};
  std::array<std::uint32_t, 32> column{};
  for (int i = 0; i < 32; ++i) column[i] = raw_table(1u << i, zeros.data(), kLane);
  ShiftTables t{};
  for (int k = 0; k < 4; ++k) {
    for (std::uint32_t b = 0; b < 256; ++b) {
      std::uint32_t v = 0;
      for (int j = 0; j < 8; ++j) {
        if (b & (1u << j)) v ^= column[8 * k + j];
      }
      t[k][b] = v;
    }
  }
  return t;
}

inline std::uint32_t shift(const ShiftTables& t, std::uint32_t v) noexcept {
  return t[0][v & 0xFF] ^ t[1][(v >> 8) & 0xFF] ^ t[2][(v >> 16) & 0xFF] ^ t[3][v >> 24];
}

// Compiled for SSE4.2 through the target attribute only, so the rest of the module
// (and this file) still runs on CPUs without it; only called after the CPU check.
__attribute__((target("sse4.2"))) std::uint32_t crc32c_sse42(std::uint32_t crc,
                                                             const unsigned char* p,
                                                             std::size_t n) noexcept {
  while (n > 0 && (reinterpret_cast<std::uintptr_t>(p) & 7u) != 0) {
    crc = _mm_crc32_u8(crc, *p++);
    --n;
  }
#if defined(__x86_64__)
  if (n >= 3 * kLane) {  // NOTE [ Three CRC streams ]
    static const ShiftTables t = make_shift();
    while (n >= 3 * kLane) {
      std::uint64_t c0 = crc, c1 = 0, c2 = 0;
      for (std::size_t i = 0; i < kLane; i += 8) {
        std::uint64_t w0, w1, w2;
        std::memcpy(&w0, p + i, 8);
        std::memcpy(&w1, p + kLane + i, 8);
        std::memcpy(&w2, p + 2 * kLane + i, 8);
        c0 = _mm_crc32_u64(c0, w0);
        c1 = _mm_crc32_u64(c1, w1);
        c2 = _mm_crc32_u64(c2, w2);
      }
      crc = shift(t, shift(t, static_cast<std::uint32_t>(c0)) ^
                         static_cast<std::uint32_t>(c1)) ^
            static_cast<std::uint32_t>(c2);
      p += 3 * kLane;
      n -= 3 * kLane;
    }
  }
  std::uint64_t c = crc;
  while (n >= 8) {
    std::uint64_t word;
    std::memcpy(&word, p, 8);
    c = _mm_crc32_u64(c, word);
    p += 8;
    n -= 8;
  }
  crc = static_cast<std::uint32_t>(c);
#endif
  while (n > 0) {
    crc = _mm_crc32_u8(crc, *p++);
    --n;
  }
  return crc;
}

bool detect_sse42() noexcept {
  __builtin_cpu_init();
  return __builtin_cpu_supports("sse4.2");
}
#endif

}  // namespace

bool crc32c_hardware() noexcept {
#ifdef SSDTRAIN_CRC_X86
  static const bool has = detect_sse42();
  return has;
#else
  return false;
#endif
}

std::uint32_t crc32c_table(const void* data, std::size_t nbytes, std::uint32_t seed) noexcept {
  return ~raw_table(~seed, static_cast<const unsigned char*>(data), nbytes);
}

std::uint32_t crc32c(const void* data, std::size_t nbytes, std::uint32_t seed) noexcept {
#ifdef SSDTRAIN_CRC_X86
  if (crc32c_hardware()) {
    return ~crc32c_sse42(~seed, static_cast<const unsigned char*>(data), nbytes);
  }
#endif
  return crc32c_table(data, nbytes, seed);
}

}  // namespace ssdtrain
