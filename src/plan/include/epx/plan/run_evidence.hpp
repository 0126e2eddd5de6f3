// What a finished run shows, read from its own files: an `epx run --results` JSON (which carries
// the resolved config) with its `--trace`, or a Megatron training log (the per-iteration lines,
// the timers, the memory lines). `epx diagnose` and `epx report` read runs through this.
#pragma once

#include "epx/trace/breakdown.hpp"

#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "epx/config/config.hpp"

namespace epx {

struct IterationPoint {
  int iteration = 0;
  double step_s = 0, tflops_per_gpu = 0;
  double lm_loss = std::numeric_limits<double>::quiet_NaN();  // NaN: not logged, or logged as nan
  double mem_max_allocated_gb = 0;  // GiB, Megatron's "gigabytes"; 0: not logged
  int skipped = 0, nans = 0;        // a Megatron log line's skipped and NaN iteration counts
  bool loss_not_finite = false;     // a Megatron log line's loss printed as NAN or INF (older versions)
  bool throughput_logged = true;    // a Megatron log's rate (its line's, or Bridge's Step Time line)
  // Megatron's timers after the line (--timing-log-level 1 or 2): ms per iteration, max over ranks;
  // the min over ranks (--timing-log-option minmax, Megatron's default, or all); and with `all`
  // each rank's (it lists the ranks whose timer is above 0).
  std::map<std::string, double> timers_ms, timers_min_ms;
  std::map<std::string, std::map<int, double>> timers_by_rank_ms;
};

// Rank 0's trace over the steady-state iterations: trace::break_down's figures per iteration
// (window_s stays the whole window), and the step it shows.
struct TraceBreakdown : trace::Breakdown {
  int iterations = 0;
  double step_s = 0;
  double exposed_s = 0;  // communication and the pipeline's waits, exposed
};

// One event of a rank's timeline, for the report (seconds from the trace's origin).
struct TraceSpan {
  int rank = 0, thread = 0;  // thread: the trace's tid (0 compute, 1 exchanges, 2 gradient reduction)
  std::string track;  // compute | wait | comm
  std::string name;
  double begin_s = 0, end_s = 0;
};

// Pipeline parallelism in the steady state (epx results), per stage and iteration: the
// schedule's time and, within it, the waits on the other stages (bubble and exposed transfers).
struct PipelineEvidence {
  int stages = 1, chunks = 1, micro_batches = 0;
  double ideal_bubble = 0;  // (PP - 1) / (VPP x m)
  std::vector<double> schedule_s, wait_s;
  std::vector<double> compute_s() const {  // each stage's schedule less its waits
    std::vector<double> out;
    for (std::size_t k = 0; k < schedule_s.size(); ++k) out.push_back(schedule_s[k] - wait_s[k]);
    return out;
  }
};

struct RunEvidence {
  std::string source;  // the file read
  std::string kind;    // "epx results" | "Megatron log"
  std::optional<Config> config;  // the resolved config (epx results carry it)
  std::vector<IterationPoint> iterations;
  int first_iteration = 1;  // the first the run's lines cover (a resumed run's: past its checkpoint)
  int steady_first = 0, steady_last = 0;
  double mean_step_s = 0, tflops_per_gpu = 0, peak_memory_gb = 0, final_loss = 0;
  double expert_load = 0;   // epx results: the busiest expert's tokens against the mean; 0: not measured
  double ep_rank_load = 0;  // the busiest EP rank's (its local experts') against the mean; 0: not measured
  // epx results: rank 0's CPU time per steady iteration, all its threads, and the cores it had (its
  // machine's shared among the ranks there); 0: not measured.
  double cpu_s_per_iteration = 0, cores_per_rank = 0;
  // Megatron logs its throughput only with --log-throughput (off by default), Bridge on a line of
  // its own: without it on every line of the steady state the rate is unknown here, not 0.
  bool throughput_logged = true;
  int ranks = 0;  // the world size: epx results' ranks, a Megatron log's arguments dump; 0: not said
  int skipped_iterations = 0, nan_iterations = 0;  // Megatron's log counts (summed over its lines)
  std::int64_t global_batch_size = 0;               // as a Megatron log's lines say it; 0: not said
  bool cut_off = false;  // a Megatron log whose last line has no end (still being written): left out
  // Lines that name an elapsed time per iteration but do not read as Megatron's iteration line
  // (cut short or run into by another rank's output): left out; the first one's line number.
  int unread_lines = 0;
  std::size_t first_unread_line = 0;
  // epx results: the first iteration whose loss is NaN or infinite (written as null), 0 if none.
  // Megatron's training_log today prints only losses >= 0 (a skipped fp16 step's NaN is counted
  // as a NaN iteration); a log of 2020's whose loss is NAN or INF to its end diverged at the
  // first of those lines.
  int diverged_at = 0;
  // A Megatron log of more than one process: one whose iterations go back (a requeued run
  // appended to its log: the later lines replace the earlier ones from that iteration on,
  // went_back), or a second arguments dump before the next line (a resumed run). The first
  // iteration of the last such process, 0: none.
  int restarted_at = 0;
  bool went_back = false;
  // Megatron's timers, the mean over the steady lines (a timer missing on a line counts as 0 there).
  std::map<std::string, double> timers_ms, timers_min_ms;
  std::map<std::string, std::map<int, double>> timers_by_rank_ms;
  std::string layout, dispatcher, schedule, recompute;
  std::optional<PipelineEvidence> pipeline;  // PP > 1 (epx results)
  std::optional<TraceBreakdown> trace;  // rank 0, from --trace
  std::vector<TraceSpan> spans;         // every rank, one steady-state iteration (the report's timeline)
};

// Reads RUN (epx results JSON or a Megatron log, told apart by content) and, if given, its trace.
// Throws InputError naming the file (and line) for what cannot be read.
RunEvidence read_run(const std::string& run_path, const std::optional<std::string>& trace_path);

}  // namespace epx
