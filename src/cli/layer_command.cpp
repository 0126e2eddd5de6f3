#include "cli/layer_command.hpp"

#include <chrono>
#include <iostream>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "epx/check.hpp"
#include "epx/output_file.hpp"
#include "epx/comm_stream.hpp"
#include "epx/kernels.hpp"
#include "epx/moe_layer.hpp"
#include "epx/process_groups.hpp"
#include "epx/random.hpp"
#include "epx/safetensors.hpp"

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
  Distributed(MpiSession& mpi, const Config& cfg)
      : groups(mpi.world(), layout(mpi.size(), cfg)) {}
  static ParallelLayout layout(int world, const Config& cfg) {
    const ModelConfig& m = cfg.model;
    if (m.pipeline_model_parallel_size != 1)
      throw ConfigError(fmt::format("model.pipeline_model_parallel_size = {}: `epx layer` runs one "
                                    "layer, so set it to 1",
                                    m.pipeline_model_parallel_size));
    if (m.tensor_model_parallel_size * m.context_parallel_size != 1)
      throw ConfigError(fmt::format(
          "model.tensor_model_parallel_size = {}, context_parallel_size = {}: `epx layer` runs the "
          "MoE layer alone, with the tokens split over data-parallel ranks, and computes the aux "
          "loss per rank; Megatron reduces its token counts over TP x CP, which it does not yet. "
          "Set both to 1 (expert_tensor_parallel_size still splits the experts)",
          m.tensor_model_parallel_size, m.context_parallel_size));
    return ParallelLayout::make(world, static_cast<int>(m.tensor_model_parallel_size),
                                static_cast<int>(m.context_parallel_size), 1,
                                static_cast<int>(m.expert_model_parallel_size),
                                static_cast<int>(m.expert_tensor_parallel_size.value_or(1)));
  }
  ProcessGroups groups;
  CommStream stream;
};

// The ranks' sequence slices, concatenated on every rank (F32).
Tensor gather_sequence(Communicator& world, const Tensor& local) {
  const Tensor f32 = local.to(DType::F32);
  Shape s = f32.shape();
  s[0] *= world.size();
  Tensor out(s, DType::F32);
  const std::vector<std::int64_t> counts(static_cast<std::size_t>(world.size()), f32.numel());
  world.allgatherv(f32.raw(), out.raw(), counts, DType::F32);
  return out;
}

double sum_over(Communicator& world, double v) {
  float f = static_cast<float>(v);
  world.allreduce(&f, 1, DType::F32);
  return f;
}

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
                 "--weights/--input (--grad-output) paths, then run on them");
  app.add_option("--collective-timeout", collective_timeout,
                 "under mpirun: abort the job when a collective waits longer than this many seconds "
                 "(default: EPX_COLLECTIVE_TIMEOUT, else 300)")
      ->check(CLI::PositiveNumber);
}

int run_layer_command(const LayerArgs& args, MpiSession* mpi) {
  if (!mpi || mpi->rank() == 0) check_output_path(args.out, "--out");  // before any work
  Config loaded = args.config.load();
  if (!loaded.target.gpu) loaded.target.gpu = "cpu";  // epx's own runtime, as epx run
  const Config cfg = resolve_config(loaded, args.config.flags.moe_flex_dispatcher_backend);
  const MoESpec spec = moe_spec_from_config(cfg);
  const int rank = mpi ? mpi->rank() : 0, world = mpi ? mpi->size() : 1;
  if (spec.seq_length % world != 0)
    throw ConfigError(fmt::format("model.seq_length = {} is not divisible by the {} ranks: each rank "
                                  "takes an equal slice of the sequence; launch a divisor of {} ranks",
                                  spec.seq_length, world, spec.seq_length));
  std::optional<Distributed> dist;
  if (mpi) dist.emplace(*mpi, cfg);
  MoELayer layer(spec, dist ? make_dispatcher(cfg, spec.num_experts, dist->groups, dist->stream)
                            : make_local_dispatcher(spec.num_experts));
  layer.rank = static_cast<std::uint64_t>(rank);
  const Shape x_shape{spec.seq_length, spec.micro_batch, spec.hidden};

  if (args.init_seed) {  // rank 0 writes the whole layer's files; every rank then reads them
    if (rank == 0) {
      MoELayer full(spec, make_local_dispatcher(spec.num_experts));
      full.init_weights(*args.init_seed);
      write_safetensors(args.weights, full.weight_tensors(), {{"format", "epx-moe-layer"}});
      write_safetensors(args.input, {{"input", random_normal(x_shape, spec.dtype, *args.init_seed, 1)}});
      if (args.grad_output)
        write_safetensors(*args.grad_output,
                          {{"grad_output", random_normal(x_shape, spec.dtype, *args.init_seed, 2)}});
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
  double aux = routing.aux_loss, z = routing.z_loss;
  std::int64_t dropped = routing.dropped;
  if (dist) {
    Communicator& all = dist->groups.world();
    result.emplace("output", gather_sequence(all, y));
    result.emplace("routing.probs", gather_sequence(all, routing.probs));
    all.allreduce(counts.raw(), counts.numel(), DType::I64);
    all.allreduce(&dropped, 1, DType::I64);
    aux = sum_over(all, aux);
    z = sum_over(all, z);
    if (dy.defined()) {
      result.emplace("grad.input", gather_sequence(all, dx));
      const TensorMap mine = layer.grad_tensors();
      const bool expert_owner = dist->groups.get(GroupKind::edp).rank() == 0;
      for (const auto& [name, shape] : MoELayer::file_shapes(spec)) {
        const bool expert = name.starts_with("mlp.experts.");
        const auto it = mine.find("grad." + name);
        Tensor g = it != mine.end() && (expert ? expert_owner : rank == 0) ? it->second.clone()
                                                                          : Tensor(shape, DType::F32);
        all.allreduce(g.raw(), g.numel(), DType::F32);
        result.emplace("grad." + name, g);
      }
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
      spec.topk, spec.ffn, spec.shared_ffn ? fmt::format(" shared {}", spec.shared_ffn) : "",
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
