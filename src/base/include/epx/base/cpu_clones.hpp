// EPX_CPU_CLONES: compile a hot loop's function for AVX-512 (x86-64-v4), AVX2 (x86-64-v3) and the
// baseline, the variant picked at load time for the CPU it runs on (GCC target_clones), since the
// build cannot assume the ISA. A file using it is built with -ffp-contract=off (src/CMakeLists.txt):
// the variants then run the same IEEE operations in the same order, so results do not depend on
// the CPU. Keep the clone's body free of OpenMP (call it from inside the parallel loop).
#pragma once

#define EPX_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
