// What `epx plan -g cpu` needs of this machine, measured: the BF16 GEMM rate of one core (the
// peak the planner scales), the memory bandwidth of one core, the GEMMs' efficiency against that
// peak (the one at which the planner predicts `epx run`'s training loop on one rank and one core,
// its mean steady-state step, with everything else costed as the planner does), what ranks side
// by side cost each other, the cores, and the link between ranks 0 and 1 when launched on two or
// more ranks (their MPI all-to-all at the recipe's exchange size: the intra-node rate when they
// share a node, the network when they do not; one process keeps the catalog's and cluster.env's).

#include <omp.h>

#include <algorithm>
#include <filesystem>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <ostream>
#include <thread>
#include <vector>

#include <unistd.h>

#include <fmt/format.h>

#include "cluster_env.hpp"
#include "epx/base/error.hpp"
#include "epx/check/check.hpp"
#include "epx/comm/collectives.hpp"
#include "epx/kernels/kernels.hpp"
#include "epx/model/gpt_model.hpp"
#include "epx/plan/flops.hpp"
#include "epx/plan/plan.hpp"
#include "epx/tensor/random.hpp"
#include "epx/train/job_spec.hpp"
#include "epx/train/mock_data.hpp"
#include "epx/train/trainer.hpp"

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

// One rank of `pair` (two ranks) sending the other `bytes` in an all-to-all, each way at once:
// seconds per exchange, the best of three timings of a fixed number of rounds (both ranks make
// the same calls).
double pair_exchange_s(Communicator& pair, std::int64_t bytes) {
  const std::int64_t elements = std::max<std::int64_t>(1, bytes / 2);  // BF16, as the token rows
  std::vector<std::uint16_t> send(static_cast<std::size_t>(2 * elements)), recv(send.size());
  std::vector<std::int64_t> counts(2, elements);
  counts[static_cast<std::size_t>(pair.rank())] = 0;  // only the peer's share travels
  const auto round = [&] { pair.alltoallv(send.data(), counts, recv.data(), counts, DType::BF16); };
  for (int i = 0; i < 5; ++i) round();
  double best = 1e30;
  for (int run = 0; run < 3; ++run) {
    pair.barrier();
    const auto t0 = Clock::now();
    constexpr int kRounds = 40;
    for (int i = 0; i < kRounds; ++i) round();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count() / kRounds);
  }
  return best;
}

}  // namespace

