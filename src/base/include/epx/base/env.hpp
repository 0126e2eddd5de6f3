// The environment variables epx reads as settings ("knobs"), each declared once here with its
// default and range, and read through read_env so that every one is checked and reported alike.
// Variables that belong to the launcher (OMPI_*, PMIX_*, OMP_*) are read where they are used.
#pragma once

#include <map>
#include <optional>
#include <string>

namespace epx {

struct EnvKnob {
  const char* name;
  double fallback;   // when unset (may lie outside the range: "not set" for the reader)
  double min, max;   // the accepted range, inclusive
  bool whole;        // a whole number
  const char* what;  // what it sets, for the message
};

namespace env {
inline constexpr EnvKnob kCollectiveTimeout{"EPX_COLLECTIVE_TIMEOUT", 300, 1e-3, 1e6, false,
                                            "seconds a collective may wait before the job is aborted"};
inline constexpr EnvKnob kCommSpinPolls{"EPX_COMM_SPIN_POLLS", 32, 0, 1e6, true,
                                        "MPI_Test polls before a waiting rank starts to sleep"};
inline constexpr EnvKnob kCommMaxSleepUs{"EPX_COMM_MAX_SLEEP_US", 100, 5, 1e6, true,
                                         "the longest sleep in microseconds between MPI_Test polls"};
// An all-reduce longer than this many elements runs as several MPI calls (MPI counts are ints);
// set lower only to exercise the slicing in tests.
inline constexpr EnvKnob kMpiMaxCount{"EPX_MPI_MAX_COUNT", 2147483647, 1, 2147483647, true,
                                      "the most elements one MPI all-reduce call carries"};
// HybridEP's (Megatron-Core / DeepEP hybrid-ep) variables; 0 = the ranks that share a node.
inline constexpr EnvKnob kHybridEpRanksPerDomain{"NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN", 0, 1, 1 << 20, true,
                                                 "the ranks of one NVLink domain"};
inline constexpr EnvKnob kHybridEpTokensPerChunk{"NUM_OF_TOKENS_PER_CHUNK_DISPATCH_API", 64, 1, 1 << 20, true,
                                                 "the tokens per pipelined dispatch chunk"};
// Paths.
inline constexpr const char* kRecipesDir = "EPX_RECIPES_DIR";  // where recipes are found by name
inline constexpr const char* kClusterDir = "EPX_CLUSTER_DIR";  // the emulated cluster's state
inline constexpr const char* kVendorDir = "EPX_VENDOR_DIR";    // scripts/setup.sh's downloads (plotly.js)
}  // namespace env

// The knob from the process environment, else from `recipe_env` (a recipe's env_vars), else its
// fallback. Throws ConfigError (`NAME='text': expected ...; set NAME=...`) for a value that is
// not a number in range.
double read_env(const EnvKnob& knob, const std::map<std::string, std::string>* recipe_env = nullptr);

// A path variable: its value when set and not empty.
std::optional<std::string> env_path(const char* name);

}  // namespace epx
