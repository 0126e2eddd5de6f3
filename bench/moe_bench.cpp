// Grouped expert GEMM against one dense GEMM of the same FLOPs, the gated activations, one head's
// blocked causal attention (with a sliding window and a sink), and the MoE layer's forward +
// backward time per token. Figures and commands: bench/RESULTS.md.
#include <benchmark/benchmark.h>

#include <iterator>
#include <optional>
#include <vector>

#include "epx/base/omp_env.hpp"
#include "epx/kernels/kernels.hpp"
#include "epx/moe/moe_layer.hpp"
#include "epx/tensor/random.hpp"

namespace epx {
namespace {

Tensor filled(Shape shape, DType dtype, std::uint64_t seed) {
  return random_normal(std::move(shape), dtype, seed, 0, 0.1);
}

DType dtype_arg(std::int64_t v) { return v ? DType::BF16 : DType::F32; }

// The experts' fc1 GEMM: `tokens` rows spread evenly over `experts`, each [m, H] x [H, 2F].
// args: experts, tokens, hidden, ffn, bf16
void BM_GroupedGemm(benchmark::State& state) {
  const std::int64_t e = state.range(0), t = state.range(1), h = state.range(2), f = state.range(3);
  const DType dt = dtype_arg(state.range(4));
  const Tensor x = filled({t, h}, dt, 1), w = filled({e, 2 * f, h}, dt, 2);
  Tensor y({t, 2 * f}, dt);
  std::vector<GemmProblem> problems;
  for (std::int64_t g = 0, r0 = 0; g < e; ++g) {
    const std::int64_t n = t / e + (g < t % e ? 1 : 0);
    problems.push_back({mat(x, r0, n), expert_mat(w, g), mat_mut(y, r0, n)});
    r0 += n;
  }
  for (auto _ : state) grouped_gemm(problems, Trans::N, Trans::T);
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * t * h * 2 * f * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["tokens/expert"] = static_cast<double>(t) / static_cast<double>(e);
}

// One dense [tokens, H] x [H, 2F] GEMM: the same FLOPs as the grouped one.
void BM_DenseGemm(benchmark::State& state) {
  const std::int64_t t = state.range(1), h = state.range(2), f = state.range(3);
  const DType dt = dtype_arg(state.range(4));
  const Tensor x = filled({t, h}, dt, 1), w = filled({2 * f, h}, dt, 2);
  Tensor y({t, 2 * f}, dt);
  for (auto _ : state) gemm(mat(x), Trans::N, mat(w), Trans::T, mat_mut(y));
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * t * h * 2 * f * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void gemm_shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"E", "T", "H", "F", "bf16"});
  for (std::int64_t bf16 : {0, 1}) {
    b->Args({8, 1024, 512, 256, bf16});     // 128 tokens per expert
    b->Args({128, 1024, 512, 256, bf16});   // 8
    b->Args({32, 4096, 1024, 768, bf16});   // 128
    b->Args({128, 8192, 1024, 512, bf16});  // 64
    b->Args({128, 4096, 2048, 1536, bf16}); // 32
    b->Args({16, 2048, 2048, 1536, bf16});  // 128
    b->Args({64, 16384, 2048, 1536, bf16}); // 256
  }
  b->Unit(benchmark::kMillisecond)->MinTime(0.3)->UseRealTime();
}
BENCHMARK(BM_GroupedGemm)->Apply(gemm_shapes);
BENCHMARK(BM_DenseGemm)->Apply(gemm_shapes);

// The gated activation over the proxy's routed rows ([T k, 2F] = [1024, 256], BF16, with the routing
// probabilities), forward then backward, per activation; clamp 7 and offset 1 as GPT-OSS's.
// args: activation (ActivationFn's order), clamped
void BM_GluForwardBackward(benchmark::State& state) {
  const MlpActivation a{kActivationFns[state.range(0)], state.range(1) ? std::optional<float>(7.f) : std::nullopt,
                        state.range(1) ? 1.f : 0.f};
  state.SetLabel(activation_fn_name(a.fn));
  const std::int64_t m = 1024, f = 128;
  const Tensor h = random_normal({m, 2 * f}, DType::BF16, 5, 0, 1.0), dout = filled({m, f}, DType::BF16, 6);
  Tensor out({m, f}, DType::BF16), dh({m, 2 * f}, DType::BF16);
  std::vector<float> probs(static_cast<std::size_t>(m), 0.25f), dprobs(probs.size());
  for (auto _ : state) {
    mlp_activation_forward(a, h, probs.data(), out);
    mlp_activation_backward(a, h, probs.data(), dout, dh, dprobs.data());
    benchmark::DoNotOptimize(dh.raw());
  }
}
BENCHMARK(BM_GluForwardBackward)
    ->ArgNames({"act", "clamped"})
    ->ArgsProduct({benchmark::CreateDenseRange(0, std::size(kActivationFns) - 1, 1), {0, 1}})
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(0.2)
    ->UseRealTime();

