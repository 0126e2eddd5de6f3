// One finished run read and diagnosed, as `epx diagnose` and `epx report` both need it: its
// evidence, its resolved config (from the results, or named), its hardware and the verdict.
#pragma once

#include <optional>
#include <string>

#include "epx/plan/diagnose.hpp"

namespace epx::cli {

struct DiagnosedRun {
  RunEvidence run;
  std::optional<Config> config;
  const GpuInfo* gpu = nullptr;
  Diagnosis diagnosis;
};

// `config` names the run's config when the run does not carry it; `gpu` overrides its target.
// Throws ConfigError when the config does not pass `epx check` or the GPU is unknown.
DiagnosedRun diagnose_run(const std::string& run_path, const std::optional<std::string>& trace_path,
                          const std::optional<std::string>& config, const std::optional<std::string>& gpu);

}  // namespace epx::cli
