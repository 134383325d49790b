"""Fixed CPU targets for tests whose expectations must not move with the machine they run on."""
from maco import MemoryLevel, Target

# The AVX2 machine the CPU expectations were written on (AMD Zen 3: 16 ymm, 32K L1, 512K L2, 32M L3).
AVX2 = Target("avx2-zen3", "cpu",
              (MemoryLevel("registers", 16 * 8 * 4, 1, 8), MemoryLevel("L1", 32 << 10, 1, 8),
               MemoryLevel("L2", 512 << 10, 1, 8), MemoryLevel("L3", 32 << 20, 2, 8)),
              cores=2, simd_width=8, isa="avx2", freq_ghz=2.45, fma_units=2, model="AMD EPYC (Zen 3)")
# A CPU without intrinsics: every kernel is the portable C.
GENERIC = Target("generic-sse", "cpu", (MemoryLevel("registers", 16 * 4 * 4, 1, 4),
                                        MemoryLevel("L1", 32 << 10, 1, 4), MemoryLevel("L2", 1 << 20, 1, 4)),
                 cores=2, simd_width=4, isa="generic")
# The AVX-512 machine the filter-heavy split was written on (Intel Xeon VM: 32 zmm, 48K L1, 2M L2).
AVX512 = Target("avx512-xeon", "cpu",
                (MemoryLevel("registers", 32 * 16 * 4, 1, 16), MemoryLevel("L1", 48 << 10, 1, 16),
                 MemoryLevel("L2", 2 << 20, 1, 16), MemoryLevel("L3", 32 << 20, 2, 16)),
                cores=2, simd_width=16, isa="avx512", freq_ghz=2.1, fma_units=2, model="Intel Xeon (AVX-512)")
