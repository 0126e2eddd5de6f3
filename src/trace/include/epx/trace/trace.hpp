// A timeline of what each rank computed and communicated, written as a Chrome / Perfetto trace
// (`epx run --trace FILE.json`): one process per rank, with compute, communication and gradient-reduction tracks.
// Recording is off until enable(); then a Scope costs two clock reads and a locked push.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "epx/trace/breakdown.hpp"

namespace epx::trace {

// compute and wait share the compute thread's track: a wait is the compute thread blocked on
// communication, so it does not count as compute covering it.
// grad_comm is the gradient reduction's own stream: communication too, on a track of its own.
enum class Track { compute = 0, comm = 1, wait = 2, grad_comm = 3 };
using Clock = std::chrono::steady_clock;

void enable(bool on);
bool enabled();
// One interval; `index` >= 0 is appended to the name ("layer forward 3").
void record(Track track, std::string name, Clock::time_point begin, Clock::time_point end, int index = -1);

class Scope {
 public:
  Scope(Track track, const char* name, int index = -1)
      : track_(track), name_(name), index_(index), begin_(enabled() ? Clock::now() : Clock::time_point{}) {}
  ~Scope() {
    if (begin_ != Clock::time_point{}) record(track_, name_, begin_, Clock::now(), index_);
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  Track track_;
  const char* name_;
  int index_;
  Clock::time_point begin_;
};

// The names of the dispatchers' comm-stream tasks for the MoE token exchanges, the communication
// EP overlap can hide.
inline constexpr const char* kDispatch = "dispatch";
inline constexpr const char* kCombine = "combine";
inline constexpr const char* kDispatchBackward = "dispatch backward";
inline constexpr const char* kCombineBackward = "combine backward";
// The compute thread's own wait on the dispatchers' token-count exchange (Track::wait).
inline constexpr const char* kDispatchCounts = "dispatch counts";
bool is_token_exchange(const std::string& task_name);
// A pipeline stage's compute thread waiting on its neighbours' activations / gradients, and on its
// sends at the end of the schedule (Track::wait): the pipeline bubble plus exposed p2p.
inline constexpr const char* kPipelineRecv = "pipeline recv";
inline constexpr const char* kPipelineSend = "pipeline send";
inline bool is_pipeline_wait(const std::string& name) { return name == kPipelineRecv || name == kPipelineSend; }

// The DP / EDP gradient reduction (and the distributed optimizer's parameter all-gather).
bool is_dp_reduction(const std::string& task_name);
// This rank's recorded time from `since` to `until` (clipped to it; by default to the last
// event's end), broken down as break_down does (epx/trace/breakdown.hpp).
Breakdown summarize(Clock::time_point since, Clock::time_point until = Clock::time_point::max());
// The time of each name recorded since `since`, summed over its intervals (nested ones count in
// both), per track: what `epx bench layer` reads per phase.
std::map<std::string, double> seconds_by_name(Track track, Clock::time_point since);

// The MoE layer's compute phases (Track::compute), as `epx bench layer` groups them.
inline constexpr const char* kRouter = "router";
inline constexpr const char* kPermute = "permute";
inline constexpr const char* kUnpermute = "unpermute";
inline constexpr const char* kExpertGemms = "expert GEMMs";
inline constexpr const char* kSharedExpert = "shared expert";

// This rank's events as a JSON array (Chrome trace events of process `rank`, times relative to
// `origin`), and clears them.
std::string take_events_json(int rank, Clock::time_point origin);
// Writes every rank's take_events_json (in rank order) to `path` as one trace, atomically.
void write(const std::string& path, const std::vector<std::string>& events_per_rank);

}  // namespace epx::trace
