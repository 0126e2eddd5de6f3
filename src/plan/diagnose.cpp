// `epx diagnose`: the three walls of the seeds' MoE optimization workflow, measured on a run, and
// the fixes of its Phase 3 table in priority order, each weighed by the planner.
#include "epx/plan/diagnose.hpp"

#include <algorithm>
#include <numeric>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "epx/check/pipeline_split.hpp"
#include "epx/config/schema.hpp"
#include "epx/plan/flops.hpp"
#include "epx/plan/pipeline_balance.hpp"
#include "epx/plan/plan.hpp"

namespace epx {
namespace {

// Thresholds of the verdict: memory binds near capacity; communication as the planner's rows
// (kCommunicationBinds); host gaps or a compute rate this far below the attainable one make the
// third wall a host-overhead one.
constexpr double kMemoryBinds = 0.90, kHostGaps = 0.15, kLowRate = 0.5;

// The planner's as-configured row of `c` with `overrides`, against `base`: the step time, or the
// time per sample where the overrides change the global batch, and the peak. Where the run
// measured its peak, the predicted one is scaled by measured / planned before it is judged.
struct Effect {
  std::string text;
  double time_ratio = 1;  // after / before
  bool fits = true;
};
Effect predicted_effect(const Config& c, const Variant& base, const std::vector<std::string>& overrides,
                        double measured_peak_gb) {
  const Replanned r = replan(c, overrides);
  if (!r.plan) return {"epx check refuses it here: " + r.refusal, 1, false};
  const Variant& v = r.plan->configured();
  const double batch = static_cast<double>(c.train.global_batch_size.value_or(1) * c.model.seq_length),
               new_batch = r.plan->flops_per_step / std::max(1e-30, r.plan->flops.per_token());  // tokens
  const bool per_sample = std::abs(new_batch / batch - 1) > 1e-6;
  const double before = per_sample ? base.step_time_s / batch * 1e6 : base.step_time_s,
               after = per_sample ? v.step_time_s / new_batch * 1e6 : v.step_time_s;
  const double scale = measured_peak_gb > 0 && base.peak_memory_gb > 0 ? measured_peak_gb / base.peak_memory_gb : 1;
  const double peak = v.peak_memory_gb * scale, capacity = r.plan->gpu.rates.memory_gb;
  const bool fits = r.plan->fits && (capacity <= 0 || peak <= capacity), tight = fits && tight_fit(peak, r.plan->gpu);
  return {fmt::format("planner: {} {:.3g} -> {:.3g} s ({:+.0f}%), peak {:.3g} -> {:.3g} GiB{}{}",
                      per_sample ? "time per million tokens" : "step", before, after, 100 * (after / before - 1),
                      base.peak_memory_gb, v.peak_memory_gb,
                      std::abs(scale - 1) > 0.02 ? fmt::format(" (x {:.2f}, measured / planned now: {:.3g} GiB)", scale, peak)
                                                 : "",
                      !fits ? " (does not fit)" : tight ? " (within 5% of the GPU's memory)" : ""),
          after / before, fits};
}

// Megatron's timers (a log with --timing-log-level 1 or 2) measure, without a trace, what the
// step waits for after the backward: the DP reduction left over (all-grads-sync, with its
// layernorm and embedding parts), the parameter all-gather, and the pipeline's blocking
// receives. The token exchanges sit inside forward / backward compute and are not timed apart.
bool is_dp_timer(const std::string& name) {
  static const std::set<std::string> kNames = {
      "all-grads-sync", "params-all-gather", "layernorm-grads-all-reduce", "embedding-grads-all-reduce",
      // Megatron-LM's names before September 2023, and before August 2022.
      "grads-all-reduce", "grads-reduce-scatter", "backward-params-all-reduce", "backward-embedding-all-reduce"};
  return kNames.contains(name);
}
struct TimedWaits {
  double dp_s = 0, pp_s = 0;  // per iteration
  std::string text;           // the timers shown, in words (empty: none logged)
};
TimedWaits timed_waits(const RunEvidence& run) {
  TimedWaits t;
  std::vector<std::string> shown;
  for (const auto& [name, ms] : run.timers_ms) {
    const bool dp = is_dp_timer(name), pp = name.ends_with("-recv");
    const auto min = run.timers_min_ms.find(name);
    // The max over ranks: the step waits for the slowest. Megatron starts the DP timers after a
    // barrier (barrier_with_L1_time, on by default), so a late rank's wait is not in them and
    // the spread is the ranks' own reductions (rank_note names it).
    if (dp) t.dp_s += ms / 1000;
    // Each receive's max is some rank's: their sum may add up waits of different ranks, so the
    // largest one stands for the pipeline's wait (a lower bound).
    if (pp) t.pp_s = std::max(t.pp_s, ms / 1000);
    if (dp || pp || name == "forward-backward" || name == "optimizer")
      shown.push_back(min != run.timers_min_ms.end() ? fmt::format("{} {:.4g}-{:.4g}", name, min->second, ms)
                                                     : fmt::format("{} {:.4g}", name, ms));
  }
  if (!shown.empty())
    t.text = fmt::format("Megatron's timers (ms per iteration, {} over ranks): {}",
                         run.timers_min_ms.empty() ? "max" : "min-max", fmt::join(shown, ", "));
  return t;
}

// Where Megatron's timers differ across ranks (--timing-log-option minmax, its default, or all):
// a rank slower than the rest (its pipeline stage's or its experts' load, a slow GPU, link or
// data loader) sets the pace of the collectives after it. The spreads of at least 10% of the
// timer and 2% of the step, largest first; with `all`, the rank that takes longest. The
// pipeline's sends and receives differ by stage whatever the load (the first stage receives no
// forward).
std::optional<std::string> rank_note(const RunEvidence& run) {
  struct Spread {
    std::string name;
    double min = 0, max = 0;
  };
  std::vector<Spread> spreads;
  for (const auto& [name, min] : run.timers_min_ms)
    if (const double max = run.timers_ms.at(name); name.find("-recv") == std::string::npos &&
                                                   name.find("-send") == std::string::npos && max - min >= 0.1 * max &&
                                                   max - min >= 20 * run.mean_step_s)
      spreads.push_back({name, min, max});
  if (spreads.empty()) return std::nullopt;
  std::sort(spreads.begin(), spreads.end(), [](const Spread& a, const Spread& b) { return a.max - a.min > b.max - b.min; });
  if (spreads.size() > 3) spreads.resize(3);
  std::vector<std::string> shown, ranks;
  for (const Spread& s : spreads) {
    shown.push_back(fmt::format("{} ({:.4g} to {:.4g} ms per iteration)", s.name, s.min, s.max));
    const auto by_rank = run.timers_by_rank_ms.find(s.name);
    if (by_rank == run.timers_by_rank_ms.end() || by_rank->second.size() < 2) continue;
    const auto most = std::max_element(by_rank->second.begin(), by_rank->second.end(),
                                       [](const auto& a, const auto& b) { return a.second < b.second; });
    ranks.push_back(fmt::format("rank {} takes longest in {}", most->first, s.name));
  }
  return fmt::format("the ranks' timers differ most in {}: a rank slower than the rest (its pipeline stage's or its "
                     "experts' load, a slow GPU, link or data loader) sets the pace of the collectives after it{}{}",
                     fmt::join(shown, ", "), ranks.empty() ? "" : "; ", fmt::join(ranks, ", "));
}

// What the log says beside the walls: iterations skipped or NaN, and steady-state steps far
// from the others (a straggler, a checkpoint save, a GC pause), which the mean includes.
std::vector<std::string> log_notes(const RunEvidence& run) {
  std::vector<std::string> notes;
  if (run.cut_off)
    notes.push_back("the log's last line has no end (the run was still writing it): it is left out");
  if (run.unread_lines > 0)
    notes.push_back(fmt::format("{} line(s) of the log with an elapsed time per iteration do not read as Megatron's "
                                "iteration line (cut short or run into by another rank's output?), the first at line {}: "
                                "left out",
                                run.unread_lines, run.first_unread_line));
  if (run.restarted_at > 0)
    notes.push_back(run.went_back
                        ? fmt::format("the log goes back to iteration {} (a requeued or resumed run appended to it): the "
                                      "later lines replace the earlier ones from there",
                                      run.restarted_at)
                        : fmt::format("the run was resumed at iteration {} (a second arguments dump): the resumed "
                                      "process's first iterations, its warm-up, are left out of the steady state",
                                      run.restarted_at));
  if (run.skipped_iterations > 0 || run.nan_iterations > 0)
    notes.push_back(fmt::format("the log counts {} skipped and {} NaN iteration(s): the loss scale or the data, not the "
                                "walls, first",
                                run.skipped_iterations, run.nan_iterations));
  // epx run with check_for_nan_in_loss off goes on past a NaN loss (its results write null).
  if (run.diverged_at > 0)
    notes.push_back(fmt::format("the LM loss is NaN or infinite from iteration {}: the training diverged (a learning rate "
                                "too high, no gradient clipping?), so these figures time a diverged run",
                                run.diverged_at));
  std::vector<double> steps;
  for (const IterationPoint& p : run.iterations)
    if (p.iteration >= run.steady_first && p.iteration <= run.steady_last) steps.push_back(p.step_s);
  if (steps.size() < 3) return notes;
  std::nth_element(steps.begin(), steps.begin() + static_cast<long>(steps.size() / 2), steps.end());
  const double median = steps[steps.size() / 2];
  std::vector<std::string> slow;
  for (const IterationPoint& p : run.iterations)
    if (p.iteration >= run.steady_first && p.iteration <= run.steady_last && p.step_s > 1.3 * median)
      slow.push_back(fmt::format("{} ({:.2f}x)", p.iteration, p.step_s / median));
  if (!slow.empty())
    notes.push_back(fmt::format("steady-state iteration(s) {} took over 1.3x the median step ({:.3g} s): a straggler, "
                                "a checkpoint save or a GC pause? The mean above includes them",
                                fmt::join(slow, ", "), median));
  return notes;
}

}  // namespace

Diagnosis diagnose(const RunEvidence& run, const std::optional<Config>& config, const GpuInfo* gpu) {
  Diagnosis d;
  std::optional<Plan> plan;
  const Variant* base = nullptr;
  if (config) {
    plan = make_plan(*config);
    base = &plan->configured();
  } else {
    d.notes.push_back("no config: the planner's predictions and the fixes' effects are unknown (pass --config)");
  }
  const bool epx_runtime = gpu && !gpu->cuda();
  const double step = run.mean_step_s;

  // Memory: the peak against the capacity; and whether only full recompute makes it fit (with
  // the selective modules the memory fix below offers, as advise weighs them).
  WallFigure memory{"memory", 0, "", true};
  bool only_with_full = false;
  const std::string peak = run.peak_memory_gb > 0 ? fmt::format("peak {:.3g} GiB", run.peak_memory_gb)
                                                  : std::string("peak not logged (no memory lines)");
  if (gpu && gpu->rates.memory_gb > 0) {
    memory.share = run.peak_memory_gb / gpu->rates.memory_gb;
    memory.evidence = run.peak_memory_gb > 0 ? fmt::format("{} of {:.3g} GiB ({:.0f}%)", peak, gpu->rates.memory_gb,
                                                           100 * memory.share)
                                             : peak;
    if (config && config->model.recompute_granularity == std::optional<std::string>("full")) {
      const Replanned selective = replan(*config, selective_recompute_overrides(config->model));
      only_with_full = selective.plan && !selective.plan->fits;
      memory.evidence += only_with_full ? "; it fits only with full recompute (the planner: selective does not fit)"
                                        : "; full recompute is on, but selective recompute would fit (the planner)";
    }
  } else {
    memory.evidence = peak + "; capacity unknown (name the GPU with -g)";
  }
  d.walls.push_back(memory);

  // Communication: exposed (not covered by compute) share of the step, by kind, from the trace;
  // else the planner's.
  WallFigure comm{"communication", 0, "", true};
  if (run.trace) {
    const TraceBreakdown& t = *run.trace;
    comm.share = t.exposed_s / t.step_s;
    // At EP 1 (and ETP 1) the dispatcher's "exchanges" are copies within the rank (on the comm
    // stream all the same), as the run summary has it.
    const bool ep1 = config && config->model.expert_model_parallel_size * effective_etp(config->model) == 1;
    comm.evidence = fmt::format(
        "{:.3g} s of {:.3g} s per step exposed ({:.0f}%): {} {:.3g} s exposed of {:.3g} s in flight, DP "
        "gradient reduction {:.3g} of {:.3g} s, other {:.3g} of {:.3g} s{} (rank 0, iterations {}..{})",
        t.exposed_s, t.step_s, 100 * comm.share,
        ep1 ? "token dispatch and combine (EP 1, ETP 1: copies within the rank, no exchange)" : "token exchanges",
        t.token_exchange_exposed_s, t.token_exchange_s, t.dp_reduce_exposed_s,
        t.dp_reduce_s, t.other_comm_exposed_s, t.other_comm_s,
        t.pipeline_wait_s > 0 ? fmt::format(", waiting on the other pipeline stages (bubble + p2p) {:.3g} s", t.pipeline_wait_s)
                              : "",
        run.steady_first, run.steady_last);
  } else if (base) {
    comm.measured = false;
    comm.share = base->exposed_comm_s / base->step_time_s;
    comm.evidence = fmt::format("no trace: the planner predicts {:.3g} s of {:.3g} s exposed ({:.0f}%)",
                                base->exposed_comm_s, base->step_time_s, 100 * comm.share);
  } else {
    comm.evidence = "unknown: no trace and no config";
  }
  const TimedWaits timed = run.trace ? TimedWaits{} : timed_waits(run);
  const double timed_dp = timed.dp_s, timed_pp = timed.pp_s;
  if (!timed.text.empty()) {
    // The timers measure the DP reduction and the pipeline's waits; the token exchanges inside
    // forward and backward stay the planner's.
    const double exchanges = base ? (base->exposed_comm_s - base->exposed_dp_s) / base->step_time_s : 0;
    comm.share = (timed_dp + timed_pp) / step + exchanges;
    comm.measured = true;
    comm.evidence += fmt::format("; {}: the DP reduction and pipeline waits {:.3g} s of the {:.3g} s step measured{}",
                                 timed.text, timed_dp + timed_pp, step,
                                 base ? fmt::format(", with the planner's {:.0f}% for the token exchanges", 100 * exchanges)
                                      : "");
  }
  // The pipeline's waits, per stage, from the results (with or without a trace, which is rank
  // 0's alone): the stage that waits most tells what the step loses to the others.
  double pipeline_share = 0;
  if (run.pipeline) {
    const PipelineEvidence& p = *run.pipeline;
    std::vector<std::string> stages;
    const std::vector<double> compute = p.compute_s();
    for (std::size_t k = 0; k < p.wait_s.size(); ++k) {
      stages.push_back(fmt::format("{:.3g} / {:.3g}", compute[k], p.wait_s[k]));
      pipeline_share = std::max(pipeline_share, p.wait_s[k] / std::max(1e-12, p.schedule_s[k]));
    }
    comm.evidence += fmt::format("; pipeline PP {} x VPP {}, {} micro-batches: each stage computes / waits on the others "
                                 "{} s per iteration (up to {:.0f}% of a stage's schedule waiting; the ideal bubble is "
                                 "{:.0f}% of the compute)",
                                 p.stages, p.chunks, p.micro_batches, fmt::join(stages, ", "), 100 * pipeline_share,
                                 100 * p.ideal_bubble);
    if (pipeline_share > comm.share) comm.share = pipeline_share, comm.measured = true;
  }
  d.walls.push_back(comm);

  // Compute and host: idle gaps on the compute thread, and the compute rate while computing
  // against the hardware's attainable rate (its peak at the calibrated GEMM efficiency).
  WallFigure host{"compute/host", 0, "", true};
  double rate_share = -1;
  // While computing: the trace's compute (rank 0), or with PP the stages' mean compute (the
  // model's FLOPs are every stage's).
  double computing = run.trace ? run.trace->compute_s : step;
  if (run.pipeline && !run.pipeline->schedule_s.empty()) {
    const std::vector<double> compute = run.pipeline->compute_s();
    computing = std::accumulate(compute.begin(), compute.end(), 0.0) / static_cast<double>(compute.size());
  }
  const std::string while_computing = computing < step ? "while computing" : "over the whole step (no trace)";
  std::string rate_basis;
  if (run.throughput_logged) {
    d.tflops_per_gpu = run.tflops_per_gpu;
  } else if (plan && plan->layout.layout.world > 0) {
    // The log's world and batch where it says them (a config that differs gets a note below).
    const double world = run.ranks > 0 ? run.ranks : plan->layout.layout.world;
    const double batch = run.global_batch_size > 0 && config->train.global_batch_size
                             ? static_cast<double>(run.global_batch_size) / static_cast<double>(*config->train.global_batch_size)
                             : 1.0;
    d.tflops_per_gpu = plan->flops_per_step * batch / step / world / 1e12;
    rate_basis = "; the log has no throughput (Megatron's --log-throughput), so this is Megatron's FLOPs of the config "
                 "over the logged step";
  }
  const double achieved = d.tflops_per_gpu.value_or(0) * step / std::max(1e-12, computing);
  if (!d.tflops_per_gpu) {
    host.evidence = "rate unknown: the log has no throughput (Megatron's --log-throughput) and there is no config "
                    "to count the FLOPs (--config)";
  } else if (gpu && gpu->rates.bf16_tflops > 0) {
    const double peak = gpu->rates.bf16_tflops, layers_rate = peak * gpu->rates.gemm_efficiency;
    double attainable = layers_rate;
    std::string basis = fmt::format("{:.3g} peak x gemm_efficiency {:.2g}", peak, gpu->rates.gemm_efficiency);
    if (!gpu->cuda() && config) {
      // On cpu the planner times the output layer's GEMMs at the peak (gemm_efficiency is fitted
      // to the layers alone): the attainable rate is the model's FLOPs over that time.
      const ModelFlops f = model_flops(*config);
      const double head = f.logits / std::max(1e-30, f.per_token());
      attainable = 1 / ((1 - head) / layers_rate + head / peak);
      basis += fmt::format(", the output layer's {:.0f}% of the FLOPs at the peak", 100 * head);
    }
    rate_share = achieved / attainable;
    host.evidence = fmt::format("{:.3g} TFLOP/s/GPU {}, {:.0f}% of the attainable {:.3g} ({}){}", achieved, while_computing,
                                100 * rate_share, attainable, basis, rate_basis);
    if (config && config->model.fp8)
      host.evidence += "; the run computes its GEMMs in FP8, above this BF16 rate";
    // One efficiency for every model: calibrated on a narrower one (the cpu catalog entry's proxy),
    // it under-rates a wider model's GEMMs.
    if (rate_share > 1.05)
      host.evidence += "; above it: the GEMM efficiency was measured on another model or machine "
                       "(`epx plan CONFIG --calibrate` on this one for a fair figure)";
  } else {
    host.evidence = fmt::format("{:.3g} TFLOP/s/GPU {}; the attainable rate is unknown (-g){}", achieved,
                                while_computing, rate_basis);
  }
  if (run.trace) {
    host.share = run.trace->idle_s / run.trace->step_s;
    host.evidence += fmt::format("; the compute thread idle {:.0f}% of the step (host gaps)", 100 * host.share);
  }
  // An epx run's CPU: its communication threads' work shares the rank's cores with the compute.
  const double cores_busy = run.cores_per_rank > 0 ? run.cpu_s_per_iteration / (run.mean_step_s * run.cores_per_rank) : -1;
  if (cores_busy >= 0)
    host.evidence += fmt::format("; rank 0's threads kept its {:.3g} core(s) {:.0f}% busy", run.cores_per_rank, 100 * cores_busy);
  d.walls.push_back(host);

  // Idle gaps are the host's; a low rate without them is the kernels' (small or unfused).
  // Without a trace the two look alike, and on a GPU a low rate is most often launch-bound.
  const bool host_gaps = host.share >= kHostGaps, low_rate = rate_share >= 0 && rate_share < kLowRate;
  const bool maybe_host = host_gaps || (low_rate && !run.trace);

  // The verdict.
  if (memory.share >= kMemoryBinds || only_with_full) {
    d.binding = "memory";
    d.why = memory.evidence;
  } else if (comm.share >= kCommunicationBinds) {
    d.binding = "communication";
    d.why = comm.evidence;
  } else {
    d.binding = "compute/host";
    const std::string what = host_gaps              ? "host overhead: "
                             : !d.tflops_per_gpu    ? "compute or host overhead: "
                             : !low_rate            ? "compute: "
                             : run.trace ? "compute below its attainable rate (small or unfused kernels): "
                                         : "compute or host overhead (no trace to tell idle gaps from small kernels): ";
    d.why = what + host.evidence;
    if (!run.trace && !base) d.why += "; communication is unknown (no trace, no config), so this is by elimination";
  }

  for (std::string& n : log_notes(run)) d.notes.push_back(std::move(n));
  if (auto n = rank_note(run)) d.notes.push_back(std::move(*n));
  // Overlap hides a wait only under idle cores: where rank 0's exposed communication (its own
  // trace's, not a pipeline's stage waits) is more than they leave, the rest of it is CPU time.
  const double exposed = run.trace ? run.trace->exposed_s / run.trace->step_s : 0;
  if (const double idle = 1 - std::min(1.0, cores_busy); cores_busy >= 0 && exposed > idle)
    d.notes.push_back(fmt::format(
        "rank 0's threads kept its {:.3g} core(s) {:.0f}% busy ({:.3g} s of CPU per iteration): more overlap can cut at "
        "most their idle {:.0f}% of the step, not all of the {:.0f}% of communication exposed; the communication threads' "
        "work (MPI's progress and copies, and over TCP the network stack's) runs on the cores the compute needs; more "
        "cores per rank or less traffic cut it",
        run.cores_per_rank, 100 * cores_busy, run.cpu_s_per_iteration, 100 * idle, 100 * exposed));
  // The planner times balanced routing; over EP ranks, the rank holding the busiest experts
  // computes and receives more, and the others wait for it. The EP ranks' load says how long
  // (results before it was measured have only the experts').
  const bool ep_ranks = run.config && run.config->model.expert_model_parallel_size * effective_etp(run.config->model) > 1;
  const bool uneven = run.ep_rank_load > 0 ? run.ep_rank_load >= 1.2 : run.expert_load >= 1.3;
  if (uneven && ep_ranks) {
    const ModelConfig& m = run.config->model;
    const double coeff = aux_loss_coeff(m, "aux_loss") + aux_loss_coeff(m, "seq_aux_loss") + aux_loss_coeff(m, "global_aux_loss");
    d.notes.push_back(fmt::format(
        "the busiest expert routed {:.2f}x the mean tokens{} (the mean over the MoE layers, iterations {}..{}), where the "
        "planner times balanced routing: the EP rank holding the busiest experts computes and receives more, and the "
        "others wait for it; {}, the expert bias or moe_router_force_load_balancing (benchmarks) even it",
        run.expert_load,
        run.ep_rank_load > 0 ? fmt::format(", the busiest EP rank's local experts {:.2f}x the mean rank's", run.ep_rank_load) : "",
        run.steady_first, run.steady_last,
        coeff > 0 ? fmt::format("a larger aux-loss coefficient (moe_aux_loss_coeff {})", field_text(*run.config, "model.moe_aux_loss_coeff"))
                  : "a load-balancing loss (moe_aux_loss_coeff)"));
  }
  // An epx run names its layout: a config (or --override) that plans another is not the run's.
  if (plan && run.layout.starts_with("world ") && plan->layout.layout.describe() != run.layout)
    d.notes.push_back(fmt::format("the run's layout is {}, the config plans {}: the planner's figures are for the "
                                  "config's",
                                  run.layout, plan->layout.layout.describe()));
  // A log names its own world and batch: a config that says otherwise is not the run's.
  if (config && run.ranks > 0 && config->target.num_gpus && *config->target.num_gpus != run.ranks)
    d.notes.push_back(fmt::format("the run had {} ranks (its arguments dump), the config plans {}: the planner's figures "
                                  "are for the config's (-ng {} for the run's)",
                                  run.ranks, *config->target.num_gpus, run.ranks));
  if (config && run.global_batch_size > 0 && config->train.global_batch_size &&
      *config->train.global_batch_size != run.global_batch_size)
    d.notes.push_back(fmt::format("the log's global batch is {}, the config's {}: is this the run's config? "
                                  "(--override train.global_batch_size={})",
                                  run.global_batch_size, *config->train.global_batch_size, run.global_batch_size));

  // The fixes, in the seeds' order for the binding wall (Phase 1 for memory, Phase 3 for the rest).
  const ModelConfig* m = config ? &config->model : nullptr;
  // A fix epx's runtime lacks is named, on an epx run, in one note; outside the memory wall, one
  // the planner predicts slower, or not to fit, is left out and named in another (unless the
  // fix comes from what the run measured, which the planner does not see: `measured`).
  std::vector<std::string> not_on_epx, left_out;
  const auto add = [&](const std::string& wall, const std::string& what, std::vector<std::string> overrides,
                       bool on_epx = true, bool measured = false) {
    if (epx_runtime && !on_epx) return not_on_epx.push_back(what);
    Fix f{wall, what, std::move(overrides), ""};
    if (config && base && !f.overrides.empty()) {
      const Effect e = predicted_effect(*config, *base, f.overrides, run.peak_memory_gb);
      if (wall != "memory" && !measured && (e.time_ratio > 1.01 || !e.fits) && e.text.find("refuses") == std::string::npos)
        return left_out.push_back(fmt::format("{} ({})", what, e.text));
      f.predicted = e.text;
    }
    d.fixes.push_back(f);
  };
  if (d.binding == "memory" && m) {
    if (!m->recompute_granularity)
      add("memory", "selective recompute first (core_attn, moe_act, layernorm)",
          selective_recompute_overrides(*m));
    if (!config->ddp.use_distributed_optimizer)
      add("memory", "shard the optimizer state over DP (the distributed optimizer)",
          {"ddp.use_distributed_optimizer=true", "optimizer.use_distributed_optimizer=true"});
    if (m->recompute_granularity != std::optional<std::string>("full")) {
      add("memory", "full recompute, only if it still does not fit", full_recompute_overrides(*config));
    }
    if (m->num_layers % (2 * m->pipeline_model_parallel_size) == 0)
      add("memory", "a deeper pipeline (PP x2) spreads the layers", {fmt::format("model.pipeline_model_parallel_size={}", 2 * m->pipeline_model_parallel_size)},
          false);
    add("memory", m->fp8 ? "activation offloading, when recompute and parallelism are not enough"
                         : "FP8 and activation offloading, when recompute and parallelism are not enough",
        {}, false);
  } else if (d.binding == "communication" && m) {
    const bool dp_dominates = run.trace ? run.trace->dp_reduce_exposed_s > run.trace->token_exchange_exposed_s
                                        : timed_dp > 0.5 * comm.share * step;  // the timed DP wait is most of it
    const ParallelLayout& groups = plan->layout.layout;
    const auto token_fixes = [&] {
      if (groups.ep == 1) return;  // no token exchanges
      if (m->moe_token_dispatcher_type != "flex")
        add("communication", "a flex dispatcher: DeepEP sends one copy per destination node, not per expert",
            {"model.moe_token_dispatcher_type=flex", "model.moe_flex_dispatcher_backend=deepep"});
      if (!m->overlap_moe_expert_parallel_comm) {
        std::vector<std::string> o = {"comm_overlap.overlap_moe_expert_parallel_comm=true",
                                      "comm_overlap.delay_wgrad_compute=true"};
        // With PP it needs the interleaved schedule's VPP set (ep_overlap.pp_needs_vpp).
        const bool vpp = m->pipeline_model_parallel_size > 1 && !m->virtual_pipeline_model_parallel_size;
        if (vpp) o.push_back(vpp_to_set(*m));
        add("communication",
            vpp ? "EP overlap with delayed wgrad, on the interleaved schedule it needs at PP > 1: the exchanges run under "
                  "the other micro-batch's compute"
                : "EP overlap with delayed wgrad: the exchanges run under the other micro-batch's compute",
            o);
      }
    };
    const auto dp_fixes = [&] {
      if (groups.dp * groups.cp == 1 && groups.edp == 1) return;  // no gradient reduction
      if (!config->ddp.overlap_grad_reduce)
        add("communication", "overlap the DP gradient reduction with the last backward (buckets of ddp.bucket_size)",
            {"ddp.overlap_grad_reduce=true"});
      // epx's own: the embedding's table is the last bucket, after the backward.
      else if (epx_runtime && !config->ddp.reduce_embedding_rows &&
               !(m->share_embeddings_and_output_weights && m->pipeline_model_parallel_size == 1))  // check's ddp.embedding_rows
        add("communication",
            "reduce the embedding's table under the last micro-batch and only that micro-batch's token rows after "
            "the backward (epx's own)",
            {"ddp.reduce_embedding_rows=true"});
      // What is left after the backward, smaller: half the bytes, then half the collective.
      if (config->ddp.grad_reduce_in_fp32 && m->bf16)
        add("communication", "reduce the gradients in BF16: half the bytes of FP32", {"ddp.grad_reduce_in_fp32=false"});
      if (!config->ddp.use_distributed_optimizer)
        add("communication",
            "the distributed optimizer: a reduce-scatter instead of the all-reduce after the backward, the parameters' "
            "all-gather under the next forward",
            {"ddp.use_distributed_optimizer=true", "optimizer.use_distributed_optimizer=true", "ddp.overlap_param_gather=true",
             "optimizer.overlap_param_gather=true"});
    };
    // The pipeline: an even split of the measured compute, then a smaller bubble.
    const auto pipeline_fixes = [&] {
      if (m->pipeline_model_parallel_size < 2) return;
      // The stages' balance needs their measured compute (epx results); the bubble's fixes do not.
      const std::vector<double> compute = run.pipeline ? run.pipeline->compute_s() : std::vector<double>{};
      const auto b = run.pipeline ? balance_pipeline(*m, compute) : std::nullopt;
      if (b && !b->helps() && b->slowest_now_s > 1.2 * *std::min_element(compute.begin(), compute.end()))
        d.notes.push_back(fmt::format(
            "pipeline stage {} computes {:.3g} s per iteration against {:.3g} s on the fastest, which waits for it "
            "beyond the bubble; no placement of whole layers shortens it by 5% (a layer measured at {:.3g} s)",
            b->slowest_stage, b->slowest_now_s, *std::min_element(compute.begin(), compute.end()), b->per_layer_s));
      if (b && b->helps())
        add("communication",
            fmt::format("balance the stages: stage {} computes {:.3g} s per iteration and the others wait for it; {} "
                        "decoder layers per stage instead of {} bring the slowest to about {:.3g} s (a layer measured "
                        "at {:.3g} s)",
                        b->slowest_stage, b->slowest_now_s, fmt::join(b->layers_balanced, " / "),
                        fmt::join(b->layers_now, " / "), b->slowest_balanced_s, b->per_layer_s),
            layout_overrides(*m, b->layout), true, true);
      if (virtual_pipeline_size(*m).value_or(1) == 1 && !m->pipeline_model_parallel_layout)
        if (const auto v = smallest_splitting_vpp(*m, 4))
          add("communication",
              fmt::format("the interleaved schedule (VPP {}): the bubble falls from (PP - 1) / m to (PP - 1) / "
                          "(VPP x m) of the compute",
                          *v),
              {fmt::format("model.virtual_pipeline_model_parallel_size={}", *v)});
      const Int mbs = config->train.micro_batch_size.value_or(1);
      if (mbs % 2 == 0)
        add("communication", "more, smaller micro-batches: the bubble is (PP - 1) / (VPP x m) of the compute",
            {fmt::format("train.micro_batch_size={}", mbs / 2)});
      else if (config->train.global_batch_size)
        add("communication",
            "more micro-batches with a larger global batch (the bubble is (PP - 1) / (VPP x m) of the compute; "
            "this changes the optimization)",
            {fmt::format("train.global_batch_size={}", 2 * *config->train.global_batch_size)});
    };
    // The kind that leaves the most exposed first.
    const double token_exposed = run.trace ? run.trace->token_exchange_exposed_s : 0,
                 dp_exposed = run.trace ? run.trace->dp_reduce_exposed_s : timed_dp,
                 pipeline_wait = std::max({run.trace ? run.trace->pipeline_wait_s : 0.0, pipeline_share * step, timed_pp});
    const bool pipeline_dominates = (run.pipeline || timed_pp > 0) && pipeline_wait >= std::max(token_exposed, dp_exposed) &&
                                    (run.trace || pipeline_share >= comm.share || timed_pp > timed_dp);
    if (pipeline_dominates) pipeline_fixes();
    if (dp_dominates) dp_fixes(), token_fixes();
    else token_fixes(), dp_fixes();
    if (!pipeline_dominates) pipeline_fixes();
    if (m->tensor_model_parallel_size > 1)
      add("communication", "TP communication overlap", {"comm_overlap.tp_comm_overlap=true"}, false);
  } else if (m) {
    const Int mbs = config->train.micro_batch_size.value_or(1);
    if (host_gaps || low_rate) {
      if (maybe_host && !epx_runtime && m->cuda_graph_impl == "none")
        add("compute/host", "CUDA graphs over the router and preprocess (launch-bound traces)",
            {"model.cuda_graph_impl=transformer_engine", "model.cuda_graph_scope=[attn,moe_router,moe_preprocess]"});
      if (config->train.global_batch_size && *config->train.global_batch_size % (2 * mbs * plan->layout.layout.dp) == 0)
        add("compute/host", "a larger micro-batch: fewer, larger kernels", {fmt::format("train.micro_batch_size={}", 2 * mbs)});
      if (maybe_host && !config->train.manual_gc) add("compute/host", "--manual-gc and CPU affinity tuning", {}, false);
    }
    if (!m->moe_grouped_gemm) add("compute/host", "grouped GEMM for the experts", {"model.moe_grouped_gemm=true"});
    if (!m->moe_permute_fusion) add("compute/host", "fused permutation", {"model.moe_permute_fusion=true"}, false);
    add("compute/host", m->fp8 ? "the dispatcher's kernel tuning (SMs); FP8 is on already"
                               : "FP8, and the dispatcher's kernel tuning (SMs)",
        {}, false);
  }
  if (!not_on_epx.empty())
    d.notes.push_back(fmt::format("for the target, not in epx's CPU runtime yet: {}", fmt::join(not_on_epx, "; ")));
  for (const std::string& f : left_out) d.notes.push_back("left out, the planner predicts it slower or not to fit: " + f);
  return d;
}

std::string format_diagnosis(const RunEvidence& run, const Diagnosis& d) {
  const int first = run.first_iteration, last = run.iterations.empty() ? 0 : run.iterations.back().iteration;
  const std::string iterations = first > 1 ? fmt::format("iterations {}..{} ({} logged)", first, last, run.iterations.size())
                                 : static_cast<std::size_t>(last) == run.iterations.size()
                                     ? fmt::format("{} iterations", last)
                                     : fmt::format("{} iterations ({} logged)", last, run.iterations.size());
  std::string out = fmt::format("epx diagnose: {} ({}{}), {}, steady {}..{}: {:.3g} s/step, {}, {}\n",
                                run.source, run.kind, run.layout.empty() ? "" : ", " + run.layout, iterations,
                                run.steady_first, run.steady_last, run.mean_step_s,
                                d.tflops_per_gpu ? fmt::format("{:.3g} TFLOP/s/GPU{}", *d.tflops_per_gpu,
                                                               run.throughput_logged ? "" : " (from the config's FLOPs)")
                                                 : "throughput not logged",
                                run.peak_memory_gb > 0 ? fmt::format("peak {:.3g} GiB", run.peak_memory_gb)
                                                       : "peak not logged");
  out += fmt::format("\nbinding wall: {}\n  {}\n\n", d.binding, d.why);
  for (const WallFigure& w : d.walls)
    out += fmt::format("  {:<14} {}{}\n", w.wall, w.evidence, w.measured ? "" : " [predicted]");
  if (!d.fixes.empty()) out += fmt::format("\nfixes for the {} wall, in order:\n", d.binding);
  for (std::size_t i = 0; i < d.fixes.size(); ++i) {
    const Fix& f = d.fixes[i];
    out += fmt::format("  {}. {}\n", i + 1, f.what);
    for (const std::string& o : f.overrides) out += fmt::format("       {}\n", o);
    if (!f.predicted.empty()) out += fmt::format("     {}\n", f.predicted);
  }
  for (const std::string& n : d.notes) out += fmt::format("note: {}\n", n);
  return out;
}

nlohmann::json diagnosis_json(const RunEvidence& run, const Diagnosis& d) {
  nlohmann::json j;
  j["run"] = {{"source", run.source}, {"kind", run.kind}, {"mean_step_time_s", run.mean_step_s},
              {"tflops_per_gpu", d.tflops_per_gpu ? nlohmann::json(*d.tflops_per_gpu) : nlohmann::json(nullptr)},
              {"peak_memory_gb", run.peak_memory_gb},
              {"steady_state_iterations", {run.steady_first, run.steady_last}}};
  if (run.trace) {
    const TraceBreakdown& t = *run.trace;
    j["trace"] = {{"step_s", t.step_s},
                  {"compute_s", t.compute_s},
                  {"idle_s", t.idle_s},
                  {"exposed_s", t.exposed_s},
                  {"token_exchange_s", t.token_exchange_s},
                  {"token_exchange_exposed_s", t.token_exchange_exposed_s},
                  {"dp_reduce_s", t.dp_reduce_s},
                  {"dp_reduce_exposed_s", t.dp_reduce_exposed_s},
                  {"other_comm_s", t.other_comm_s},
                  {"other_comm_exposed_s", t.other_comm_exposed_s},
                  {"pipeline_wait_s", t.pipeline_wait_s}};
  }
  if (run.pipeline) {
    const PipelineEvidence& p = *run.pipeline;
    j["pipeline"] = {{"stages", p.stages},           {"virtual_stages_per_stage", p.chunks},
                     {"micro_batches", p.micro_batches}, {"ideal_bubble", p.ideal_bubble},
                     {"stage_schedule_s", p.schedule_s}, {"stage_wait_s", p.wait_s}};
  }
  j["binding_wall"] = d.binding;
  j["why"] = d.why;
  for (const WallFigure& w : d.walls)
    j["walls"].push_back({{"wall", w.wall}, {"share", w.share}, {"evidence", w.evidence}, {"measured", w.measured}});
  j["fixes"] = nlohmann::json::array();
  for (const Fix& f : d.fixes)
    j["fixes"].push_back({{"wall", f.wall}, {"what", f.what}, {"overrides", f.overrides}, {"predicted", f.predicted}});
  j["notes"] = d.notes;
  return j;
}

}  // namespace epx
