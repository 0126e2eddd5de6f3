#include "bench_layer_command.hpp"

#include <algorithm>
#include <chrono>
#include <iostream>
#include <map>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "epx/base/output_file.hpp"
#include "epx/check/check.hpp"
#include "epx/comm/collectives.hpp"
#include "epx/comm/comm_stream.hpp"
#include "epx/comm/process_groups.hpp"
#include "epx/kernels/kernels.hpp"
#include "epx/moe/moe_layer.hpp"
#include "epx/tensor/random.hpp"
#include "epx/trace/trace.hpp"
#include "epx/train/job_spec.hpp"
#include "layer_check.hpp"
#include "number_validators.hpp"
#include "same_job.hpp"

namespace epx::cli {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

struct Spread {
  double median = 0, min = 0, max = 0;
};

Spread spread(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {v[v.size() / 2], v.front(), v.back()};
}

// The phases `epx bench layer` reports, in the layer's order, from the trace's names: compute
// scopes of the MoE layer, and the dispatcher's comm-stream tasks (its counts exchange, a wait
// inside the permutation, counts as the dispatch's).
const std::vector<std::string> kPhases = {"router", "permutation", "dispatch", "expert GEMMs",
                                          "combine", "unpermutation", "shared expert", "other"};

std::map<std::string, double> phases_since(Clock::time_point since, double total) {
  const auto compute = trace::seconds_by_name(trace::Track::compute, since);
  const auto comm = trace::seconds_by_name(trace::Track::comm, since);
  const auto wait = trace::seconds_by_name(trace::Track::wait, since);
  const auto get = [](const std::map<std::string, double>& m, const char* k) {
    const auto it = m.find(k);
    return it == m.end() ? 0.0 : it->second;
  };
  std::map<std::string, double> p;
  const double counts = get(wait, trace::kDispatchCounts);
  p["router"] = get(compute, trace::kRouter);
  p["permutation"] = get(compute, trace::kPermute) - counts;
  p["dispatch"] = get(comm, trace::kDispatch) + get(comm, trace::kDispatchBackward) + counts;
  p["expert GEMMs"] = get(compute, trace::kExpertGemms);
  p["combine"] = get(comm, trace::kCombine) + get(comm, trace::kCombineBackward);
  p["unpermutation"] = get(compute, trace::kUnpermute);
  p["shared expert"] = get(compute, trace::kSharedExpert);
  double named = 0;
  for (const auto& [k, v] : p) named += v;
  p["other"] = std::max(0.0, total - named);
  return p;
}

// FLOPs of the MoE layer's forward + backward on `tokens` tokens (the backward twice the forward,
// as Megatron counts it): the router, the top-k routed experts and the shared expert (fc1 2F wide
// when gated, F when not; fc2 F). Unlike Megatron's model FLOPs (plan/flops.hpp) the router GEMM is in: this rates
// the layer on what it computes.
double moe_layer_flops(const MoESpec& s, std::int64_t tokens) {
  const double H = static_cast<double>(s.hidden), T = static_cast<double>(tokens);
  const auto mlp = [&](std::int64_t f) { return 2 * H * static_cast<double>(s.activation.fc1_width(f) + f); };
  const double forward = 2 * H * static_cast<double>(s.num_experts) + mlp(s.ffn) * s.topk + mlp(s.shared_ffn);
  return 3 * forward * T;
}

// The rate of one dense BF16 GEMM with the routed experts' fc1 FLOPs: [T k, H] x [H, 2F] (F ungated).
double dense_gemm_flops_per_s(const MoESpec& s, std::int64_t tokens, int repeat) {
  const std::int64_t m = tokens * s.topk, k = s.hidden, n = s.activation.fc1_width(s.ffn);
  const Tensor a = random_normal({m, k}, s.dtype, 11, 0), b = random_normal({k, n}, s.dtype, 11, 1);
  Tensor c = Tensor::uninitialized({m, n}, s.dtype);
  std::vector<double> t;
  for (int i = 0; i < repeat + 1; ++i) {
    const Clock::time_point t0 = Clock::now();
    gemm(mat(a), Trans::N, mat(b), Trans::N, mat_mut(c));
    if (i > 0) t.push_back(seconds_since(t0));  // the first call creates the primitive
  }
  return 2.0 * static_cast<double>(m * n * k) / spread(t).median;
}

}  // namespace

void BenchLayerArgs::add_to(CLI::App& app) {
  config.add_to(app);
  app.add_option("--repeat", repeat, "timed forward + backward passes (default 10)")->check(kPositive);
  app.add_option("--warmup", warmup, "untimed passes first (default 2)")->check(kNonNegative);
  app.add_option("--tokens", tokens, "tokens per rank (default seq_length x micro_batch_size)")->check(kPositive);
  app.add_flag("--json", json, "print one JSON object (rank 0)");
}

