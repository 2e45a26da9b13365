// Which code path each op runs: the CPU's features (probed once per process), OMFORGE_KERNELS_ISA (read once) and
// the one chooser every op's path table goes through (custom_op.cpp, lora_op.cpp, qgemm_op.cpp).
// Contract: a path is chosen only where the CPU has what it needs, so a forced value never picks a faster path than
// the CPU runs; the table's last path (the portable one) is always allowed. OMFORGE_KERNELS_ISA names the paths it
// allows per op (the tables list them): unset or empty, the fastest the CPU has; "amx", "avx512bf16", "avx512",
// "avxvnni", "avx2", "generic"; any other value is kOther (each table says what it allows).
#pragma once
#include <cstddef>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#define OMF_ISA_X86 1  // the x86 vector paths exist (their sources compile to nothing elsewhere)
#else
#define OMF_ISA_X86 0
#endif
#if OMF_ISA_X86 && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace omf::isa {

// OMFORGE_KERNELS_ISA's values, one bit each: a path allows a set of them
enum Forced : unsigned {
  kAuto = 1u << 0,  // unset or empty
  kAmx = 1u << 1,
  kAvx512Bf16 = 1u << 2,
  kAvx512 = 1u << 3,
  kAvxVnni = 1u << 4,
  kAvx2 = 1u << 5,
  kGeneric = 1u << 6,
  kOther = 1u << 7,  // a value not listed above
};
constexpr unsigned kAny = (1u << 8) - 1;

inline Forced parse_forced(const char* want) {
  if (want == nullptr || *want == '\0') return kAuto;
  constexpr struct { const char* name; Forced value; } kNames[] = {
      {"amx", kAmx}, {"avx512bf16", kAvx512Bf16}, {"avx512", kAvx512}, {"avxvnni", kAvxVnni}, {"avx2", kAvx2},
      {"generic", kGeneric}};
  for (const auto& n : kNames)
    if (std::strcmp(want, n.name) == 0) return n.value;
  return kOther;
}

// OMFORGE_KERNELS_ISA, read at the first call
inline Forced forced() {
  static const Forced f = parse_forced(std::getenv("OMFORGE_KERNELS_ISA"));
  return f;
}

// The CPU's features the paths need (all false off x86-64 GCC/Clang: only the portable paths run there).
struct Cpu {
  bool avx2 = false, fma = false, f16c = false, avxvnni = false;
  bool avx512f = false, avx512bw = false, avx512vnni = false, avx512bf16 = false;
  bool amx_tile = false, amx_int8 = false, amx_bf16 = false;
};

inline Cpu probe_cpu() {
  Cpu c;
#if OMF_ISA_X86
  __builtin_cpu_init();
  c.avx2 = __builtin_cpu_supports("avx2"), c.fma = __builtin_cpu_supports("fma");
  c.f16c = __builtin_cpu_supports("f16c"), c.avxvnni = __builtin_cpu_supports("avxvnni");
  c.avx512f = __builtin_cpu_supports("avx512f"), c.avx512bw = __builtin_cpu_supports("avx512bw");
  c.avx512vnni = __builtin_cpu_supports("avx512vnni"), c.avx512bf16 = __builtin_cpu_supports("avx512bf16");
  c.amx_tile = __builtin_cpu_supports("amx-tile"), c.amx_int8 = __builtin_cpu_supports("amx-int8");
  c.amx_bf16 = __builtin_cpu_supports("amx-bf16");
#endif
  return c;
}

inline const Cpu& cpu() {
  static const Cpu c = probe_cpu();
  return c;
}

// Linux's permission for the AMX tile data state (arch/x86/include/uapi/asm/prctl.h; Documentation/arch/x86/
// xstate.rst): a process asks once before its first tile instruction; the grant holds for all its threads. Asked
// at the first call, and only by a chooser whose AMX path is allowed and whose CPU has the tile unit.
inline bool tile_data_granted() {
#if OMF_ISA_X86 && defined(__linux__)
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtileData = 18;
  static const bool granted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtileData) == 0;
  return granted;
#else
  return false;
#endif
}

// AMX paths (bgemm_amx.cpp: tdpbf16ps; qgemm_amx.cpp: tdpbssd, its other rows on the AVX-512 VNNI path)
inline bool amx_bf16() { return cpu().amx_tile && cpu().amx_bf16 && tile_data_granted(); }
inline bool amx_int8() {
  return cpu().amx_tile && cpu().amx_int8 && cpu().avx512vnni && cpu().avx512bw && tile_data_granted();
}

// One path of an op: the forced values that allow it, whether this CPU runs it (asked only when allowed: the AMX
// probes ask the kernel for the tile data state) and the op's path (a struct with a `name` and its functions).
template <typename Path>
struct Candidate {
  unsigned allowed;
  bool (*runs_here)();
  Path path;
};

inline bool always() { return true; }

// The first path of `table` that OMFORGE_KERNELS_ISA allows and this CPU runs; the last one must be allowed always.
template <typename Path, size_t N>
Path choose(const Candidate<Path> (&table)[N]) {
  for (size_t i = 0; i + 1 < N; ++i)
    if ((table[i].allowed & forced()) != 0 && table[i].runs_here()) return table[i].path;
  return table[N - 1].path;
}

}  // namespace omf::isa
