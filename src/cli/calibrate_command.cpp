// What `epx plan -g cpu` needs of this machine, measured: the BF16 GEMM rate of one core (the
// peak the planner scales), the memory bandwidth of one core, the end-to-end efficiency of
// epx's own model against that peak (one micro-batch's forward and backward of `recipe` on one
// rank, no communication), the cores, and the emulated cluster's link when one is up. The
// intra-node MPI rate is not measured here (one process); it stays the catalog's.
#include "calibrate_command.hpp"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "cluster_env.hpp"
#include "epx/base/error.hpp"
#include "epx/check/check.hpp"
#include "epx/kernels/kernels.hpp"
#include "epx/model/gpt_model.hpp"
#include "epx/plan/flops.hpp"
#include "epx/tensor/random.hpp"
#include "epx/train/job_spec.hpp"
#include "epx/train/mock_data.hpp"

namespace epx::cli {
namespace {

using Clock = std::chrono::steady_clock;

// Seconds per call of `fn`, the best of several runs of at least 0.2 s.
template <class Fn>
double seconds_per_call(Fn fn) {
  double best = 1e30;
  for (int run = 0; run < 3; ++run) {
    int calls = 0;
    const auto t0 = Clock::now();
    double s = 0;
    do {
      fn();
      ++calls;
      s = std::chrono::duration<double>(Clock::now() - t0).count();
    } while (s < 0.2);
    best = std::min(best, s / calls);
  }
  return best;
}

}  // namespace

std::string calibrate_cpu(const std::string& recipe) {
  omp_set_num_threads(1);  // per core: the planner scales by the cores each rank gets
  const std::int64_t n = 1024;
  const Tensor a = random_normal({n, n}, DType::BF16, 1, 1), b = random_normal({n, n}, DType::BF16, 1, 2);
  Tensor c({n, n}, DType::F32);
  const double gemm_s = seconds_per_call([&] { gemm(mat(a), Trans::N, mat(b), Trans::N, mat_mut(c)); });
  const double peak = 2.0 * static_cast<double>(n * n * n) / gemm_s;

  std::vector<char> src(std::size_t{64} << 20, 1), dst(src.size());
  const double copy_s = seconds_per_call([&] { std::memcpy(dst.data(), src.data(), src.size()); });
  const double bandwidth = 2.0 * static_cast<double>(src.size()) / copy_s;  // read + write

  // One rank's model, one micro-batch forward + backward, against Megatron's model FLOPs.
  Config loaded = load_config_file(resolve_recipe(recipe));
  loaded.target.gpu = "cpu";
  loaded.target.num_gpus = 1;
  loaded.model.expert_model_parallel_size = 1;
  const Config cfg = resolve_config(loaded, std::nullopt);
  const ModelSpec spec = model_spec_from_config(cfg);
  // The model is built for real on this one process: keep it to a proxy's size.
  const double params = static_cast<double>(spec.vocab * spec.hidden) * 2 +
                        static_cast<double>(spec.num_layers) * (12.0 * static_cast<double>(spec.hidden * spec.hidden) +
                                                                (spec.moe ? 3.0 * static_cast<double>(spec.moe->num_experts * spec.moe->ffn * spec.hidden) : 0));
  if (params > 2e8)
    throw ConfigError(fmt::format("{}: about {:.2g} parameters; --calibrate runs the model on this machine, so give it a "
                                  "proxy recipe (e.g. qwen3_30b_a3b_proxy) with at most 2e8",
                                  recipe, params));
  const MockData data(MockData::Mode::random, spec.vocab, spec.seq_length, spec.seed);
  Tensor tokens, targets;
  data.micro_batch(0, spec.micro_batch, tokens, targets);
  // Seconds per micro-batch's forward + backward of a fresh copy of the model, on one thread.
  const auto model_step_s = [&] {
    omp_set_num_threads(1);
    GPTModel model(spec, [&] { return make_local_dispatcher(spec.moe->num_experts); });
    model.init_weights(spec.seed);
    return seconds_per_call([&] {
      GPTModel::Context ctx;
      model.zero_grad();
      model.forward(tokens, targets, ctx);
      model.backward(ctx, 1.f);
    });
  };
  const double step_s = model_step_s();
  // Ranks on the same machine slow each other down (memory bandwidth, caches): the same step
  // run on every core at once, each thread on its own copy, against one alone.
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  std::vector<double> together(cores);
  {
    std::vector<std::thread> workers;
    for (unsigned w = 0; w < cores; ++w) workers.emplace_back([&, w] { together[w] = model_step_s(); });
    for (auto& t : workers) t.join();
  }
  const double shared = std::min(1.0, step_s / *std::max_element(together.begin(), together.end()));
  const double flops = model_flops(cfg).per_token() * static_cast<double>(spec.seq_length * spec.micro_batch);
  const double efficiency = flops / step_s / peak;

  const auto cluster = read_cluster_env();
  double link_gb_s = 0.125;
  if (cluster.count("link_gbit")) {
    const std::string& text = cluster.at("link_gbit");
    char* end = nullptr;
    const double gbit = std::strtod(text.c_str(), &end);
    if (text.empty() || *end != '\0' || !(gbit > 0 && gbit < 1e6))
      throw EnvironmentError(fmt::format("{}: link_gbit={}: not a link rate; bring the cluster up again with "
                                         "scripts/cluster.sh up --link-gbit RATE",
                                         cluster_env_path(), text));
    link_gb_s = gbit / 8;
  }
  return fmt::format(
      "# Measured by `epx plan --calibrate` ({} on {}): one core's BF16 GEMM (1024^3) and memcpy,\n"
      "# epx's {} forward + backward on one rank against Megatron's model FLOPs ({:.3g} s per\n"
      "# micro-batch; {:.3g} s with every core running one at once), {} cores, the emulated link {}.\n"
      "cpu:\n"
      "  cores: {}\n"
      "  shared_core_efficiency: {:.4f}\n"
      "  bf16_tflops: {:.6f}\n"
      "  hbm_tb_s: {:.6f}\n"
      "  gemm_efficiency: {:.4f}\n"
      "  gemm_half_rows: 0\n"
      "  network_gb_s: {:.4f}\n",
      gemm_isa(), fmt::format("{} cores", cores), recipe, step_s, step_s / shared, cores,
      cluster.count("link_gbit") ? "from cluster.env" : "not up (0.125 GB/s assumed)", cores, shared, peak / 1e12,
      bandwidth / 1e12, efficiency, link_gb_s);
}

}  // namespace epx::cli
