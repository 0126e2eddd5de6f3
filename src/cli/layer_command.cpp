#include "layer_command.hpp"

#include <charconv>
#include <chrono>
#include <iostream>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "epx/base/output_file.hpp"
#include "epx/check/check.hpp"
#include "epx/comm/collectives.hpp"
#include "epx/comm/comm_stream.hpp"
#include "epx/comm/process_groups.hpp"
#include "epx/kernels/kernels.hpp"
#include "epx/moe/moe_layer.hpp"
#include "epx/tensor/random.hpp"
#include "epx/tensor/safetensors.hpp"
#include "epx/train/job_spec.hpp"
#include "layer_check.hpp"
#include "number_validators.hpp"
#include "same_job.hpp"

namespace epx::cli {
namespace {

Tensor scalar(double v) {
  Tensor t({}, DType::F32);
  t.set(0, static_cast<float>(v));
  return t;
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// The ranks of a distributed run: process groups from the config's sizes, and a comm stream.
struct Distributed {
  Distributed(MpiSession& mpi, const Config& cfg) : groups(mpi.world(), layer_layout_from_config(cfg, mpi.size())) {}
  ProcessGroups groups;
  CommStream stream;
};

}  // namespace

void LayerArgs::add_to(CLI::App& app) {
  config.add_to(app);
  app.add_option("--weights", weights, "safetensors file of the layer's weights (README: tensor layout)")->required();
  app.add_option("--input", input, "safetensors file with `input` [S, B, H]")->required();
  app.add_option("--out", out, "safetensors file to write: output, losses, routing, gradients")->required();
  app.add_option("--grad-output", grad_output,
                 "safetensors file with `grad_output` [S, B, H]: also run the backward");
  app.add_option("--init-seed", init_seed,
                 "write freshly initialised weights, a random input (and grad output) to the "
                 "--weights/--input (--grad-output) paths, then run on them")
      ->check(CLI::Validator(
          [](std::string& text) -> std::string {  // CLI11 wraps -1 (and clamps 1e25) into 2^64 - 1
            std::uint64_t v = 0;
            const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
            return ec == std::errc() && end == text.data() + text.size() ? "" : "must be a whole number from 0 to 2^64 - 1, got " + text;
          },
          "SEED"));
  app.add_option("--collective-timeout", collective_timeout,
                 "under mpirun: abort the job when a collective waits longer than this many seconds "
                 "(default: EPX_COLLECTIVE_TIMEOUT, else 300)")
      ->check(kCollectiveTimeout);
}

int run_layer_command(const LayerArgs& args, MpiSession* mpi) {
  if (!mpi || mpi->rank() == 0) {  // before any work: no output may replace another file named
    std::vector<NamedPath> files;
    if (const auto config = args.config.file()) files.push_back({"the config", *config});
    std::vector<NamedPath> tensors = {{"--weights", args.weights}, {"--input", args.input}};
    if (args.grad_output) tensors.push_back({"--grad-output", *args.grad_output});
    for (const NamedPath& f : tensors) {
      if (args.init_seed) check_output_path(f.path, f.name, files);  // written too
      files.push_back(f);
    }
    check_output_path(args.out, "--out", files);
  }
  Config loaded = args.config.load();
  if (!loaded.target.gpu) loaded.target.gpu = "cpu";  // epx's own runtime, as epx run
  if (mpi) require_same_job(mpi->world(), dump_yaml(loaded));
  if (const auto errors = layer_check_errors(loaded, args.config.flags.moe_flex_dispatcher_backend)) {
    if (!mpi || mpi->rank() == 0) std::cout << *errors << "epx layer: the check found errors; not starting\n" << std::flush;
    return kExitCheckFailed;
  }
  const Config cfg = resolve_config(loaded, args.config.flags.moe_flex_dispatcher_backend);
  const MoESpec spec = moe_spec_from_config(cfg);
  const int rank = mpi ? mpi->rank() : 0, world = mpi ? mpi->size() : 1;
  if (spec.seq_length % world != 0)
    throw ConfigError(fmt::format("model.seq_length={} is not divisible by the {} ranks: each rank "
                                  "takes an equal slice of the sequence; launch a divisor of {} ranks",
                                  spec.seq_length, world, spec.seq_length));
  std::optional<Distributed> dist;
  if (mpi)
    dist.emplace(*mpi, cfg);
  else
    check_layer_parallelism(cfg);
  MoELayer layer(spec,
                 dist ? make_dispatcher(dispatcher_options_from_config(cfg), spec.num_experts, dist->groups, dist->stream)
                      : make_local_dispatcher(spec.num_experts),
                 {.rank = static_cast<std::uint64_t>(rank),
                  .global_aux_group = dist ? &dist->groups.router_counts() : nullptr});
  const Shape x_shape{spec.seq_length, spec.micro_batch, spec.hidden};

  if (args.init_seed) {  // rank 0 writes the whole layer's files; every rank then reads them
    if (rank == 0) {
      MoELayer full(spec, make_local_dispatcher(spec.num_experts));
      full.init_weights(*args.init_seed);
      // Every tensor first, then the files: a shape past memory leaves none of them written.
      const TensorMap weights = full.weight_tensors();
      const Tensor input = random_normal(x_shape, spec.dtype, *args.init_seed, 1);
      const Tensor grad_output = args.grad_output ? random_normal(x_shape, spec.dtype, *args.init_seed, 2) : Tensor();
      write_safetensors(args.weights, weights, {{"format", "epx-moe-layer"}});
      write_safetensors(args.input, {{"input", input}});
      if (args.grad_output) write_safetensors(*args.grad_output, {{"grad_output", grad_output}});
      std::cout << fmt::format("wrote initial weights to {} and a random input to {}{} (seed {})\n",
                               args.weights, args.input,
                               args.grad_output ? " and " + *args.grad_output : "", *args.init_seed);
    }
    if (dist) dist->groups.world().barrier();
  }
  layer.load_weights(read_safetensors(args.weights), args.weights);
  Tensor x = expect_tensor(read_safetensors(args.input), "input", x_shape, args.input).to(spec.dtype);
  Tensor dy;
  if (args.grad_output)
    dy = expect_tensor(read_safetensors(*args.grad_output), "grad_output", x_shape, *args.grad_output)
             .to(spec.dtype);
  if (world > 1) {
    x = x.chunk(rank, world);
    if (dy.defined()) dy = dy.chunk(rank, world);
  }

  reset_peak_memory();
  if (dist) dist->stream.reset_stats();
  MoELayer::Context ctx;
  auto t0 = std::chrono::steady_clock::now();
  const Tensor y = layer.forward(x, ctx);
  const double fwd_ms = ms_since(t0);
  const Routing& routing = ctx.routing;
  Tensor counts({spec.num_experts}, DType::I64);
  std::copy(routing.tokens_per_expert.begin(), routing.tokens_per_expert.end(), counts.data<std::int64_t>());
  double bwd_ms = 0;
  Tensor dx;
  if (dy.defined()) {
    layer.zero_grad();
    t0 = std::chrono::steady_clock::now();
    dx = layer.backward(ctx, dy);
    if (dist) layer.reduce_gradients(dist->groups.get(GroupKind::tp_cp_dp), dist->groups.get(GroupKind::edp));
    bwd_ms = ms_since(t0);
  }
  const MemoryStats mem = memory_stats();
  const CommStream::Stats comm = dist ? dist->stream.stats() : CommStream::Stats{};

  // Everything in the file layout of the whole layer: slices gathered, losses and counts summed
  // over the ranks, each gradient from the ranks that own it.
  TensorMap result;
  double aux = 0, z = routing.z_loss;  // every aux loss that is on, summed
  for (double v : routing.aux_losses) aux += v;
  std::int64_t dropped = routing.dropped;
  if (dist) {
    Communicator& all = dist->groups.world();
    result.emplace("output", allgather_rows(all, y));
    result.emplace("routing.probs", allgather_rows(all, routing.probs));
    all.allreduce(counts.raw(), counts.numel(), DType::I64);
    all.allreduce(&dropped, 1, DType::I64);
    aux = sum_over(all, static_cast<float>(aux));
    z = sum_over(all, static_cast<float>(z));
    if (dy.defined()) {
      result.emplace("grad.input", allgather_rows(all, dx));
      result.merge(layer.gather_grad_tensors(dist->groups));
    }
  } else {
    result.emplace("output", y.to(DType::F32));
    result.emplace("routing.probs", routing.probs);
    if (dy.defined()) {
      result.emplace("grad.input", dx.to(DType::F32));
      result.merge(layer.grad_tensors());
    }
  }
  result.emplace("routing.tokens_per_expert", counts);
  result.emplace("loss.aux", scalar(aux));
  result.emplace("loss.z", scalar(z));
  if (rank != 0) return 0;

  write_safetensors(args.out, result,
                    {{"format", "epx-moe-layer-result"},
                     {"dtype", std::string(dtype_name(spec.dtype))},
                     {"config", cfg.source}});
  std::cout << fmt::format(
      "epx layer: {} | tokens {} (S {} x B {}) hidden {} | experts {} top-{} ffn {}{} | {} on {}\n",
      cfg.source, spec.tokens(), spec.seq_length, spec.micro_batch, spec.hidden, spec.num_experts,
      spec.topk, spec.ffn,
      spec.shared_ffn ? fmt::format(" shared {}{}", spec.shared_ffn, spec.shared_expert_gate ? " (gated)" : "") : "",
      dtype_name(spec.dtype), gemm_isa());
  if (dist)
    std::cout << fmt::format("ranks: {} | dispatcher {} | {} local experts per rank\n",
                             dist->groups.layout().describe(), layer.dispatcher().name(),
                             layer.dispatcher().num_local_experts());
  std::vector<std::int64_t> per_expert(counts.data<std::int64_t>(), counts.data<std::int64_t>() + counts.numel());
  std::cout << fmt::format("tokens per expert: {} (dropped {})\n", fmt::join(per_expert, " "), dropped);
  std::cout << fmt::format("aux loss {:.6g} | z loss {:.6g} | forward {:.2f} ms{} | mem-max-allocated {:.1f} MB{}\n",
                           aux, z, fwd_ms, dy.defined() ? fmt::format(" | backward {:.2f} ms", bwd_ms) : "",
                           static_cast<double>(mem.max_allocated_bytes) / 1e6, world > 1 ? " (rank 0)" : "");
  if (dist)
    std::cout << fmt::format("comm stream (rank 0): {} tasks, {:.2f} ms in flight, {:.2f} ms CPU ({:.0f}%)\n",
                             comm.tasks, comm.busy_s * 1e3, comm.cpu_s * 1e3,
                             comm.busy_s > 0 ? 100 * comm.cpu_s / comm.busy_s : 0.0);
  std::cout << fmt::format("wrote {} tensors to {}\n", result.size(), args.out);
  return 0;
}

}  // namespace epx::cli
