// The distributed MoE layer (alltoall dispatcher, experts sharded by EP and ETP) against the
// single-rank layer on the same global weights and inputs, on 1, 2 and 4 real ranks.
//
// Reference: each rank's slice of the sequence is one micro-batch of the single-rank layer (the
// distributed run routes, drops and computes its aux loss per rank, as Megatron does per rank);
// the reference runs every slice, concatenates outputs and input gradients and sums the weight
// gradients. Every rank computes the whole reference itself, then checks its own part.
#include <cmath>
#include <cstring>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "epx/comm/comm_stream.hpp"
#include "epx/comm/process_groups.hpp"
#include "epx/kernels/kernels.hpp"
#include "epx/moe/moe_layer.hpp"
#include "epx/tensor/random.hpp"
#include "mpi_test_support.hpp"
#include "tensor_compare.hpp"

namespace epx {
namespace {

using test::mpi;

struct Case {
  int ep = 1, etp = 1;  // 0: the world size
  int topk = 2;
  bool shared = false;
  bool gate = false;  // the shared expert's gate (moe_shared_expert_gate)
  enum Mode { dropless, drop, pad } mode = dropless;
  bool skewed = false;  // every token picks the last expert (and ties to expert 0)
  DType dtype = DType::F32;
  double aux = 0;
  bool gated = true;  // false: an ungated GELU MLP (fc1 [F, H], split by plain rows over ETP)
};

MoESpec spec_for(const Case& c) {
  MoESpec s;
  s.hidden = 32;
  s.num_experts = 8;
  s.topk = c.topk;
  s.ffn = 16;
  s.shared_ffn = c.shared ? 24 : 0;
  s.shared_expert_gate = c.gate;
  s.dtype = c.dtype;
  s.seq_length = 16;  // divisible by 1, 2 and 4 ranks
  s.micro_batch = 2;
  at(s.aux_loss_coeff, AuxLoss::aux_loss) = c.aux;
  s.z_loss_coeff = c.aux;
  if (c.mode != Case::dropless) s.capacity_factor = 1.0;
  s.pad_to_capacity = c.mode == Case::pad;
  s.init_std = 0.2;  // large enough that routing is not uniform
  if (!c.gated) s.activation = {ActivationFn::gelu, {}, 0.f, /*gated=*/false};
  return s;
}

void expect_close(const Tensor& want, const Tensor& got, double tol, const std::string& what) {
  ASSERT_EQ(want.shape(), got.shape()) << what;
  EXPECT_LE(test::rel_l2(got, want), tol) << what << " on rank " << mpi().rank();
}

struct Global {
  MoELayer layer;
  Tensor x, dy;
};

// Global weights and inputs, the same on every rank.
Global make_global(const MoESpec& spec, const Case& c, std::uint64_t seed) {
  Global g{MoELayer(spec, make_local_dispatcher(spec.num_experts)), {}, {}};
  g.layer.init_weights(seed);
  const Shape shape{spec.seq_length, spec.micro_batch, spec.hidden};
  g.x = random_normal(shape, spec.dtype, seed, 1);
  g.dy = random_normal(shape, spec.dtype, seed, 2);
  if (c.skewed) {
    for (std::int64_t i = 0; i < g.x.numel(); ++i) g.x.set(i, std::fabs(g.x.get(i)));
    TensorMap w = g.layer.weight_tensors();
    Tensor& router = w.at("mlp.router.weight");
    for (std::int64_t e = 0; e < spec.num_experts; ++e)
      for (std::int64_t h = 0; h < spec.hidden; ++h)
        router.set(e * spec.hidden + h, e == spec.num_experts - 1 ? 0.05f : -0.05f);
    g.layer.load_weights(w, "skewed");
  }
  return g;
}

void run_case(const Case& c) {
  const int world = mpi().size(), rank = mpi().rank();
  const int ep = c.ep ? c.ep : world, etp = c.etp ? c.etp : world;
  if (world % (ep * etp) != 0) GTEST_SKIP() << fmt::format("EP{} x ETP{} does not fit {} ranks", ep, etp, world);
  const MoESpec spec = spec_for(c);
  Global g = make_global(spec, c, 42);
  const double tol = c.dtype == DType::F32 ? 2e-6 : 2e-2;

  // Reference: every rank's slice through the single-rank layer. No case forces load balancing,
  // so the rank's random stream plays no part and one layer stands for every rank.
  Tensor ref_y, ref_dx;
  double ref_aux = 0;
  g.layer.zero_grad();
  for (int r = 0; r < world; ++r) {
    MoELayer::Context ctx;
    Tensor y = g.layer.forward(g.x.chunk(r, world), ctx);
    Tensor dx = g.layer.backward(ctx, g.dy.chunk(r, world));
    if (r == rank) {
      ref_y = y;
      ref_dx = dx;
      ref_aux = at(ctx.routing.aux_losses, AuxLoss::aux_loss);
    }
  }
  const TensorMap ref_grads = g.layer.grad_tensors();

  // Distributed.
  ProcessGroups groups(mpi().world(), ParallelLayout::make(world, 1, 1, 1, ep, etp));
  CommStream stream;
  MoELayer layer(spec, make_alltoall_dispatcher(spec.num_experts, groups, stream), {.rank = static_cast<std::uint64_t>(rank)});
  layer.load_weights(g.layer.weight_tensors(), "global");
  layer.zero_grad();
  MoELayer::Context ctx;
  const Tensor y = layer.forward(g.x.chunk(rank, world), ctx);
  const Tensor dx = layer.backward(ctx, g.dy.chunk(rank, world));
  layer.reduce_gradients(groups.get(GroupKind::tp_cp_dp), groups.get(GroupKind::edp));

  expect_close(ref_y, y, tol, "output");
  expect_close(ref_dx, dx, tol, "input gradient");
  EXPECT_NEAR(at(ctx.routing.aux_losses, AuxLoss::aux_loss), ref_aux, 1e-6 + 1e-5 * std::fabs(ref_aux));
  // Each gradient this rank owns, compared on its shard (the rest of an ETP-split tensor is 0;
  // random weights are nonzero exactly on the shard).
  const TensorMap weights = layer.weight_tensors(), grads = layer.grad_tensors();
  for (const auto& [name, w] : weights) {
    const Tensor& want_full = ref_grads.at("grad." + name);
    Tensor want(want_full.shape(), DType::F32);
    for (std::int64_t i = 0; i < w.numel(); ++i) want.set(i, w.get(i) != 0 ? want_full.get(i) : 0.f);
    expect_close(want, grads.at("grad." + name), c.dtype == DType::F32 ? 1e-5 : 2e-2, "grad." + name);
  }
  if (c.skewed) {  // the skew really left experts and ranks without tokens
    EXPECT_EQ(ctx.routing.tokens_per_expert[1], 0);
  }
}

TEST(DistributedLayer, EpAllRanksTop1) { run_case({.ep = 0, .topk = 1}); }
TEST(DistributedLayer, EpAllRanksTop2SharedExpertAuxLoss) { run_case({.ep = 0, .topk = 2, .shared = true, .aux = 1e-2}); }
// The gate's weight is dense: its gradient summed over every rank (not EDP) is the single rank's.
TEST(DistributedLayer, Ep2SharedExpertGate) { run_case({.ep = 2, .topk = 2, .shared = true, .gate = true}); }
TEST(DistributedLayer, EpAllRanksTop4) { run_case({.ep = 0, .topk = 4}); }
TEST(DistributedLayer, EpAllRanksCapacityDrop) { run_case({.ep = 0, .topk = 2, .mode = Case::drop}); }
TEST(DistributedLayer, EpAllRanksDropAndPad) { run_case({.ep = 0, .topk = 2, .mode = Case::pad}); }
TEST(DistributedLayer, SkewedRoutingEmptyExpertsAndRanks) { run_case({.ep = 0, .topk = 2, .skewed = true}); }
TEST(DistributedLayer, Bf16WithSharedExpert) { run_case({.ep = 0, .topk = 2, .shared = true, .dtype = DType::BF16}); }
TEST(DistributedLayer, Ep2WithExpertDataParallel) { run_case({.ep = 2, .topk = 2}); }
TEST(DistributedLayer, EtpAllRanks) { run_case({.ep = 1, .etp = 0, .topk = 2, .shared = true}); }
TEST(DistributedLayer, Etp2Ep2Top4) { run_case({.ep = 2, .etp = 2, .topk = 4}); }
TEST(DistributedLayer, Etp2Ep2DropAndPad) { run_case({.ep = 2, .etp = 2, .topk = 2, .mode = Case::pad}); }
TEST(DistributedLayer, Etp2Ep2Bf16) { run_case({.ep = 2, .etp = 2, .topk = 2, .dtype = DType::BF16}); }
TEST(DistributedLayer, UngatedEtpAllRanks) { run_case({.ep = 1, .etp = 0, .topk = 2, .shared = true, .gated = false}); }
TEST(DistributedLayer, UngatedEtp2Ep2) { run_case({.ep = 2, .etp = 2, .topk = 2, .gated = false}); }

// Whether oneDNN's FP32 GEMM computes a row the same whatever other rows share the call. Its
// AVX-512 kernels do; its AVX2 kernel rounds the rows of a short M tail in another order (seen
// on an AMD EPYC with AVX2 only: rows 0-1 of a 2-row call differ in the last bit from the same
// rows in a 64-row call).
bool gemm_rows_independent_of_batch(std::int64_t k, std::int64_t n, Trans tb) {
  const Tensor a = random_normal({64, k}, DType::F32, 5, 0, 1.0);
  const Tensor b = random_normal(tb == Trans::N ? Shape{k, n} : Shape{n, k}, DType::F32, 6, 0, 1.0);
  Tensor full({64, n}, DType::F32);
  gemm(mat(a), Trans::N, mat(b), tb, mat_mut(full));
  for (std::int64_t m = 1; m < 64; ++m) {
    Tensor part({m, n}, DType::F32);
    gemm(mat(a, 0, m), Trans::N, mat(b), tb, mat_mut(part));
    if (std::memcmp(part.raw(), full.raw(), part.nbytes()) != 0) return false;
  }
  return true;
}

// Dropless with no aux loss, routing does not depend on how tokens are split: the distributed
// layer equals one single-rank run over all tokens. The experts see the same rows in the same
// order (rank-major is token order), so outputs and expert gradients are bitwise equal; only the
// router gradient is summed over ranks in another order. Bitwise needs GEMM rows that do not
// depend on the rows beside them (the router's and the input gradient's GEMMs run over all
// tokens in one and over a rank's in the other); where the CPU's kernel has no such rows the
// comparison is within 1e-6 relative, and the test says so.
TEST(DistributedLayer, BitwiseEqualToOneGlobalRun) {
  const int world = mpi().size(), rank = mpi().rank();
  const Case c{.ep = 0, .topk = 2};
  const MoESpec spec = spec_for(c);
  Global g = make_global(spec, c, 7);
  g.layer.zero_grad();
  MoELayer::Context ref_ctx;
  const Tensor ref_y = g.layer.forward(g.x, ref_ctx).chunk(rank, world);
  const Tensor ref_dx = g.layer.backward(ref_ctx, g.dy).chunk(rank, world);
  const TensorMap ref_grads = g.layer.grad_tensors();

  ProcessGroups groups(mpi().world(), ParallelLayout::make(world, 1, 1, 1, world, 1));
  CommStream stream;
  MoELayer layer(spec, make_alltoall_dispatcher(spec.num_experts, groups, stream));
  layer.load_weights(g.layer.weight_tensors(), "global");
  layer.zero_grad();
  MoELayer::Context ctx;
  const Tensor y = layer.forward(g.x.chunk(rank, world), ctx);
  const Tensor dx = layer.backward(ctx, g.dy.chunk(rank, world));
  layer.reduce_gradients(groups.get(GroupKind::tp_cp_dp), groups.get(GroupKind::edp));

  // The GEMMs over all tokens: the router's logits ([T, H] x [E, H]^T) and its input gradient
  // ([T, E] x [E, H]).
  const bool bitwise = gemm_rows_independent_of_batch(spec.hidden, spec.num_experts, Trans::T) &&
                       gemm_rows_independent_of_batch(spec.num_experts, spec.hidden, Trans::N);
  if (!bitwise && rank == 0)
    std::printf("note: this CPU's GEMM (%s) rounds a row by the rows beside it: compared within 1e-6\n",
                gemm_impl(DType::F32).c_str());
  auto expect_same = [&](const Tensor& want, const Tensor& got, const std::string& what) {
    if (bitwise) EXPECT_EQ(std::memcmp(want.raw(), got.raw(), got.nbytes()), 0) << what;
    else expect_close(want, got, 1e-6, what);
  };
  expect_same(ref_y, y, "output");
  expect_same(ref_dx, dx, "input gradient");
  for (const auto& [name, grad] : layer.grad_tensors()) {
    const Tensor& want = ref_grads.at(name);
    if (name == "grad.mlp.router.weight") expect_close(want, grad, 1e-6, name);
    else expect_same(want, grad, name);
  }
}

// Megatron's global aux loss over DP ranks, one micro-batch each: its counts are every rank's
// tokens, N all of them, so the ranks' losses sum to the plain aux loss of one run over all the
// tokens, and each token's gradient is that run's (the router's gradient summed over ranks).
TEST(DistributedLayer, GlobalAuxLossIsTheAuxLossOfEveryRanksTokens) {
  const int world = mpi().size(), rank = mpi().rank();
  MoESpec spec = spec_for({.ep = 0, .topk = 2});
  at(spec.aux_loss_coeff, AuxLoss::aux_loss) = 0.1;  // large, so the aux gradient is visible
  Global g = make_global(spec, {}, 11);
  const Tensor dy = Tensor(g.dy.shape(), spec.dtype);  // the aux loss's gradient alone
  g.layer.zero_grad();
  MoELayer::Context ref_ctx;
  g.layer.forward(g.x, ref_ctx);
  const Tensor ref_dx = g.layer.backward(ref_ctx, dy).chunk(rank, world);
  const double ref_aux = at(ref_ctx.routing.aux_losses, AuxLoss::aux_loss);
  const Tensor ref_grad = g.layer.grad_tensors().at("grad.mlp.router.weight");

  spec.aux_loss_coeff = {0, 0, 0.1};
  ProcessGroups groups(mpi().world(), ParallelLayout::make(world, 1, 1, 1, world, 1));
  CommStream stream;
  MoELayer layer(spec, make_alltoall_dispatcher(spec.num_experts, groups, stream),
                 {.global_aux_group = &groups.router_counts()});
  layer.load_weights(g.layer.weight_tensors(), "global");
  layer.zero_grad();
  MoELayer::Context ctx;
  layer.forward(g.x.chunk(rank, world), ctx);
  const Tensor dx = layer.backward(ctx, dy.chunk(rank, world));
  layer.reduce_gradients(groups.get(GroupKind::tp_cp_dp), groups.get(GroupKind::edp));
  auto aux = static_cast<float>(at(ctx.routing.aux_losses, AuxLoss::global_aux_loss));
  mpi().world().allreduce(&aux, 1, DType::F32);
  EXPECT_NEAR(aux, ref_aux, 1e-5 * ref_aux);
  double norm = 0;
  for (std::int64_t i = 0; i < ref_dx.numel(); ++i) norm += std::fabs(ref_dx.get(i));
  EXPECT_GT(norm, 0.0) << "no aux gradient to compare";
  expect_close(ref_dx, dx, 1e-5, "input gradient");
  expect_close(ref_grad, layer.grad_tensors().at("grad.mlp.router.weight"), 1e-5, "router gradient");
  EXPECT_EQ(layer.router.global_aux_steps, 1);
}

}  // namespace
}  // namespace epx
