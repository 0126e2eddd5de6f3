// One finished run read and diagnosed, as `epx diagnose` and `epx report` both need it: its
// evidence, its resolved config (from the results, or named), its hardware and the verdict.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "epx/plan/diagnose.hpp"

namespace epx::cli {

// What names a run's config and hardware where the run does not carry them (a Megatron log):
// --config, overrides to it, -g, -ng.
struct RunSource {
  std::optional<std::string> config, gpu;
  std::optional<int> num_gpus;
  std::vector<std::string> overrides;
};

struct DiagnosedRun {
  RunEvidence run;
  std::optional<Config> config;
  const GpuInfo* gpu = nullptr;
  Diagnosis diagnosis;
};

// The options that fill `source`: --config, --override (repeated), -g, -ng.
void add_run_source_options(CLI::App& app, RunSource& source);

// `source.config` names the run's config when the run does not carry it; the overrides, GPU and
// world size apply to either. Throws ConfigError when the config does not pass `epx check`, the
// GPU is unknown, or the world size is said nowhere.
DiagnosedRun diagnose_run(const std::string& run_path, const std::optional<std::string>& trace_path,
                          const RunSource& source);

}  // namespace epx::cli