// The same rows ungated (gated_linear_unit=false: [T k, F] = [1024, 128] in, act(h) * p out).
// args: activation (ActivationFn's order)
void BM_UngatedActivationForwardBackward(benchmark::State& state) {
  const MlpActivation a{kActivationFns[state.range(0)], std::nullopt, 0.f, /*gated=*/false};
  state.SetLabel(activation_fn_name(a.fn));
  const std::int64_t m = 1024, f = 128;
  const Tensor h = random_normal({m, f}, DType::BF16, 5, 0, 1.0), dout = filled({m, f}, DType::BF16, 6);
  Tensor out({m, f}, DType::BF16), dh({m, f}, DType::BF16);
  std::vector<float> probs(static_cast<std::size_t>(m), 0.25f), dprobs(probs.size());
  for (auto _ : state) {
    mlp_activation_forward(a, h, probs.data(), out);
    mlp_activation_backward(a, h, probs.data(), dout, dh, dprobs.data());
    benchmark::DoNotOptimize(dh.raw());
  }
}
BENCHMARK(BM_UngatedActivationForwardBackward)
    ->ArgName("act")
    ->DenseRange(0, std::size(kActivationFns) - 1, 1)
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(0.2)
    ->UseRealTime();

// One head's blocked causal attention, forward then backward, BF16 operands at GPT-OSS's head
// width (64): the whole prefix, or a sliding window of `window` earlier keys, with or without a
// sink. The counter is the keys each query row multiplies (the diagonal blocks whole).
// args: seq, window (-1: none), sink
void BM_CausalAttention(benchmark::State& state) {
  const std::int64_t S = state.range(0), d = 64;
  const float sink = 0.5f;
  const CausalAttentionMask mask{state.range(1), state.range(2) ? &sink : nullptr};
  const Tensor q = filled({S, d}, DType::BF16, 1), k = filled({S, d}, DType::BF16, 2), v = filled({S, d}, DType::BF16, 3),
               dout = filled({S, d}, DType::BF16, 4);
  Tensor out({S, d}, DType::F32), lse({S}, DType::F32), delta({S}, DType::F32), dq({S, d}, DType::F32),
      dk({S, d}, DType::F32), dv({S, d}, DType::F32);
  using U = std::uint16_t;
  for (auto _ : state) {
    causal_attention_forward(q.data<U>(), k.data<U>(), v.data<U>(), S, d, d, 0.125f, out.data<float>(), lse.data<float>(),
                             mask);
    causal_attention_backward(q.data<U>(), k.data<U>(), v.data<U>(), lse.data<float>(), delta.data<float>(),
                              dout.data<U>(), S, d, d, 0.125f, dq.data<float>(), dk.data<float>(), dv.data<float>(), mask);
    benchmark::DoNotOptimize(dv.raw());
  }
  double keys = 0;  // per query block of 128 rows: the keys from its first row's window start to its last row
  for (std::int64_t r0 = 0; r0 < S; r0 += 128)
    keys += static_cast<double>(std::min<std::int64_t>(128, S - r0)) *
            static_cast<double>(r0 + std::min<std::int64_t>(128, S - r0) - (mask.window < 0 ? 0 : std::max<std::int64_t>(0, r0 - mask.window)));
  state.counters["keys/row"] = keys / static_cast<double>(S);
}
BENCHMARK(BM_CausalAttention)
    ->ArgNames({"S", "window", "sink"})
    ->Args({4096, -1, 0})
    ->Args({4096, -1, 1})
    ->Args({4096, 127, 0})
    ->Args({4096, 127, 1})
    ->Args({1024, -1, 0})
    ->Args({1024, 127, 1})
    ->Unit(benchmark::kMillisecond)
    ->MinTime(0.3)
    ->UseRealTime();

// One MoE layer forward + backward (dgrad and wgrad), dropless, with a shared expert.
// args: tokens, hidden, experts, topk, ffn, bf16
void BM_MoELayerForwardBackward(benchmark::State& state) {
  MoESpec s;
  s.seq_length = state.range(0);
  s.hidden = state.range(1);
  s.num_experts = state.range(2);
  s.topk = static_cast<int>(state.range(3));
  s.ffn = state.range(4);
  s.shared_ffn = s.ffn;
  s.dtype = dtype_arg(state.range(5));
  at(s.aux_loss_coeff, AuxLoss::aux_loss) = 1e-3;
  MoELayer layer(s, make_local_dispatcher(s.num_experts));
  layer.init_weights(1);
  const Tensor x = filled({s.seq_length, 1, s.hidden}, s.dtype, 3), dy = filled(x.shape(), s.dtype, 4);
  reset_peak_memory();
  for (auto _ : state) {
    MoELayer::Context ctx;
    layer.forward(x, ctx);
    benchmark::DoNotOptimize(layer.backward(ctx, dy));
  }
  const double per_step = static_cast<double>(s.seq_length);
  state.counters["us/token"] = benchmark::Counter(per_step * 1e-6, benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
  state.counters["peak_MB"] = static_cast<double>(memory_stats().max_allocated_bytes) / 1e6;
}
BENCHMARK(BM_MoELayerForwardBackward)
    ->ArgNames({"T", "H", "E", "k", "F", "bf16"})
    ->Args({256, 256, 16, 4, 128, 0})  // the proxy recipes' layer
    ->Args({256, 256, 16, 4, 128, 1})
    ->Args({2048, 1024, 32, 4, 512, 0})
    ->Args({2048, 1024, 32, 4, 512, 1})
    ->Unit(benchmark::kMillisecond)
    ->MinTime(0.5)
    ->UseRealTime();

}  // namespace
}  // namespace epx

int main(int argc, char** argv) {
  epx::cap_openmp_spin(argv);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