std::string calibrate_cpu(const Config& config, Communicator& world) {
  const std::string recipe = std::filesystem::path(config.source).stem().string();
  Config loaded = config;
  loaded.target.gpu = "cpu";
  loaded.target.num_gpus = 1;
  loaded.model.expert_model_parallel_size = 1;
  const Config base = resolve_config(loaded, std::nullopt);
  const ModelSpec spec = model_spec_from_config(base);
  // The model is built for real on this one process: keep it to a proxy's size.
  const double params = static_cast<double>(spec.vocab * spec.hidden) * 2 +
                        static_cast<double>(spec.num_layers) * (12.0 * static_cast<double>(spec.hidden * spec.hidden) +
                                                                (spec.moe ? static_cast<double>(spec.moe->num_experts * (spec.moe->activation.fc1_width(spec.moe->ffn) + spec.moe->ffn) * spec.hidden) : 0));
  if (params > 2e8)
    throw ConfigError(fmt::format("{}: about {:.2g} parameters; --calibrate runs the model on this machine, so give it a "
                                  "proxy recipe (e.g. qwen3_30b_a3b_proxy) with at most 2e8",
                                  recipe, params));

  // The link first, while every rank is here: ranks 0 and 1 exchange one MoE layer's dispatch
  // at EP 2 (half of the micro-batch's routed rows each way).
  const std::vector<int> nodes = node_of_each_rank(world);
  const std::unique_ptr<Communicator> pair = world.split(world.rank() < 2 ? 0 : 1, world.rank(), "calibrate pair");
  // Latency: a 2-byte exchange; rate: the bytes beyond it.
  double pair_gb_s = 0, pair_latency_s = 0;
  if (world.size() >= 2 && world.rank() < 2) {
    const double rows = static_cast<double>(spec.seq_length * spec.micro_batch) * (spec.moe ? spec.moe->topk : 1) / 2;
    const double bytes = rows * static_cast<double>(spec.hidden) * 2;
    pair_latency_s = pair_exchange_s(*pair, 2);
    pair_gb_s = bytes / std::max(1e-9, pair_exchange_s(*pair, static_cast<std::int64_t>(bytes)) - pair_latency_s) / 1e9;
  }
  const bool pair_across_nodes = world.size() >= 2 && nodes[0] != nodes[1];
  // The per-micro-batch step whose slowdown measures what ranks side by side cost each other
  // (memory bandwidth, caches): a fresh model's forward + backward on one thread.
  const MockData data(MockData::Mode::random, spec.vocab, spec.seq_length, spec.seed);
  Tensor tokens, targets;
  data.micro_batch(0, spec.micro_batch, tokens, targets);
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
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());

  // Rank 0 measures alone; the others wait without spinning (wait() sleeps).
  const std::unique_ptr<Communicator> self = world.split(world.rank(), 0, "calibrate self");
  double peak = 0, bandwidth = 0, attention_rate = 0, alone = 0, step_s = 0;
  if (world.rank() == 0) {
    omp_set_num_threads(1);  // per core: the planner scales by the cores each rank gets
    const std::int64_t n = 1024;
    const Tensor a = random_normal({n, n}, DType::BF16, 1, 1), b = random_normal({n, n}, DType::BF16, 1, 2);
    Tensor c({n, n}, DType::F32);
    const double gemm_s = seconds_per_call([&] { gemm(mat(a), Trans::N, mat(b), Trans::N, mat_mut(c)); });
    peak = 2.0 * static_cast<double>(n * n * n) / gemm_s;

    std::vector<char> src(std::size_t{64} << 20, 1), dst(src.size());
    const double copy_s = seconds_per_call([&] { std::memcpy(dst.data(), src.data(), src.size()); });
    bandwidth = 2.0 * static_cast<double>(src.size()) / copy_s;  // read + write

    // The blocked attention kernel at the model's shape and compute dtype, one head, forward and
    // backward, at Megatron's causal FLOP count (3 S^2 (d + d_v): 6 S^2 d where values are as wide as keys).
    const std::int64_t S = spec.seq_length, d = spec.attention.head_dim, d_v = spec.attention.value_dim();
    const DType dtype = spec.attention.dtype;
    const Tensor q = random_normal({S, d}, dtype, 1, 3), k = random_normal({S, d}, dtype, 1, 4),
                 v = random_normal({S, d_v}, dtype, 1, 5), dout = random_normal({S, d_v}, dtype, 1, 6);
    Tensor out({S, d_v}, DType::F32), lse({S}, DType::F32), delta({S}, DType::F32), dq({S, d}, DType::F32),
        dk({S, d}, DType::F32), dv({S, d_v}, DType::F32);
    const float scale = 1.f / std::sqrt(static_cast<float>(d));
    const double attention_s = seconds_per_call([&] {
      with_operand_type(dtype, [&](auto tag) {
        using E = decltype(tag);
        causal_attention_forward(q.data<E>(), k.data<E>(), v.data<E>(), S, d, d_v, scale, out.data<float>(),
                                 lse.data<float>());
        causal_attention_backward(q.data<E>(), k.data<E>(), v.data<E>(), lse.data<float>(), delta.data<float>(),
                                  dout.data<E>(), S, d, d_v, scale, dq.data<float>(), dk.data<float>(), dv.data<float>());
      });
    });
    attention_rate = 3.0 * static_cast<double>(S * S * (d + d_v)) / attention_s;

    // epx run's own loop on one rank and one core: the mean of iterations 3..6 (the recipe's
    // global batch as micro-batches), optimizer and all.
    Config trained = base;
    trained.train.train_iters = 6;
    TrainOptions quiet;
    quiet.log = false;
    std::ostream discard(nullptr);
    step_s = train(trained, *self, quiet, discard).mean_step_s;
    alone = model_step_s();
  }
  world.barrier();
  // The same step on every core at once: one process runs a thread per core; launched ranks
  // (each bound to its core by mpirun) run it side by side, all of them (the emulated cluster's
  // nodes share this machine too).
  double together = 0;
  if (world.size() == 1) {
    std::vector<double> each(cores);
    std::vector<std::thread> workers;
    for (unsigned w = 0; w < cores; ++w) workers.emplace_back([&, w] { each[w] = model_step_s(); });
    for (auto& t : workers) t.join();
    together = *std::max_element(each.begin(), each.end());
  } else {
    together = static_cast<double>(max_over(world, static_cast<std::int64_t>(model_step_s() * 1e9))) / 1e9;
  }
  if (world.rank() != 0) return {};
  const double shared = std::min(1.0, alone / together);

  // The network: measured across nodes, else the emulated cluster's configured rate.
  const auto cluster = read_cluster_env();
  double network_gb_s = 0.125, network_efficiency = 0.85, network_latency_s = 0;
  std::string network_from = "not measured, no cluster up (0.125 GB/s assumed at 0.85)";
  if (pair_across_nodes) {
    network_gb_s = pair_gb_s, network_efficiency = 1, network_latency_s = pair_latency_s;
    network_from = "ranks 0 and 1 across nodes, measured";
  } else if (cluster.count("link_gbit")) {
    const std::string& text = cluster.at("link_gbit");
    char* end = nullptr;
    const double gbit = std::strtod(text.c_str(), &end);
    if (text.empty() || *end != '\0' || !(gbit > 0 && gbit < 1e6))
      throw EnvironmentError(fmt::format("{}: link_gbit={}: not a link rate; bring the cluster up again with "
                                         "scripts/cluster.sh up --link-gbit RATE",
                                         cluster_env_path(), text));
    network_gb_s = gbit / 8;
    network_from = "cluster.env's link_gbit at 0.85";
  }
  const bool intra_measured = world.size() >= 2 && !pair_across_nodes;
  const auto entry = [&](double efficiency) {
    return fmt::format(
      "# Measured by `epx plan --calibrate` ({} on {} cores): one core's BF16 GEMM (1024^3) and\n"
      "# memcpy; epx run's {} on one rank and core, {:.3g} s per step, which the planner reproduces\n"
      "# (gemm_efficiency); its blocked attention at the model's head size; one micro-batch {:.3g} s\n"
      "# alone, {:.3g} s with every core running one ({});\n"
      "# intra-node link: {};\n"
      "# network: {}.\n"
      "cpu:\n"
      "  cores: {}\n"
      "  shared_core_efficiency: {:.4f}\n"
      "  bf16_tflops: {:.6f}\n"
      "  hbm_tb_s: {:.6f}\n"
      "  gemm_efficiency: {:.4f}\n"
      "  attention_tflops: {:.6f}\n"
      "  gemm_half_rows: 0\n"
      "{}"
      "  network_gb_s: {:.4f}\n"
      "  network_efficiency: {}\n"
      "  network_latency_us: {:.1f}\n",
      gemm_isa(), cores, recipe, step_s, alone, together, world.size() == 1 ? "threads" : "ranks",
      intra_measured ? "ranks 0 and 1 on one node, measured" : "not measured (one process), the catalog's", network_from,
      cores, shared, peak / 1e12, bandwidth / 1e12, efficiency, attention_rate / 1e12,
      intra_measured ? fmt::format("  nvlink_gb_s: {:.4f}\n  nvlink_efficiency: 1\n  nvlink_latency_us: {:.1f}\n", pair_gb_s,
                                   pair_latency_s * 1e6)
                     : "",
      network_gb_s, network_efficiency, network_latency_s * 1e6);
  };
  // The GEMMs' efficiency: the one at which the planner predicts the measured step of this very
  // run. Its GEMM time scales as 1 / efficiency and the rest (attention, memory-bound work, the
  // optimizer) does not, so two plans (efficiency 1 and 1/2) separate them.
  const auto planned_step_s = [&](double efficiency) {
    char path[] = "/tmp/epx-calibrate-XXXXXX";
    const int fd = mkstemp(path);
    if (fd < 0) throw EnvironmentError("epx plan --calibrate: cannot create a temporary file in /tmp");
    close(fd);
    std::ofstream(path) << entry(efficiency);
    add_hardware_file(path);
    std::remove(path);
    return make_plan(base).configured().step_time_s;
  };
  // At most 1 (a share of the peak; the catalog refuses more): where the rest alone nearly
  // fills the measured step, the planner's other terms run slow on this machine, not its GEMMs.
  const double at_1 = planned_step_s(1), gemm_at_1 = planned_step_s(0.5) - at_1;
  return entry(std::min(1.0, gemm_at_1 / std::max(0.1 * step_s, step_s - (at_1 - gemm_at_1))));
}

}  // namespace epx::cli
