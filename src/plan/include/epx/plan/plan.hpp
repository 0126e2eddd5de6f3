// `epx plan`: a large MoE layout checked, sized and timed on one machine, without launching its
// ranks (Megatron's --fake-init-process-group, done as arithmetic). Everything here is a model;
// each term names what it stands for, so a plan can be read against a profile.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "epx/check/check.hpp"
#include "epx/check/pipeline_split.hpp"
#include "epx/comm/parallel_layout.hpp"
#include "epx/config/config.hpp"
#include "epx/plan/flops.hpp"

namespace epx {

// The process groups of every kind, and whether each stays inside a node / an NVLink domain.
struct GroupPlacement {
  GroupKind kind;
  int size = 1, count = 1;
  bool within_node = true, within_nvlink = true;
};
struct LayoutPlan {
  ParallelLayout layout;
  int gpus_per_node = 8, nvlink_domain = 8, nodes = 1;
  // Where the system's NVLink domain spans nodes (a rack of `rack_gpus`), the domain a job can
  // count on is the Slurm segment Bridge's harness requests: `segment_nodes` nodes. Else both 0.
  int rack_gpus = 0, segment_nodes = 0;
  std::vector<GroupPlacement> groups;
  PipelineSplit split;  // which layers each pipeline stage holds (check/pipeline_split)
};
LayoutPlan plan_layout(const Config& resolved, const GpuInfo& gpu);
// The micro-batches each DP rank runs per step: global batch / (micro-batch x DP), unrounded
// (the checker refuses a global batch that does not divide).
double micro_batches_per_dp_rank(const Config& resolved, const ParallelLayout& layout);
// The nodes of one Slurm segment that Bridge's harness requests (utils/executors.py, on systems
// of 4 GPUs a node): all `nodes` up to a rack's `rack_nodes`, else the largest divisor of
// `nodes` that fits a rack (1 for a prime).
int slurm_segment_nodes(int nodes, int rack_nodes);
// One line per rank: its node and its index in every group kind (--ranks).
std::string format_rank_map(const LayoutPlan& p, int max_ranks);

// The layers of pipeline stage `stage` (all of its model chunks), as the check layer's
// pipeline_split places them: even, uneven, with the embedding / loss counted, or by the layout.
// The stage with the embedding is `first`, the one with the output layer and loss `last`; the
// MTP layers sit where the layout puts them, else on the last stage.
struct PipelineStage {
  double layers = 0, moe_layers = 0, mtp_layers = 0;
  double window_layers = 0;  // of `layers`, those with a sliding window
  bool first = true, last = true;
};
PipelineStage pipeline_stage(const ModelConfig& m, const PipelineSplit& split, int stage);
// The stage with the most MoE layers: the one whose token exchanges set the pace.
PipelineStage busiest_moe_stage(const ModelConfig& m, const PipelineSplit& split);

// Full recompute (recompute_granularity full) of a stage's `layers` in `chunks` model chunks,
// as Megatron-Core's TransformerBlock checkpoints each chunk: `uniform` recomputes every layer,
// in groups of recompute_num_layers whose first input it keeps, a group at a time; `block` the
// first recompute_num_layers of each chunk, one at a time, and keeps the others' activations.
struct FullRecompute {
  double recomputed = 0;   // layers whose forward runs again in the backward
  double kept_inputs = 0;  // the checkpoints: layer inputs held instead of their activations
  double rebuilt = 0;      // layers whose activations are rebuilt at once in the backward
};
// `layers` decoder layers over `chunks` model chunks, and `mtp` MTP layers: uniform checkpoints
// each MTP layer too, keeping its two inputs (Megatron's MTP checkpoint); block leaves them.
FullRecompute full_recompute(const ModelConfig& m, double layers, double mtp, int chunks);
// Whether selective recompute (recompute_granularity selective) recomputes `module`, one of
// recompute_modules (Megatron's default: core_attn).
bool recomputes_module(const ModelConfig& m, std::string_view module);

// Bytes per GPU on the most-loaded rank (reported in GiB), as Megatron's
// theoretical_memory_usage itemises them, plus what it leaves out (routed inputs kept for the
// experts' wgrad, dispatcher buffers, logits, the optimizer step's FP32 grads, runtime extras).
// The peak is the backward's (activations and logits held) or the optimizer step's (its FP32
// copy of BF16 main grads), whichever is larger, over what both hold.
struct MemoryPlan {
  double weights = 0, gradients = 0, optimizer = 0, activations = 0, dispatcher_buffers = 0, logits = 0,
         step_grads = 0, other = 0;
  double held() const { return weights + gradients + optimizer + dispatcher_buffers; }
  double transient() const { return std::max(activations + logits, step_grads); }
  double peak() const { return held() + transient() + other; }
  double dense_params = 0, expert_params = 0;  // on this rank
  double embedding_params = 0;                 // the first stage's token embedding's share of dense_params
  double optimizer_params = 0;                 // the optimizer's shard of them
  double in_flight = 1;                        // micro-batches' activations held at the peak
};
// The embedding's rows: the vocabulary, padded where Bridge takes it from the tokenizer.
double embedding_rows(const Config& resolved);
// The parameters on a rank of pipeline stage `stage`: dense (with the embedding, an MTP stage's
// own embedding and the output layer) and expert; `embedding_rows` as above, read once a plan.
struct StageParams {
  double dense = 0, expert = 0, embedding = 0, mtp_embedding = 0, output = 0;
};
StageParams stage_params(const Config& resolved, const LayoutPlan& layout, int stage, double embedding_rows);

// The first pipeline stage's weights (the stage whose backward ends a step) in the order its
// last backward completes their gradients: the head where it is the last stage too, the MTP
// layers, the decoder layers last to first (each its MLP, then its attention), chunk after chunk,
// then the token embedding. Per group, the dense and expert parameters on this rank, the share of
// the stage's backward done by then, and its model chunk. Megatron's DDP and epx's runtime bucket them
// in this order.
struct GradGroup {
  double dense = 0, expert = 0, done = 0;
  int chunk = 0;
  bool embedding = false;
};
std::vector<GradGroup> first_stage_grad_groups(const Config& resolved, const LayoutPlan& layout);

enum class Dispatcher { alltoall, deepep, hybridep };
const char* to_string(Dispatcher d);
MemoryPlan plan_memory(const Config& resolved, const LayoutPlan& layout, Dispatcher dispatcher, bool ep_overlap);
// The same for one pipeline stage.
MemoryPlan plan_stage_memory(const Config& resolved, const LayoutPlan& layout, Dispatcher dispatcher, bool ep_overlap, int stage);

// Bytes one rank sends per step, by link class, and what they cost.
struct CommPlan {
  double token_intra = 0, token_inter = 0;  // dispatch + combine, forward + backward
  double token_exchange_s = 0;              // per micro-batch, all MoE layers
  double step_allreduces_s = 0;             // the grad norm's and the logged loss's, after the step
  // The first stage's buckets (first_stage_grad_groups, bucketed as Megatron's DDP does) in launch
  // order, under ddp.overlap_grad_reduce (or one per kind, for the distributed optimizer's
  // overlap_param_gather). `ready`: the share of that stage's last backward done when the bucket
  // starts, kBeforeLastMicroBatch for the rows split's table; `reduce_s` on the wire; `gather_s`
  // the distributed optimizer's all-gather of its weights; `first_needed`: the bucket of its kind
  // (dense, expert) the next forward waits for first.
  struct Bucket {
    double ready = 0, reduce_s = 0, gather_s = 0;
    int chunk = 0;
    bool first_needed = false;
  };
  static constexpr double kBeforeLastMicroBatch = -1;
  std::vector<Bucket> first_stage_buckets;
  // Each pipeline stage's reduction as one bucket (Megatron buckets only the first stage; so does
  // the reduction without overlap_grad_reduce), and its all-gather.
  std::vector<double> stage_reduce_s, stage_gather_s;
  // ddp.reduce_embedding_rows: the all-gather of the last micro-batch's gradient rows, after the
  // backward (the table, the earlier micro-batches' sum, is a bucket of first_stage_buckets).
  double embedding_rows_s = 0;
  // Tied embeddings or MTP over pipeline stages: the embedding's gradient all-reduced over the
  // stages that hold it after the DP reduction, exposed (per iteration).
  double embedding_stages_s = 0;
  double tp_cp_s = 0, pp_s = 0;             // per micro-batch
};
CommPlan plan_comm(const Config& resolved, const LayoutPlan& layout, const GpuInfo& gpu, Dispatcher dispatcher);

// Communication is the wall when this share of the step is exposed (the planner's rows and
// epx diagnose's verdict).
inline constexpr double kCommunicationBinds = 0.25;

// One row of the table: a dispatcher with or without EP overlap and delayed wgrad.
struct Variant {
  Dispatcher dispatcher = Dispatcher::alltoall;
  bool ep_overlap = false, delay_wgrad = false, as_configured = false;
  double step_time_s = 0, tflops_per_gpu = 0, tokens_per_s_per_gpu = 0, peak_memory_gb = 0, exposed_comm_s = 0;
  double compute_s = 0, bubble_s = 0;
  double exposed_dp_s = 0;  // of exposed_comm_s, the DP reduction after the backward
  std::string wall;      // memory | communication | compute
  std::vector<std::string> overrides;  // the overrides that turn the configured run into this row
  std::string refusal;   // with check_variants: epx check's first error on that run, "[rule] message"
};

struct Plan {
  LayoutPlan layout;
  GpuInfo gpu;
  ModelFlops flops;
  double flops_per_step = 0;
  std::int64_t micro_batches = 0;  // per DP rank per step
  MemoryPlan memory;               // as configured
  bool fits = false;
  std::vector<Variant> variants;
  std::vector<std::string> notes;  // what the figures leave out (FP8, ...)
  std::vector<double> stage_compute_s;  // with PP: each stage's compute per micro-batch
  const Variant& configured() const;  // the one row `as_configured`
};
// A peak within 5% of a GPU's memory: it fits on paper, but what the count leaves out (the CUDA
// context, NCCL's and the libraries' workspaces, the allocator's fragmentation; torch itself
// sees about 79.2 of an H100's 80 GiB) may not.
bool tight_fit(double peak_gib, const GpuInfo& gpu);
// The plan of a config that passed `epx check` (resolved, world size and GPU given).
Plan make_plan(const Config& resolved);
// `resolved` with `overrides` applied and checked again (what advise and diagnose weigh): its
// plan, or, when `epx check` refuses it, the first error as "[rule] message".
struct Replanned {
  std::optional<Plan> plan;
  std::string refusal;
};
Replanned replan(const Config& resolved, const std::vector<std::string>& overrides);
// The overrides that turn a config with model `m` into the dispatcher and schedule of `v` (none
// where they are the config's).
std::vector<std::string> overrides_for(const ModelConfig& m, const Variant& v);
// The first error `epx check` finds in `resolved` with `overrides` applied, as "[rule] message";
// empty when it passes.
std::string check_refusal(const Config& resolved, const std::vector<std::string>& overrides);
// Each row's refusal (`epx plan` shows which rows the checker would refuse as they stand: EP
// overlap at PP > 1 without VPP, say). Apart from make_plan, which --search calls per candidate.
void check_variants(Plan& p, const Config& resolved);
// The overrides that turn full recompute on (uniform, one layer), with per-layer CUDA graphs off
// where the model has them (Megatron-Core takes full recompute only with full-iteration graphs) and EP
// overlap off where it is on (Megatron refuses the two together: ep_overlap.full_recompute).
std::vector<std::string> full_recompute_overrides(const Config& c);
// The seeds' selective recompute (core_attn, moe_act, layernorm), clearing full recompute's
// method and layer count where `m` sets them.
std::vector<std::string> selective_recompute_overrides(const ModelConfig& m);
std::string format_plan(const Plan& p);
nlohmann::json plan_json(const Plan& p);  // memory in GiB, as printed
nlohmann::json variant_json(const Variant& v);

}  // namespace epx
