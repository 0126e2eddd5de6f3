// `epx run`'s training loop: mock pretraining of the GPT model on this job's MPI ranks, as
// Megatron's pretrain(). With PP > 1 each rank holds one pipeline stage's model chunks. Attention
// and dense weights are replicated over the data-parallel ranks; each MoE layer's experts are
// split over EP (and ETP) and replicated over EDP. Per iteration: global_batch_size /
// (micro_batch_size x DP) micro-batches of forward and backward (gradient accumulation; with PP
// through the 1F1B or interleaved schedule), gradients summed over DP (experts over EDP) and
// scaled by 1 / DP, gradient clipping (the norm over every stage), the routers' once-per-batch
// updates (expert bias, quantile balancing), then Adam at the scheduled learning rate.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "epx/comm/comm.hpp"
#include "epx/config/config.hpp"
#include "epx/moe/moe_spec.hpp"
#include "epx/trace/trace.hpp"
#include "epx/train/mock_data.hpp"

namespace epx {

struct TrainOptions {
  MockData::Mode data = MockData::Mode::random;
  int steady_first = 3;         // the summary's mean step time: iterations steady_first..
  int steady_last = 0;          // ..steady_last (0: the last iteration), as the seeds' harness
  std::optional<std::string> trace_path;  // Chrome / Perfetto trace
  bool log = true;              // Megatron's log lines and the summary on stdout
  bool progress_bar = false;    // on stderr (rank 0), when it is a terminal
};

struct IterationLog {
  int iteration = 0;
  std::int64_t consumed_samples = 0;
  double step_s = 0, tflops_per_rank = 0, lr = 0, lm_loss = 0, grad_norm = 0;
  // With mtp_detach_heads: the MTP layers' own gradient norm, which clips them (grad_norm leaves
  // them out). epx's figure: Megatron computes it to clip and logs only grad_norm.
  std::optional<double> mtp_grad_norm;
  // The MoE losses Megatron's training log tracks, by its names ("load_balancing_loss", ...,
  // "z_loss"), each without its coefficient.
  std::vector<std::pair<std::string, double>> moe_losses;
  // Each MTP depth's loss, averaged as the LM loss (Megatron's "mtp_1 loss", ...).
  std::vector<double> mtp_losses;
  // The busiest expert's tokens against the mean, over the iteration's micro-batches and DP, the
  // mean over the MoE layers (1: balanced; 0 without MoE layers). The same for the busiest EP
  // rank: its local experts' tokens against the mean rank's (1 with EP = 1). Summed over the
  // iteration and over DP (with EDP > 1, over the EP groups), it is a lower bound on what the
  // other EP ranks wait for in one micro-batch's exchange.
  double expert_load = 0, ep_rank_load = 0;
  std::int64_t mem_allocated = 0, mem_max_allocated = 0;  // this rank's bytes
};

// Pipeline parallelism in the steady state, per stage (the mean over its ranks): the schedule's
// wall time per iteration and the time its compute thread waited on the neighbouring stages (the
// bubble and exposed transfers), against the ideal bubble, (PP - 1) / (VPP x m) of the compute.
struct PipelineStats {
  int stages = 1, chunks = 1, micro_batches = 0;
  double ideal_bubble = 0;
  std::vector<double> schedule_s, wait_s;
  double bubble(int stage) const;  // wait / (schedule - wait)
};

struct TrainResult {
  std::vector<IterationLog> iterations;  // identical losses on every rank
  int steady_first = 0, steady_last = 0;
  double mean_step_s = 0, tflops_per_rank = 0, flops_per_iteration = 0;
  std::int64_t peak_memory_bytes = 0;    // max over ranks of mem-max-allocated
  double final_loss = 0;
  double expert_load = 0, ep_rank_load = 0;  // IterationLog's, the steady state's mean
  double comm_in_flight_s = 0;           // this rank's two comm streams (exchanges, gradient reduction), summed, steady state
  double comm_thread_cpu_s = 0;          // the CPU time their threads used meanwhile
  // This rank's CPU time over the steady state, every thread (compute, communication, MPI's): with
  // one core a rank, as on the emulated cluster, a step can take no less than this per iteration.
  double process_cpu_s = 0;
  double cores_per_rank = 1;  // the cores it may use, shared with the ranks on its machine (rank_cpu.hpp)
  // The share of those cores its threads kept busy over the steady state.
  double cpu_busy() const {
    return process_cpu_s / (mean_step_s * (steady_last - steady_first + 1) * cores_per_rank);
  }
  std::optional<trace::Breakdown> traced;  // with a trace: rank 0's steady-state summary (exposed communication)
  std::optional<PipelineStats> pipeline;  // with PP > 1
  std::string layout, dispatcher, schedule, recompute;
  nlohmann::json to_json() const;
};

// Collective over `world`. Throws ConfigError (before any rank computes) for a config that does
// not fit the ranks or cannot be trained.
TrainResult train(const Config& resolved, Communicator& world, const TrainOptions& options, std::ostream& out);

}  // namespace epx
