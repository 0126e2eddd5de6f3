// Step time of one configuration on the hardware's rates. Compute: each GEMM family's model
// FLOPs at the hardware's BF16 rate times a size-dependent efficiency (the GEMM's rows: tokens
// for attention and dense MLPs, tokens per expert for the routed experts); memory-bound work
// (permutation, elementwise, the optimizer step) at HBM bandwidth; a host cost per MoE layer.
// Communication from plan_comm. Schedules: without EP overlap everything adds up; with it the
// merged 1F1B pairs one micro-batch's forward with another's backward layer by layer, so a pair
// costs the larger of compute and exchanges plus an interference share of the smaller (the
// exchanges' copies and the NIC compete with the GEMMs for SMs and memory bandwidth), and the
// first forward and last backward of a step run alone. PP adds the 1F1B bubble: the other
// stages' fill and drain around the slowest, over VPP ((PP-1)/VPP stage times where they are even).
#include <algorithm>
#include <cmath>
#include <numeric>

#include "epx/plan/step_time.hpp"

namespace epx {
namespace {

// Constants of the runtime, not of the GPU (calibrated on the seeds' Qwen3-30B-A3B runs, see
// bench/RESULTS.md "epx plan"): the share of the smaller side a merged layer pair still pays
// (less with delay_wgrad, whose deferred expert wgrad fills the dispatch-backward), the bytes of
// elementwise traffic per token and hidden unit and layer (norms, residuals, SwiGLU, softmax,
// forward and backward), and the host cost of an MoE layer per micro-batch (kernel launches, and
// alltoall's host sync on the token counts; CUDA graphs over the router and preprocess remove
// most of it). On cpu, the bytes per logit of epx's cross-entropy, forward and backward (2.0-2.4
// ns a logit measured on one core of an AVX-512 EPYC, 1.6 ns at the catalog's bandwidth;
// bench/RESULTS.md "Time-shared pipeline stages").
constexpr double kInterference = 0.45, kInterferenceDelayed = 0.40;
constexpr double kElementwiseBytes = 60, kLogitBytes = 64;
constexpr double kHostPerMoeLayerS = 0.6e-3, kHostPerMoeLayerGraphedS = 0.25e-3;

double efficiency(const HardwareRates& hw, double rows) {
  return std::max(1e-3, hw.gemm_efficiency * rows / (rows + hw.gemm_half_rows));
}

}  // namespace

double cpu_attention_s(const ModelConfig& m, double layers, double tokens, double flops_per_s) {
  return 6 * attention_macs(m).core * layers * tokens / std::max(1.0, flops_per_s);
}

StepCosts step_costs(const Config& c, const LayoutPlan& lp, const GpuInfo& gpu, const CommPlan& comm,
                     const MemoryPlan& memory, Dispatcher dispatcher) {
  const ModelConfig& m = c.model;
  const ParallelLayout& l = lp.layout;
  const HardwareRates& hw = gpu.rates;
  // A cpu's rates are per core, and each rank runs on at most one: epx's runtime gains little
  // from a second thread (bench/RESULTS.md: one rank on two cores runs at one core's speed),
  // and ranks side by side run at the measured shared-core efficiency. Ranks beyond the cores
  // time-share them: the stages' compute below is on a core each, slowed afterwards.
  const double ranks_here = std::min<double>(l.world, lp.gpus_per_node);
  const double side_by_side = hw.cores > 0 && ranks_here > 1 ? hw.shared_core_efficiency : 1;
  const double peak = std::max(1e-9, hw.bf16_tflops) * 1e12 * side_by_side, hbm_one = std::max(1e-9, hw.hbm_tb_s) * 1e12 * side_by_side;
  const double hbm = hbm_one * (hw.cores > 0 ? std::min(1.0, hw.cores / ranks_here) : 1);  // every rank at once
  const double h = static_cast<double>(m.hidden_size), k = routed_rows_per_token(m);
  const double padding = k / std::max(1.0, static_cast<double>(m.moe_router_topk));  // rows computed per model row
  const double tokens = static_cast<double>(m.seq_length) * static_cast<double>(c.train.micro_batch_size.value_or(1)) / l.cp;
  // The routed experts' FLOPs run at the rows each expert sees, the rest at the tokens. Each
  // pipeline stage computes its own layers (and the head and loss on the last): the slowest
  // stage sets the pace of every other.
  const double expert_rows = m.num_moe_experts ? tokens * k * l.ep * l.etp / (static_cast<double>(*m.num_moe_experts) * l.tp) : tokens;
  const double per_rank = tokens / l.tp;  // each rank's share of a micro-batch's tokens
  // Recompute runs a forward again in the backward, a third of its forward + backward: full
  // recompute the recomputed layers' share of the stage, selective the modules it names (the
  // attention's QK^T and PV, the MoE layer's experts, the dense and shared MLPs; the norms and
  // activations are elementwise work). epx's own blocked attention keeps nothing core_attn could
  // drop and recomputes nothing for it.
  const bool full = m.recompute_granularity == std::optional<std::string>("full");
  const auto selective = [&](const char* module) { return recomputes_module(m, module); };
  StepCosts s;
  for (int p = 0; p < lp.split.stages; ++p) {
    const PipelineStage st = pipeline_stage(m, lp.split, p);
    const ModelFlops f = layer_flops(c, st.layers, st.moe_layers, st.mtp_layers, st.last);
    // `mlp`: the dense layers' MLPs; `shared_experts`: the shared experts; `moe`: the MoE layer,
    // routed and shared experts both.
    const double core_again = selective("core_attn") && gpu.cuda() ? 1.0 / 3 : 0, experts_again = selective("moe") ? 1.0 / 3 : 0;
    const double mlp_again = (selective("mlp") ? f.mlp - f.shared_experts : 0) +
                             (selective("moe") || selective("shared_experts") ? f.shared_experts : 0);
    // The QK^T and PV that run: a sliding-window layer's share of a full one (FLOPs count it full).
    const double all_layers = st.layers + st.mtp_layers;
    const double core_layers = all_layers - st.window_layers * (1 - window_core_share(m));
    const double core = all_layers > 0 ? f.attention_core * core_layers / all_layers : 0;
    // mtp_detach_heads: each MTP depth's output layer computes no weight gradient (a third of its
    // GEMMs); its cross-entropy still runs.
    const double depths = static_cast<double>(m.mtp_num_layers.value_or(0));
    const double head_wgrad_skipped = m.mtp_detach_heads ? f.logits * depths / (depths + 1) / 3 : 0;
    double other = f.per_token() - f.routed_experts - (f.attention_core - core) + core_again * core + mlp_again / 3 -
                   head_wgrad_skipped,
           stage = 0, head = 0;
    if (hw.attention_tflops > 0) {  // epx's blocked attention, apart from the GEMMs, at its own window cost
      other -= (1 + core_again) * core;
      const double blocked_layers = all_layers - st.window_layers * (1 - blocked_window_core_share(m));
      stage = (1 + core_again) * cpu_attention_s(m, blocked_layers, per_rank, hw.attention_tflops * 1e12 * side_by_side);
    }
    if (!gpu.cuda()) {
      // epx's output layer: its GEMMs are large ones and run at the measured peak (a 1024^3
      // GEMM's rate), its cross-entropy passes over the FP32 logits (write, softmax, its
      // gradient, the BF16 copy, fresh pages) at memory bandwidth, and no recompute reruns it;
      // gemm_efficiency is fitted to the layers alone, their small GEMMs and what runs between them.
      other -= f.logits - head_wgrad_skipped;
      head = per_rank * ((f.logits - head_wgrad_skipped) / peak + f.logits / (6 * h) * kLogitBytes / hbm_one);
    }
    stage += per_rank * (other / (peak * efficiency(hw, tokens)) +
                         (1 + experts_again) * padding * f.routed_experts / (peak * efficiency(hw, expert_rows)));
    const double layers = st.layers + st.mtp_layers;
    if (full && layers > 0) stage *= 1 + full_recompute(m, st.layers, st.mtp_layers, lp.split.chunks).recomputed / layers / 3;
    s.stage_compute.push_back(stage + head);
  }
  // Time-sharing (a cpu with more ranks than cores): balanced ranks each get cores / ranks. A
  // pipeline whose stages differ lends its slowest stage the time the lighter ones spend waiting
  // on it, so the pace is the slowest stage on a core of its own or the busiest node's work over
  // its cores, whichever is longer (a fluid model; bench/RESULTS.md "Time-shared pipeline
  // stages"). PP is the outermost rank dimension: rank r holds stage r / (world / PP).
  const double slowest = s.stage_compute.empty() ? 0 : *std::max_element(s.stage_compute.begin(), s.stage_compute.end());
  double pace = slowest;
  if (hw.cores > 0) {
    const int per_stage = std::max(1, l.world / std::max(1, l.pp)), per_node = static_cast<int>(ranks_here);
    for (int first = 0; first < l.world; first += per_node) {
      double work = 0;
      for (int r = first; r < std::min(l.world, first + per_node); ++r)
        work += s.stage_compute[static_cast<std::size_t>(std::min(r / per_stage, lp.split.stages - 1))];
      pace = std::max(pace, work / hw.cores);
    }
  }
  const double slow_down = slowest > 0 ? pace / slowest : 1;
  for (double& stage : s.stage_compute) stage *= slow_down;
  s.compute = pace;
  // The bubble: the other stages' forward ahead of the slowest's first micro-batch and backward
  // after its last.
  s.stages = lp.split.stages;
  s.other_stages = std::accumulate(s.stage_compute.begin(), s.stage_compute.end(), 0.0) - s.compute;

  // Memory-bound work per micro-batch: permutation (4 passes of k rows, read and write; fused
  // into the kernels around it with moe_permute_fusion), elementwise, and the host cost.
  const PipelineStage stage = busiest_moe_stage(m, lp.split);
  const double stage_moe = stage.moe_layers, stage_layers = stage.layers + stage.mtp_layers;
  const double row = h * element_bytes(m);
  const bool fused = m.moe_permute_fusion || m.moe_permute_fusion_into_hybridep;
  // A recomputed MoE layer (full recompute, or the selective `moe` module) runs its forward again
  // with its exchanges: the dispatch and combine, half of the four, and the forward permutations.
  const double moe_again = full && stage_layers > 0
                               ? full_recompute(m, stage.layers, stage.mtp_layers, lp.split.chunks).recomputed / stage_layers
                           : selective("moe")      ? 1
                                                   : 0;
  s.memory_bound = (1 + moe_again / 2) * stage_moe * 4 * tokens * k * row * 2 / l.tp / hbm_one * (fused ? 0.5 : 1) +
                   stage_layers * kElementwiseBytes * tokens * h / l.tp / hbm_one;
  s.memory_bound *= slow_down;
  const bool graphed = m.cuda_graph_impl != "none";
  s.host = stage_moe * (graphed || dispatcher != Dispatcher::alltoall ? kHostPerMoeLayerGraphedS : kHostPerMoeLayerS);
  s.exchange = (1 + moe_again / 2) * comm.token_exchange_s;
  s.tp_cp_pp = comm.tp_cp_s + comm.pp_s;
  // The optimizer step: Adam reads and writes about 30 bytes per parameter of its shard.
  s.optimizer = 30 * memory.optimizer_params / hbm;
  // The DP reduction after the last backward. Each stage starts its own after its last backward,
  // stage k k cooldown slots before the first stage's ends, and the optimizer step waits for
  // every stage's. Without overlap_grad_reduce all of it runs then. With it, the first stage's
  // buckets go out one after another on the comm stream as the last backward (about two thirds of
  // a micro-batch's compute) completes them, the rows split's table under the last micro-batch
  // (the plain schedule) or only its backward (the EP-overlap schedule merged its forward with the
  // previous backward): what runs past the backward's end is exposed, at least the last bucket,
  // the embedding's (measured on epx's runtime, bench/RESULTS.md "The exposed DP reduction against
  // the model's depth").
  // The distributed optimizer's all-gather follows the optimizer step on every stage at once;
  // with overlap_param_gather it runs under the next forward, which waits for the first bucket of
  // each kind and the rest past the first forward's length (on a GPU under VPP with
  // align_param_gather, for the first chunk's whole gather, dispatched at once). A later stage's
  // one bucket starts with the step where every stage's does (align_param_gather, or epx's
  // runtime, which sends them all after the step) and runs under the k forward slots of the
  // pipeline's fill; else Megatron starts it at the stage's first forward, which waits for all of it.
  const double micro_batch = s.compute + s.memory_bound + s.host, last_backward = 2.0 / 3.0 * micro_batch;
  const double chunks = lp.split.chunks, backward_slot = last_backward / chunks, forward_slot = (micro_batch - last_backward) / chunks;
  // The longest of the stages' times past the first's end, from stage `from` on.
  const auto past = [](const std::vector<double>& stages, double slot, std::size_t from) {
    double most = 0;
    for (std::size_t k = from; k < stages.size(); ++k) most = std::max(most, stages[k] - static_cast<double>(k) * slot);
    return most;
  };
  const auto exposed = [&](double table_window) {
    if (!c.ddp.overlap_grad_reduce) return past(comm.stage_reduce_s, backward_slot, 0);
    double done = -table_window;
    for (const CommPlan::Bucket& b : comm.first_stage_buckets)
      done = std::max(done, b.ready == CommPlan::kBeforeLastMicroBatch ? -table_window : b.ready * last_backward) + b.reduce_s;
    return std::max({0.0, done - last_backward, past(comm.stage_reduce_s, backward_slot, 1)});
  };
  double gather = past(comm.stage_gather_s, 0, 0);
  if (c.ddp.overlap_param_gather && !comm.first_stage_buckets.empty()) {
    const bool whole_chunk = gpu.cuda() && c.ddp.align_param_gather && lp.split.chunks > 1;
    double first = 0;
    for (const CommPlan::Bucket& b : comm.first_stage_buckets)
      if (whole_chunk ? b.chunk == 0 : b.first_needed) first += b.gather_s;
    if (!whole_chunk) first = std::max(first, comm.stage_gather_s.front() - forward_slot);
    gather = std::max(first, past(comm.stage_gather_s, whole_chunk || !gpu.cuda() ? forward_slot : 0, 1));
  }
  s.dp = exposed(micro_batch - last_backward) + gather + comm.step_allreduces_s;
  s.dp_merged = exposed(0) + gather + comm.step_allreduces_s;
  s.dp += comm.embedding_stages_s, s.dp_merged += comm.embedding_stages_s;  // after the DP reduction
  return s;
}

StepTime step_time(const StepCosts& s, double micro_batches, int vpp, bool ep_overlap, bool delay_wgrad) {
  const double compute = s.compute + s.memory_bound + s.host;  // the compute stream, per micro-batch
  const double alone = compute + s.exchange + s.tp_cp_pp;
  StepTime t;
  if (!ep_overlap || micro_batches < 2) {
    t.layers = micro_batches * alone;
  } else {
    const double kappa = delay_wgrad ? kInterferenceDelayed : kInterference;
    const double pair = std::max(compute, s.exchange) + kappa * std::min(compute, s.exchange) + s.tp_cp_pp;
    t.layers = alone + (micro_batches - 1) * pair;
  }
  // The other stages' compute, and the rest of a stage's micro-batch (exchanges, memory-bound
  // work) as even over the stages: (PP - 1) stage times where the stages are even.
  t.bubble = (s.other_stages + (s.stages - 1) * (alone - s.compute)) / static_cast<double>(std::max(1, vpp));
  t.exposed_dp = ep_overlap && micro_batches >= 2 ? s.dp_merged : s.dp;
  t.total = t.layers + t.bubble + t.exposed_dp + s.optimizer;
  t.compute = micro_batches * compute + s.optimizer;
  t.exposed_comm = std::max(0.0, t.total - t.compute - t.bubble);
  return t;
}

}  // namespace epx
