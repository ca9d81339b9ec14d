// What every AMX kernel of the library needs before its first tile product: the tile registers
// granted by Linux, and a tile configuration. Linux gives the AMX tile data state (XTILEDATA) only
// to a process that asks for it (arch_prctl ARCH_REQ_XCOMP_PERM); the kernels (cpu_gguf_amx.cpp's
// int8 tiles, cpu_f16_amx_gemm.cpp's bf16 tiles) configure all eight tiles as 16 rows of 64 bytes,
// the 32-weight types' (cpu_gguf_amx32.h) with their own shapes, and give each tile its role in
// their own comments.
//
// Included inside each kernel's `#pragma GCC target("...amx-tile...")` region, after
// <immintrin.h>, <sys/syscall.h> and <unistd.h>: the functions below are compiled for AMX there.
#pragma once

#include <cstdint>

namespace minivllm_amx {

// LDTILECFG's 64 bytes: palette 1, then each tile's bytes per row and rows.
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0..7, each 16 rows x 64 bytes, on the calling thread (until _tile_release).
inline void configure_tiles() {
  alignas(64) TileConfig c;
  for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  _tile_loadconfig(&c);
}

// Tiles 0..7 shaped rows[t] x colsb[t] bytes (the 32-weight types' tiles multiply 32 bytes a row:
// cpu_gguf_amx32.h), on the calling thread (until _tile_release).
inline void configure_tiles(const uint8_t (&rows)[8], const uint16_t (&colsb)[8]) {
  alignas(64) TileConfig c;
  for (int t = 0; t < 8; ++t) c.rows[t] = rows[t], c.colsb[t] = colsb[t];
  _tile_loadconfig(&c);
}

// Whether Linux grants this process the tile data state; asking again is harmless.
inline bool tile_data_granted() {
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
}

}  // namespace minivllm_amx
