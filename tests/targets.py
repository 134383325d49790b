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
