// CRC32C (Castagnoli, reflected polynomial 0x82F63B78), as used by iSCSI, ext4 and
// the `crc32c` Python package: crc32c("123456789") == 0xE3069283.
//
// `seed` is a previous result, so crc32c(b, crc32c(a)) == crc32c(a + b).
#pragma once

#include <cstddef>
#include <cstdint>

namespace ssdtrain {

// SSE4.2 `crc32` instruction where the CPU has it (checked once at run time), else
// the table implementation. Safe to call concurrently.
std::uint32_t crc32c(const void* data, std::size_t nbytes, std::uint32_t seed = 0) noexcept;

// The portable implementation (slice-by-8 tables), exposed so tests cover it on
// machines that take the hardware path.
std::uint32_t crc32c_table(const void* data, std::size_t nbytes, std::uint32_t seed = 0) noexcept;

// Whether crc32c() uses the hardware instruction on this CPU.
bool crc32c_hardware() noexcept;

}  // namespace ssdtrain
