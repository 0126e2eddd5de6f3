#include "cli/layer_command.hpp"

#include <chrono>
#include <iostream>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "epx/check.hpp"
#include "epx/kernels.hpp"
#include "epx/moe_layer.hpp"
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
                 "--weights/--input (--grad-output) paths instead of reading them");
}

int run_layer_command(const LayerArgs& args) {
  const Config cfg = resolve_config(args.config.load(), args.config.flags.moe_flex_dispatcher_backend);
  const MoESpec spec = moe_spec_from_config(cfg);
  MoELayer layer(spec, make_local_dispatcher(spec.num_experts));
  const Shape x_shape{spec.seq_length, spec.micro_batch, spec.hidden};

  Tensor x, dy;
  if (args.init_seed) {
    layer.init_weights(*args.init_seed);
    write_safetensors(args.weights, layer.weight_tensors(), {{"format", "epx-moe-layer"}});
    x = random_normal(x_shape, spec.dtype, *args.init_seed, 1);
    write_safetensors(args.input, {{"input", x}});
    if (args.grad_output) {
      dy = random_normal(x_shape, spec.dtype, *args.init_seed, 2);
      write_safetensors(*args.grad_output, {{"grad_output", dy}});
    }
    std::cout << fmt::format("wrote initial weights to {} and a random input to {}{} (seed {})\n",
                             args.weights, args.input,
                             args.grad_output ? " and " + *args.grad_output : "", *args.init_seed);
  } else {
    layer.load_weights(read_safetensors(args.weights), args.weights);
    x = expect_tensor(read_safetensors(args.input), "input", x_shape, args.input).to(spec.dtype);
    if (args.grad_output)
      dy = expect_tensor(read_safetensors(*args.grad_output), "grad_output", x_shape, *args.grad_output)
               .to(spec.dtype);
  }

  reset_peak_memory();
  MoELayer::Context ctx;
  auto t0 = std::chrono::steady_clock::now();
  const Tensor y = layer.forward(x, ctx);
  const double fwd_ms = ms_since(t0);
  TensorMap result{{"output", y.to(DType::F32)},
                   {"loss.aux", scalar(ctx.routing.aux_loss)},
                   {"loss.z", scalar(ctx.routing.z_loss)},
                   {"routing.probs", ctx.routing.probs}};
  Tensor counts({spec.num_experts}, DType::I64);
  for (std::int64_t e = 0; e < spec.num_experts; ++e)
    counts.data<std::int64_t>()[e] = ctx.routing.tokens_per_expert[static_cast<std::size_t>(e)];
  result.emplace("routing.tokens_per_expert", counts);
  const Routing& routing = ctx.routing;
  double bwd_ms = 0;
  if (dy.defined()) {
    layer.zero_grad();
    t0 = std::chrono::steady_clock::now();
    const Tensor dx = layer.backward(ctx, dy);
    bwd_ms = ms_since(t0);
    result.emplace("grad.input", dx.to(DType::F32));
    result.merge(layer.grad_tensors());
  }
  const MemoryStats mem = memory_stats();
  write_safetensors(args.out, result,
                    {{"format", "epx-moe-layer-result"},
                     {"dtype", std::string(dtype_name(spec.dtype))},
                     {"config", cfg.source}});

  std::cout << fmt::format(
      "epx layer: {} | tokens {} (S {} x B {}) hidden {} | experts {} top-{} ffn {}{} | {} on {}\n",
      cfg.source, spec.tokens(), spec.seq_length, spec.micro_batch, spec.hidden, spec.num_experts,
      spec.topk, spec.ffn, spec.shared_ffn ? fmt::format(" shared {}", spec.shared_ffn) : "",
      dtype_name(spec.dtype), gemm_isa());
  std::cout << fmt::format("tokens per expert: {} (dropped {})\n",
                           fmt::join(routing.tokens_per_expert, " "), routing.dropped);
  std::cout << fmt::format("aux loss {:.6g} | z loss {:.6g} | forward {:.2f} ms{} | mem-max-allocated {:.1f} MB\n",
                           routing.aux_loss, routing.z_loss, fwd_ms,
                           dy.defined() ? fmt::format(" | backward {:.2f} ms", bwd_ms) : "",
                           static_cast<double>(mem.max_allocated_bytes) / 1e6);
  std::cout << fmt::format("wrote {} tensors to {}\n", result.size(), args.out);
  return 0;
}

}  // namespace epx::cli