int run_bench_layer(const BenchLayerArgs& args, MpiSession& mpi) {
  Config loaded = args.config.load();
  if (!loaded.target.gpu) loaded.target.gpu = "cpu";  // epx's own runtime, as epx run
  require_same_job(mpi.world(), dump_yaml(loaded));
  if (const auto errors = layer_check_errors(loaded, args.config.flags.moe_flex_dispatcher_backend)) {
    if (mpi.rank() == 0) std::cout << *errors << "epx bench layer: the check found errors; not starting\n" << std::flush;
    return kExitCheckFailed;
  }
  const Config cfg = resolve_config(loaded, args.config.flags.moe_flex_dispatcher_backend);
  const MoESpec spec = moe_spec_from_config(cfg);
  Communicator& world = mpi.world();
  const std::int64_t T = args.tokens.value_or(spec.tokens());
  // The layer holds several [T x k, hidden] buffers per rank: a bound well inside any machine.
  if (T > (std::int64_t{1} << 28) / (spec.hidden * spec.topk))
    throw ConfigError(fmt::format("--tokens {}: {} tokens x top-k {} x hidden {} is more than {} elements per rank; give "
                                  "fewer tokens",
                                  T, T, spec.topk, spec.hidden, std::int64_t{1} << 28));
  ProcessGroups groups(world, layer_layout_from_config(cfg, world.size()));
  CommStream stream;
  MoELayer layer(spec, make_dispatcher(dispatcher_options_from_config(cfg), spec.num_experts, groups, stream),
                 {.rank = static_cast<std::uint64_t>(world.rank())});
  layer.init_weights(static_cast<std::uint64_t>(cfg.rng.seed));
  const std::uint64_t r = static_cast<std::uint64_t>(world.rank());
  const Tensor x = random_normal({T, spec.hidden}, spec.dtype, 7, r), dy = random_normal({T, spec.hidden}, spec.dtype, 8, r);

  // One pass with every exchange waited for where it is started, so the phases do not overlap
  // and each is timed alone (the schedules overlap them; this is the layer's own cost).
  const auto pass = [&] {
    MoELayer::Context ctx;
    layer.forward_route(ctx, x, true);
    layer.launch_dispatch(ctx);
    stream.synchronize();
    layer.forward_experts(ctx);
    layer.launch_combine(ctx);
    stream.synchronize();
    const Tensor y = layer.forward_output(ctx);
    layer.launch_combine_backward(ctx, dy);
    stream.synchronize();
    layer.backward_experts(ctx);
    layer.launch_dispatch_backward(ctx);
    stream.synchronize();
    const Tensor dx = layer.backward_route(ctx);
    layer.backward_wgrad(ctx);
  };
  for (int i = 0; i < args.warmup; ++i) pass();
  trace::enable(true);
  std::vector<double> totals;
  std::map<std::string, std::vector<double>> phases;
  for (int i = 0; i < args.repeat; ++i) {
    world.barrier();
    const Clock::time_point t0 = Clock::now();
    pass();
    const double t = seconds_since(t0);
    totals.push_back(t);
    for (const auto& [name, s] : phases_since(t0, t)) phases[name].push_back(s);
  }
  trace::enable(false);
  trace::take_events_json(world.rank(), Clock::now());  // drop them
  // The slowest rank's pass is the layer's time.
  for (double& t : totals) t = static_cast<double>(max_over(world, static_cast<std::int64_t>(t * 1e9))) / 1e9;
  const double dense = dense_gemm_flops_per_s(spec, T, std::max(3, args.repeat / 2));
  if (world.rank() != 0) return 0;

  const Spread total = spread(totals);
  const double flops = moe_layer_flops(spec, T), rate = flops / total.median;
  if (args.json) {
    nlohmann::json p = nlohmann::json::object();
    for (const std::string& name : kPhases) p[name] = spread(phases[name]).median * 1e3;
    std::cout << json_text({{"ranks", world.size()},
                            {"tokens_per_rank", T},
                            {"hidden", spec.hidden},
                            {"ffn", spec.ffn},
                            {"experts", spec.num_experts},
                            {"topk", spec.topk},
                            {"dtype", dtype_name(spec.dtype)},
                            {"dispatcher", layer.dispatcher().name()},
                            {"repeat", args.repeat},
                            {"fwd_bwd_ms_median", total.median * 1e3},
                            {"fwd_bwd_ms_min", total.min * 1e3},
                            {"fwd_bwd_ms_max", total.max * 1e3},
                            {"model_gflop_per_pass", flops / 1e9},
                            {"gflops_per_s", rate / 1e9},
                            {"dense_gemm_gflops_per_s", dense / 1e9},
                            {"phases", p}})
              << "\n";
    return 0;
  }
  std::cout << fmt::format(
      "epx bench layer: {} rank(s), {} tokens per rank, H {}, F {}, {} experts top-{}{}, {}, {}; median / min / max of {} "
      "passes after {} warm-up (each exchange waited for where it starts; rank 0's phases, the slowest rank's total)\n\n",
      world.size(), T, spec.hidden, spec.ffn, spec.num_experts, spec.topk,
      spec.shared_ffn > 0 ? fmt::format(", shared {}", spec.shared_ffn) : "", dtype_name(spec.dtype),
      layer.dispatcher().name(), args.repeat, args.warmup);
  std::cout << fmt::format("{:<16} {:>10} {:>10} {:>10} {:>7}\n", "phase", "median ms", "min ms", "max ms", "share");
  for (const std::string& name : kPhases) {
    const Spread s = spread(phases[name]);
    std::cout << fmt::format("{:<16} {:>10.3f} {:>10.3f} {:>10.3f} {:>6.1f}%\n", name, s.median * 1e3, s.min * 1e3,
                             s.max * 1e3, 100 * s.median / total.median);
  }
  std::cout << fmt::format("{:<16} {:>10.3f} {:>10.3f} {:>10.3f}\n\n", "forward+backward", total.median * 1e3,
                           total.min * 1e3, total.max * 1e3)
            << fmt::format("model FLOPs {:.3g} per pass per rank: {:.1f} GFLOP/s per rank; dense BF16 GEMM [{} x {}] x [{} x {}] "
                           "in this process: {:.1f} GFLOP/s ({:.0f}% of it)\n",
                           flops, rate / 1e9, T * spec.topk, spec.hidden, spec.hidden, spec.activation.fc1_width(spec.ffn), dense / 1e9,
                           100 * rate / dense);
  return 0;
}

}  // namespace epx::cli
