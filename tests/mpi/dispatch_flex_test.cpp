// The flex dispatchers (deepep, hybridep) against the alltoall dispatcher: the same layer, weights
// and tokens on every rank, forward and backward; outputs, input gradients, every weight gradient
// and the aux loss must agree. Runs on 1, 2 and 4 ranks and on the emulated 2 x 2 cluster, where
// the deepep domains are the real nodes.
#include <cmath>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "epx/base/error.hpp"
#include "epx/comm/comm_stream.hpp"
#include "epx/comm/process_groups.hpp"
#include "epx/config/config.hpp"
#include "epx/moe/moe_layer.hpp"
#include "epx/tensor/random.hpp"
#include "mpi_test_support.hpp"
#include "tensor_compare.hpp"

namespace epx {
namespace {

using test::mpi;

struct Case {
  FlexOptions flex;
  int ep = 0, etp = 1;  // 0: the world size
  int topk = 2;
  enum Mode { dropless, drop, pad } mode = dropless;
  bool shared = false;
  DType dtype = DType::F32;
  std::int64_t seq = 16;
};

struct Result {
  Tensor y, dx;
  TensorMap grads;
  double aux = 0;
  TrafficBytes traffic;
};

Result run(const Case& c, const MoESpec& spec, std::unique_ptr<TokenDispatcher> (*make)(const Case&, std::int64_t, ProcessGroups&, CommStream&)) {
  const int world = mpi().size(), rank = mpi().rank();
  const int ep = c.ep ? c.ep : world / c.etp;
  MoELayer global(spec, make_local_dispatcher(spec.num_experts));
  global.init_weights(7);
  const Shape shape{spec.seq_length, spec.micro_batch, spec.hidden};
  const Tensor x = random_normal(shape, spec.dtype, 7, 1), dy = random_normal(shape, spec.dtype, 7, 2);

  ProcessGroups groups(mpi().world(), ParallelLayout::make(world, 1, 1, 1, ep, c.etp));
  CommStream stream;
  MoELayer layer(spec, make(c, spec.num_experts, groups, stream), {.rank = static_cast<std::uint64_t>(rank)});
  layer.load_weights(global.weight_tensors(), "global");
  layer.zero_grad();
  Result r;
  // Two micro-batches through one dispatcher: the second reuses its buffers and window.
  for (int step = 0; step < 2; ++step) {
    MoELayer::Context ctx;
    r.y = layer.forward(x.chunk(rank, world), ctx);
    r.dx = layer.backward(ctx, dy.chunk(rank, world));
    r.aux = at(ctx.routing.aux_losses, AuxLoss::aux_loss);
  }
  layer.reduce_gradients(groups.get(GroupKind::tp_cp_dp), groups.get(GroupKind::edp));
  r.grads = layer.grad_tensors();
  r.traffic = layer.dispatcher().traffic();
  return r;
}

std::unique_ptr<TokenDispatcher> make_alltoall(const Case&, std::int64_t e, ProcessGroups& g, CommStream& s) {
  return make_alltoall_dispatcher(e, g, s);
}
std::unique_ptr<TokenDispatcher> make_flex(const Case& c, std::int64_t e, ProcessGroups& g, CommStream& s) {
  return make_flex_dispatcher(e, g, s, c.flex);
}

void run_case(const Case& c) {
  const int world = mpi().size();
  const int ep = c.ep ? c.ep : world / c.etp;
  if (world % (ep * c.etp) != 0) GTEST_SKIP() << fmt::format("EP{} x ETP{} does not fit {} ranks", ep, c.etp, world);
  if (c.flex.ranks_per_domain > 0 && (ep * c.etp) % c.flex.ranks_per_domain != 0)
    GTEST_SKIP() << "domain size does not divide the group";
  MoESpec spec;
  spec.hidden = 24;
  spec.num_experts = 8;
  spec.topk = c.topk;
  spec.ffn = 16;
  spec.shared_ffn = c.shared ? 8 : 0;
  spec.dtype = c.dtype;
  spec.seq_length = c.seq;
  spec.micro_batch = 2;
  at(spec.aux_loss_coeff, AuxLoss::aux_loss) = 1e-2;
  if (c.mode != Case::dropless) spec.capacity_factor = 1.0;
  spec.pad_to_capacity = c.mode == Case::pad;
  spec.init_std = 0.2;

  const Result want = run(c, spec, make_alltoall);
  const Result got = run(c, spec, make_flex);
  const double tol = c.dtype == DType::F32 ? 2e-6 : 2e-2;
  EXPECT_LE(test::rel_l2(got.y, want.y), tol) << "output, rank " << mpi().rank();
  EXPECT_LE(test::rel_l2(got.dx, want.dx), tol) << "input gradient, rank " << mpi().rank();
  EXPECT_NEAR(got.aux, want.aux, 1e-7);
  for (const auto& [name, g] : want.grads)
    EXPECT_LE(test::rel_l2(got.grads.at(name), g), c.dtype == DType::F32 ? 1e-5 : 2e-2) << name << ", rank " << mpi().rank();
  // Flex never sends more token bytes between nodes than alltoall (one copy per node, not per
  // expert), summed over ranks (a rail peer forwards its domain's rows, so per rank it may).
  std::int64_t payload[2] = {got.traffic.inter - got.traffic.inter_metadata,
                             want.traffic.inter - want.traffic.inter_metadata};
  mpi().world().allreduce(payload, 2, DType::I64);
  EXPECT_LE(payload[0], payload[1]);
  if (c.topk >= 4 && payload[1] > 0) {
    EXPECT_LT(payload[0], payload[1]) << "top-4 across nodes: flex sends fewer copies";
  }
}

FlexOptions deepep(int num_sms = 20) { return {.backend = FlexBackend::deepep, .num_sms = num_sms}; }
FlexOptions hybridep(int domain = 0, int chunk = 64) {
  return {.backend = FlexBackend::hybridep, .ranks_per_domain = domain, .tokens_per_chunk = chunk};
}

TEST(FlexDispatcher, DeepepTop2) { run_case({.flex = deepep()}); }
TEST(FlexDispatcher, DeepepOneChannelTop1) { run_case({.flex = deepep(2), .topk = 1}); }
TEST(FlexDispatcher, DeepepTop4SharedExpert) { run_case({.flex = deepep(), .topk = 4, .shared = true}); }
TEST(FlexDispatcher, DeepepCapacityDrop) { run_case({.flex = deepep(), .mode = Case::drop}); }
TEST(FlexDispatcher, DeepepDropAndPad) { run_case({.flex = deepep(), .mode = Case::pad}); }
TEST(FlexDispatcher, DeepepBf16) { run_case({.flex = deepep(), .topk = 4, .dtype = DType::BF16}); }
TEST(FlexDispatcher, DeepepEtp2Ep2) { run_case({.flex = deepep(), .ep = 2, .etp = 2, .topk = 4}); }
TEST(FlexDispatcher, DeepepEp2WithExpertDataParallel) { run_case({.flex = deepep(), .ep = 2}); }

TEST(FlexDispatcher, HybridepNodeDomainTop2) { run_case({.flex = hybridep()}); }
TEST(FlexDispatcher, HybridepDomainsOfOneSmallChunks) { run_case({.flex = hybridep(1, 3), .topk = 4}); }
TEST(FlexDispatcher, HybridepDomainsOfTwo) { run_case({.flex = hybridep(2, 4), .topk = 4, .shared = true}); }
TEST(FlexDispatcher, HybridepCapacityDrop) { run_case({.flex = hybridep(2, 64), .mode = Case::drop}); }
TEST(FlexDispatcher, HybridepDropAndPad) { run_case({.flex = hybridep(0, 5), .mode = Case::pad}); }
TEST(FlexDispatcher, HybridepBf16) { run_case({.flex = hybridep(2, 8), .topk = 4, .dtype = DType::BF16}); }
TEST(FlexDispatcher, HybridepEtp2Ep2) { run_case({.flex = hybridep(2, 8), .ep = 2, .etp = 2, .topk = 4, .mode = Case::pad}); }
TEST(FlexDispatcher, HybridepEp2WithExpertDataParallel) { run_case({.flex = hybridep(0, 8), .ep = 2, .topk = 2}); }

TEST(FlexDispatcher, DomainThatDoesNotDivideTheGroupIsRefused) {
  if (mpi().size() < 2) GTEST_SKIP() << "needs 2 ranks";
  ProcessGroups groups(mpi().world(), ParallelLayout::make(mpi().size(), 1, 1, 1, mpi().size(), 1));
  CommStream stream;
  EXPECT_THROW(make_flex_dispatcher(8, groups, stream, hybridep(3)), ConfigError);
}

}  // namespace
}  // namespace epx
