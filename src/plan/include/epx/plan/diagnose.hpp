// `epx diagnose`: which of the seeds' three walls (memory; communication; compute and host
// overhead) binds a finished run, from its own evidence, and the seeds' fixes for that wall in
// priority order, each an override with the planner's predicted effect.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "epx/check/check.hpp"
#include "epx/plan/run_evidence.hpp"

namespace epx {

struct WallFigure {
  std::string wall;      // memory | communication | compute/host
  double share = 0;      // of capacity (memory), of the step (communication, host gaps)
  std::string evidence;  // the figures, in words
  bool measured = true;  // false: the planner's prediction (no trace)
};

struct Fix {
  std::string wall, what;
  std::vector<std::string> overrides;
  std::string predicted;  // the planner's step time and memory with the overrides, or why not
};

struct Diagnosis {
  std::string binding;  // memory | communication | compute/host
  std::string why;
  std::vector<WallFigure> walls;
  std::vector<Fix> fixes;  // for the binding wall first, in the seeds' priority order
  std::vector<std::string> notes;
  // The run's model TFLOP/s per GPU over the whole step: the run's own, or, for a log without
  // its throughput, Megatron's FLOPs of the config over the logged step; absent: unknown.
  std::optional<double> tflops_per_gpu;
};

// `config`: the run's resolved config (from the results, or given for a Megatron log), for the
// planner; `gpu`: its hardware (capacity, attainable rate). Either may be absent: what needs it
// is then said to be unknown.
Diagnosis diagnose(const RunEvidence& run, const std::optional<Config>& config, const GpuInfo* gpu);
std::string format_diagnosis(const RunEvidence& run, const Diagnosis& d);
nlohmann::json diagnosis_json(const RunEvidence& run, const Diagnosis& d);

}  // namespace epx
