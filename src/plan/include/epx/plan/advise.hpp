// `epx advise`: the seeds' dispatcher selection (by hardware, EP degree and model family) and
// tuning advice, each backed by the planner's predicted step time and memory of the
// alternatives, with the backend availability gate applied, and an A/B plan of command lines
// that varies one knob at a time.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "epx/plan/plan.hpp"

namespace epx {

// What the target container has (the seeds' backend availability gate). Unset: not stated.
struct BackendAvailability {
  std::optional<bool> deepep, hybridep;
  std::string source;  // where it was stated ("--have deepep", a probe file's path)
  bool stated() const { return deepep.has_value() || hybridep.has_value(); }
  bool has(Dispatcher d) const;  // alltoall always; a backend unless stated missing
};

// `--have deepep,hybridep` (also "none", "alltoall"). Throws InputError naming the bad word.
BackendAvailability parse_have_list(const std::string& list);
// A probe file from the target container: `deepep: true|false` and `hybridep: true|false`
// lines (YAML). Throws InputError / ConfigError naming the file and line.
BackendAvailability read_probe_file(const std::string& path);

// One dispatcher as the planner sees it for this config.
struct DispatcherOption {
  Dispatcher dispatcher = Dispatcher::alltoall;
  bool available = true;
  Variant best;          // its fastest schedule that fits (else its fastest)
  Variant plain;         // no EP overlap
  bool fits = true;
};

struct Tip {
  std::string topic;     // "deepep SMs", "routing", "EP overlap", ...
  std::string advice;    // what to do and why, with the figures
  std::vector<std::string> overrides;  // to paste, one per line (may be empty)
};

struct Advice {
  Plan plan;
  std::string hardware_rule, ep_rule, family_rule;  // the seeds' rows that apply, as text
  Dispatcher seeds_choice = Dispatcher::alltoall;  // the seeds' first choice for this hardware
  Dispatcher recommended = Dispatcher::alltoall;   // after the gate, backed by the plan
  std::string why;                                 // the figures behind `recommended`
  bool second_order = false;                       // the available dispatchers within 5%
  std::vector<DispatcherOption> options;           // ranked: available first, by step time
  std::vector<std::string> gate;                   // the availability gate's notes
  std::vector<Tip> tuning;
  std::vector<std::string> harness_ab;             // run_script.py lines, one knob at a time
  std::vector<std::string> epx_ab;                 // the same A/B with epx's runtime here
};

// `resolved` passed `epx check` and names the world size and the GPU.
Advice advise(const Config& resolved, const BackendAvailability& have);
std::string format_advice(const Advice& a);
nlohmann::json advice_json(const Advice& a);

}  // namespace epx
