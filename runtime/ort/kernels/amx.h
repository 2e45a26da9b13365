// What both AMX kernels (bgemm_amx.cpp, qgemm_amx.cpp) need from the platform: palette 1's tile configuration loaded
// safely (Linux's permission for the tile data state is asked by the chooser: isa.h tile_data_granted). Include only
// inside `#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)`.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace omf::amx {

struct alignas(64) TileConfig {  // palette 1's 64-byte layout (Intel SDM, LDTILECFG)
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// a zeroed palette-1 configuration: the caller sets rows[t] and colsb[t] of the tiles it uses
inline TileConfig palette1() {
  TileConfig c;
  std::memset(&c, 0, sizeof c);
  c.palette = 1;
  return c;
}

// ldtilecfg. GCC 12's _tile_loadconfig tells the compiler it reads 8 bytes of the 64: without the barrier the
// stores to the rest may be dropped or sunk past it at -O2 (seen: a #GP on ldtilecfg in a benchmark's loop)
__attribute__((target("amx-tile"))) inline void load(const TileConfig& c) {
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

}  // namespace omf::amx
