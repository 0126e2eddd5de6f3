// The time model behind `epx plan`'s table (step_time.cpp explains each term).
#pragma once

#include <vector>

#include "epx/plan/plan.hpp"

namespace epx {

// Seconds per micro-batch on one rank of the slowest stage, by kind, and per step for the rest.
struct StepCosts {
  double compute = 0;       // GEMMs and attention at the size-dependent efficiency (the slowest stage's)
  std::vector<double> stage_compute;  // the same per pipeline stage, per micro-batch
  double other_stages = 0;  // the other stages' compute summed (the bubble's fill and drain)
  int stages = 1;           // pipeline stages
  double memory_bound = 0;  // permutation and elementwise at HBM bandwidth
  double host = 0;          // launches and host syncs per MoE layer
  double exchange = 0;      // the token exchanges (plan_comm)
  double tp_cp_pp = 0;      // TP / CP collectives and PP point-to-point
  double dp = 0;            // per step: the gradient reduction the last backward does not hide
  double dp_merged = 0;     // the same under the EP-overlap schedule (differs with the rows split)
  double optimizer = 0;     // per step: the optimizer step
};
// Seconds of epx's blocked attention (rates.attention_tflops > 0: the cpu runtime),
// forward and backward, for `layers` layers and `tokens` tokens of one rank: Megatron's causal
// attention FLOPs at the rate `epx plan --calibrate` measures for the kernel itself (its strip
// GEMMs, softmax and the backward's recomputed probabilities together).
double cpu_attention_s(const ModelConfig& m, double layers, double tokens, double flops_per_s);
StepCosts step_costs(const Config& resolved, const LayoutPlan& layout, const GpuInfo& gpu, const CommPlan& comm,
                     const MemoryPlan& memory, Dispatcher dispatcher);

struct StepTime {
  double total = 0, layers = 0, bubble = 0, compute = 0, exposed_comm = 0;
  double exposed_dp = 0;  // the part of exposed_comm that is the DP reduction after the backward
};
StepTime step_time(const StepCosts& costs, double micro_batches, int vpp, bool ep_overlap, bool delay_wgrad);

}  // namespace epx
