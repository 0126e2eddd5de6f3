#include "epx/trainer.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <fstream>
#include <iostream>

#include <fmt/format.h>

#include "epx/comm_stream.hpp"
#include "epx/dispatcher.hpp"
#include "epx/error.hpp"
#include "epx/gpt_model.hpp"
#include "epx/optimizer.hpp"
#include "epx/process_groups.hpp"
#include "epx/schedule.hpp"
#include "epx/trace.hpp"

namespace epx {
namespace {

using Clock = std::chrono::steady_clock;

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

ParallelLayout layout_for(const Config& c, int world) {
  const ModelConfig& m = c.model;
  if (m.pipeline_model_parallel_size != 1)
    throw ConfigError(fmt::format("model.pipeline_model_parallel_size={}: epx run trains with PP = 1; set it to 1",
                                  m.pipeline_model_parallel_size));
  if (m.tensor_model_parallel_size != 1 || m.context_parallel_size != 1)
    throw ConfigError(fmt::format(
        "model.tensor_model_parallel_size={}, model.context_parallel_size={}: epx run splits attention "
        "by data parallelism only; set both to 1 (expert_tensor_parallel_size still splits the experts)",
        m.tensor_model_parallel_size, m.context_parallel_size));
  if (c.target.num_gpus != world)
    throw ConfigError(fmt::format("target.num_gpus={}: the job has {} ranks; launch {} ranks or set -ng {}",
                                  c.target.num_gpus.value_or(0), world, c.target.num_gpus.value_or(0), world));
  return ParallelLayout::make(world, 1, 1, 1, static_cast<int>(m.expert_model_parallel_size),
                              static_cast<int>(effective_etp(m)));
}

// Sums `params`' gradients over `group` in one flat all-reduce (a gradient bucket) on the comm
// stream, then scales them by `scale`.
void reduce_gradients(const std::vector<Param*>& params, Communicator& group, CommStream& stream, float scale,
                      const char* name) {
  std::int64_t n = 0;
  for (const Param* p : params) n += p->grad.numel();
  if (n == 0) return;
  std::vector<float> flat(static_cast<std::size_t>(n));
  std::int64_t at = 0;
  for (const Param* p : params) {
    std::copy_n(p->grad.data<float>(), p->grad.numel(), flat.data() + at);
    at += p->grad.numel();
  }
  if (group.size() > 1) stream.run([&] { group.allreduce(flat.data(), n, DType::F32); }, name);
  at = 0;
  for (Param* p : params) {
    float* g = p->grad.data<float>();
    for (std::int64_t i = 0; i < p->grad.numel(); ++i) g[i] = flat[static_cast<std::size_t>(at + i)] * scale;
    at += p->grad.numel();
  }
}

double sum_of_squares(const std::vector<Param*>& params) {
  double s = 0;
  for (const Param* p : params) {
    const float* g = p->grad.data<float>();
    for (std::int64_t i = 0; i < p->grad.numel(); ++i) s += static_cast<double>(g[i]) * g[i];
  }
  return s;
}

std::int64_t max_over(Communicator& world, std::int64_t v) {
  std::vector<std::int64_t> all(static_cast<std::size_t>(world.size()));
  world.allgatherv(&v, all.data(), std::vector<std::int64_t>(all.size(), 1), DType::I64);
  return *std::max_element(all.begin(), all.end());
}

std::string timestamp() {
  const std::time_t now = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", std::localtime(&now));
  return buf;
}

}  // namespace

nlohmann::json TrainResult::to_json() const {
  nlohmann::json its = nlohmann::json::array();
  for (const IterationLog& i : iterations)
    its.push_back({{"iteration", i.iteration}, {"consumed_samples", i.consumed_samples}, {"step_time_s", i.step_s},
                   {"tflops_per_rank", i.tflops_per_rank}, {"learning_rate", i.lr}, {"lm_loss", i.lm_loss},
                   {"load_balancing_loss", i.load_balancing_loss}, {"grad_norm", i.grad_norm},
                   {"mem_allocated_bytes", i.mem_allocated}, {"mem_max_allocated_bytes", i.mem_max_allocated}});
  nlohmann::json summary{{"steady_state_iterations", {steady_first, steady_last}},
                         {"mean_step_time_s", mean_step_s},
                         {"tflops_per_rank", tflops_per_rank},
                         {"model_flops_per_iteration", flops_per_iteration},
                         {"peak_memory_bytes", peak_memory_bytes},
                         {"final_lm_loss", final_loss},
                         {"comm_in_flight_s", comm_in_flight_s},
                         {"comm_thread_cpu_s", comm_thread_cpu_s},
                         {"layout", layout},
                         {"dispatcher", dispatcher},
                         {"schedule", schedule},
                         {"recompute", recompute}};
  if (traced) {
    summary["exposed_comm_s"] = traced->exposed_comm_s;
    summary["traced_comm_s"] = traced->comm_s;
    summary["token_exchange_s"] = traced->token_exchange_s;
    summary["exposed_token_exchange_s"] = traced->exposed_token_exchange_s;
  }
  return {{"summary", summary}, {"iterations", its}};
}

TrainResult train(const Config& cfg, Communicator& world, const TrainOptions& options, std::ostream& out) {
  // Everything that can be wrong with the config is found here, on every rank alike, before
  // anything is computed.
  const ParallelLayout layout = layout_for(cfg, world.size());
  const ModelSpec spec = model_spec_from_config(cfg);
  const std::int64_t iters = cfg.train.train_iters.value_or(0);
  if (iters < 1)
    throw ConfigError(fmt::format("train.train_iters={}: set the number of iterations (or --max_steps)",
                                  cfg.train.train_iters ? std::to_string(*cfg.train.train_iters) : "None"));
  const std::int64_t gbs = cfg.train.global_batch_size.value_or(0), mbs = spec.micro_batch, dp = layout.dp;
  if (gbs < 1 || gbs % (mbs * dp) != 0)
    throw ConfigError(fmt::format(
        "train.global_batch_size={}: must be a positive multiple of micro_batch_size x data-parallel size "
        "= {} x {} = {} (each DP rank runs an equal number of micro-batches); set it to {}",
        gbs, mbs, dp, mbs * dp, std::max<std::int64_t>(1, gbs / (mbs * dp)) * mbs * dp));
  const std::int64_t micro_batches = gbs / (mbs * dp);
  const LrSchedule schedule = lr_schedule_from_config(cfg, iters);
  const ScheduleOptions schedule_options = schedule_options_from_config(cfg);
  const int rank = world.rank(), last = world.size() - 1;

  ProcessGroups groups(world, layout);
  CommStream stream;
  GPTModel model(spec, [&] { return make_dispatcher(cfg, spec.moe->num_experts, groups, stream); });
  model.init_weights(spec.seed);
  for (MoELayer* l : model.moe_layers()) {
    l->aux_loss_scale = 1.0 / static_cast<double>(micro_batches);
    l->rank = static_cast<std::uint64_t>(rank);
  }
  const std::vector<Param*> params = model.params(), experts = model.expert_params();
  std::vector<Param*> dense;
  for (Param* p : params)
    if (std::find(experts.begin(), experts.end(), p) == experts.end()) dense.push_back(p);
  Adam adam(params, cfg.optimizer);
  const MockData data(options.data, spec.vocab, spec.seq_length, spec.seed);
  const double flops_per_iteration = spec.flops_per_token() * static_cast<double>(spec.seq_length * gbs);
  const int dp_rank = layout.rank_in(GroupKind::dp, rank);
  Communicator& dp_group = groups.get(GroupKind::dp_cp);
  Communicator& edp_group = groups.get(GroupKind::edp);
  Communicator& expert_mp = groups.get(GroupKind::tp_ep);

  TrainResult result;
  result.layout = layout.describe();
  result.dispatcher = model.moe_layers().empty() ? "none" : model.moe_layers().front()->dispatcher().name();
  result.recompute = spec.recompute.describe();
  result.schedule = schedule_options.ep_overlap
                        ? (schedule_options.delay_wgrad ? "EP overlap (merged 1F1B) + delayed wgrad" : "EP overlap (merged 1F1B)")
                        : spec.moe && spec.moe->shared_expert_overlap ? "shared-expert overlap" : "no overlap";
  result.flops_per_iteration = flops_per_iteration;
  result.steady_first = std::min<int>(options.steady_first, static_cast<int>(iters));
  result.steady_last = options.steady_last > 0 ? std::min<int>(options.steady_last, static_cast<int>(iters)) : static_cast<int>(iters);
  if (result.steady_first > result.steady_last) result.steady_first = 1;
  if (options.log && rank == 0)
    out << fmt::format("epx run: {} | {} | dispatcher {} | {} | {} micro-batches of {} x {} tokens per rank per "
                       "iteration | recompute {} | {} parameters on rank 0\n",
                       cfg.source, result.layout, result.dispatcher, result.schedule, micro_batches, mbs,
                       spec.seq_length, result.recompute, [&] {
                         std::int64_t n = 0;
                         for (const Param* p : params) n += p->master.numel();
                         return n;
                       }())
        << std::flush;

  world.barrier();
  const Clock::time_point origin = Clock::now();
  trace::enable(options.trace_path.has_value());
  reset_peak_memory();
  Clock::time_point steady_begin = origin;
  for (int it = 1; it <= iters; ++it) {
    if (it == result.steady_first) {
      stream.reset_stats();
      steady_begin = Clock::now();
    }
    const Clock::time_point t0 = Clock::now();
    model.zero_grad();
    double sums[2] = {0, 0};  // lm loss, load-balancing loss (summed over micro-batches)
    const auto micro_batch = [&](int j, Tensor& tokens, Tensor& targets) {
      data.micro_batch((it - 1) * gbs + dp_rank * micro_batches * mbs + j * mbs, mbs, tokens, targets);
    };
    for (const MicroBatchLosses& l : forward_backward(model, static_cast<int>(micro_batches), micro_batch, schedule_options)) {
      sums[0] += l.lm_loss;
      sums[1] += l.aux_loss;
    }

    // Finalize the gradients (Megatron's finalize_model_grads), clip, step.
    double grad_norm = 0;
    {
      trace::Scope scope(trace::Track::compute, "optimizer step");
      const float scale = 1.f / static_cast<float>(dp);
      reduce_gradients(dense, dp_group, stream, scale, "gradient all-reduce (DP)");
      reduce_gradients(experts, edp_group, stream, scale, "expert gradient all-reduce (EDP)");
      for (MoELayer* l : model.moe_layers())
        if (l->spec().expert_bias) {
          Tensor& counts = l->router.local_tokens_per_expert;
          if (dp_group.size() > 1) stream.run([&] { dp_group.allreduce(counts.raw(), counts.numel(), DType::F32); }, "expert-bias counts");
          l->router.update_expert_bias();
        }
      float expert_sq = static_cast<float>(sum_of_squares(experts));  // each rank's own experts
      if (expert_mp.size() > 1) stream.run([&] { expert_mp.allreduce(&expert_sq, 1, DType::F32); }, "grad norm (EP)");
      grad_norm = std::sqrt(sum_of_squares(dense) + expert_sq);
      const double clip = cfg.optimizer.clip_grad;
      if (clip > 0 && grad_norm > clip) {
        const float c = static_cast<float>(clip / (grad_norm + 1e-6));
        for (Param* p : params) {
          float* g = p->grad.data<float>();
          for (std::int64_t i = 0; i < p->grad.numel(); ++i) g[i] *= c;
        }
      }
      adam.step(schedule.at(it - 1));
    }
    float reduced[2] = {static_cast<float>(sums[0]), static_cast<float>(sums[1])};
    world.allreduce(reduced, 2, DType::F32);
    const double step_s = seconds(Clock::now() - t0);

    IterationLog log;
    log.iteration = it;
    log.consumed_samples = it * gbs;
    log.step_s = step_s;
    log.tflops_per_rank = flops_per_iteration / step_s / world.size() / 1e12;
    log.lr = schedule.at(it - 1);
    log.lm_loss = reduced[0] / static_cast<double>(micro_batches * world.size());
    log.load_balancing_loss = reduced[1] / static_cast<double>(micro_batches * world.size());
    log.grad_norm = grad_norm;
    const MemoryStats mem = memory_stats();
    log.mem_allocated = mem.allocated_bytes;
    log.mem_max_allocated = mem.max_allocated_bytes;
    result.iterations.push_back(log);

    if (options.log && rank == last)
      out << fmt::format(" [{}] iteration {:8d}/{:8d} | consumed samples: {:12d} | elapsed time per iteration (ms): {:.1f} | "
                         "throughput per GPU (TFLOP/s/GPU): {:.3f} | learning rate: {:.6E} | global batch size: {:5d} | "
                         "lm loss: {:.6E} |{} loss scale: 1.0 | grad norm: {:.3f} | number of skipped iterations:   0 | "
                         "number of nan iterations: {:3d} |\n",
                         timestamp(), it, iters, log.consumed_samples, step_s * 1e3, log.tflops_per_rank, log.lr, gbs,
                         log.lm_loss,
                         spec.num_moe_layers() ? fmt::format(" load_balancing_loss: {:.6E} |", log.load_balancing_loss) : "",
                         grad_norm, std::isfinite(log.lm_loss) ? 0 : 1)
          << std::flush;
    if (options.log && rank == 0)
      out << fmt::format("Step Time : {:.2f}s GPU utilization: {:.1f}MODEL_TFLOP/s/GPU\n"
                         "[Rank 0] (after {} iterations) memory (GB) | mem-allocated-gigabytes: {:.5g} | "
                         "mem-max-allocated-gigabytes: {:.5g}\n",
                         step_s, log.tflops_per_rank, it, static_cast<double>(mem.allocated_bytes) / 1e9,
                         static_cast<double>(mem.max_allocated_bytes) / 1e9)
          << std::flush;
    if (options.progress_bar && rank == 0) {
      const int width = 30, done = static_cast<int>(width * it / iters);
      std::cerr << fmt::format("\r[{}{}] {}/{}", std::string(static_cast<std::size_t>(done), '#'),
                               std::string(static_cast<std::size_t>(width - done), ' '), it, iters)
                << (it == iters ? "\n" : "") << std::flush;
    }
  }

  // Summary.
  double total = 0;
  for (const IterationLog& l : result.iterations)
    if (l.iteration >= result.steady_first && l.iteration <= result.steady_last) total += l.step_s;
  result.mean_step_s = total / (result.steady_last - result.steady_first + 1);
  result.tflops_per_rank = flops_per_iteration / result.mean_step_s / world.size() / 1e12;
  result.peak_memory_bytes = max_over(world, memory_stats().max_allocated_bytes);
  result.final_loss = result.iterations.back().lm_loss;
  result.comm_in_flight_s = stream.stats().busy_s;
  result.comm_thread_cpu_s = stream.stats().cpu_s;
  if (options.trace_path) {
    result.traced = trace::summarize(steady_begin);
    trace::enable(false);
    trace::write(world, *options.trace_path, origin);
  }
  if (options.log && rank == 0) {
    out << fmt::format(
        "epx run summary ({} ranks, {})\n"
        "  steady-state step time: {:.3f} s (mean of iterations {}..{})\n"
        "  throughput: {:.4f} TFLOP/s per rank ({:.3g} model FLOPs per iteration)\n"
        "  peak memory: {:.4f} GB (mem-max-allocated, max over ranks)\n"
        "  final lm loss: {:.6f} (iteration {})\n"
        "  communication stream (rank 0): {:.3f} s in flight over the steady state ({:.3f} s of CPU){}\n{}",
        world.size(), result.layout, result.mean_step_s, result.steady_first, result.steady_last,
        result.tflops_per_rank, flops_per_iteration, static_cast<double>(result.peak_memory_bytes) / 1e9,
        result.final_loss, iters, result.comm_in_flight_s, result.comm_thread_cpu_s,
        result.traced ? fmt::format(", {:.3f} s of it exposed", result.traced->exposed_comm_s) : "",
        result.traced && result.traced->token_exchange_s > 0
            ? fmt::format("  token exchanges (dispatch, combine and their backward; rank 0): {:.3f} s in flight, "
                          "{:.3f} s exposed ({:.0f}% hidden)\n",
                          result.traced->token_exchange_s, result.traced->exposed_token_exchange_s,
                          100 * (1 - result.traced->exposed_token_exchange_s / result.traced->token_exchange_s))
            : "");
    if (options.trace_path) out << "wrote the trace to " << *options.trace_path << "\n";
  }
  return result;
}

}  // namespace epx
