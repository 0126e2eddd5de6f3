// `epx run`'s training loop on 1, 2 and 4 real ranks: the loss curve of an EP = world run equals
// the single-rank run of the same global batch; the same seed gives bitwise the same losses; the
// loss falls on the learnable mock data; recompute changes no loss.
#include <sstream>

#include <gtest/gtest.h>

#include "epx/check.hpp"
#include "epx/trainer.hpp"
#include "mpi_test_support.hpp"

namespace epx {
namespace {

using test::mpi;

const char* kSmallRun = R"(
model:
  num_layers: 2
  hidden_size: 32
  ffn_hidden_size: 48
  num_attention_heads: 4
  num_query_groups: 2
  kv_channels: 8
  qk_layernorm: true
  normalization: RMSNorm
  gated_linear_unit: true
  add_bias_linear: false
  seq_length: 16
  vocab_size: 48
  share_embeddings_and_output_weights: false
  position_embedding_type: rope
  num_moe_experts: 8
  moe_ffn_hidden_size: 16
  moe_shared_expert_intermediate_size: 16
  moe_router_topk: 2
  moe_layer_freq: [0, 1]
  moe_aux_loss_coeff: 1.0e-2
  moe_token_dispatcher_type: alltoall
  init_method_std: 0.05
optimizer: {lr: 1.0e-2, min_lr: 1.0e-3}
scheduler: {lr_decay_style: cosine, lr_warmup_iters: 1}
train: {train_iters: 5, global_batch_size: 8, micro_batch_size: 1}
target: {gpu: cpu}
)";

std::vector<double> losses(Communicator& world, const std::vector<std::string>& overrides,
                           MockData::Mode data = MockData::Mode::random) {
  Config c = load_config_text(kSmallRun, "small");
  c.target.num_gpus = world.size();
  apply_override(c, "model.expert_model_parallel_size=" + std::to_string(world.size()));
  for (const auto& o : overrides) apply_override(c, o);
  TrainOptions options;
  options.log = false;
  options.data = data;
  std::ostringstream out;
  const TrainResult r = train(resolve_config(c, std::nullopt), world, options, out);
  std::vector<double> l;
  for (const auto& it : r.iterations) l.push_back(it.lm_loss);
  return l;
}

TEST(Training, EveryLayoutGivesTheSingleRankLossCurve) {
  for (const char* dispatcher : {"alltoall", "flex"}) {
    const std::vector<std::string> o{std::string("model.moe_token_dispatcher_type=") + dispatcher};
    const std::vector<double> distributed = losses(mpi().world(), o);
    auto self = mpi().world().split(mpi().rank(), 0, "self");
    const std::vector<double> single = losses(*self, o);
    ASSERT_EQ(distributed.size(), single.size());
    for (std::size_t i = 0; i < single.size(); ++i)
      EXPECT_NEAR(distributed[i], single[i], 2e-4 * single[i]) << dispatcher << " iteration " << i + 1;
  }
}

TEST(Training, SameSeedSameLossesBitwise) {
  const std::vector<std::string> o{"model.bf16=true"};
  EXPECT_EQ(losses(mpi().world(), o), losses(mpi().world(), o));
}

TEST(Training, LossFallsOnTheLearnablePattern) {
  const std::vector<double> l = losses(mpi().world(), {"train.train_iters=30", "optimizer.lr=3.0e-2"}, MockData::Mode::pattern);
  EXPECT_LT(l.back(), 0.5 * l.front()) << "from " << l.front() << " to " << l.back();
}

TEST(Training, RecomputeGivesTheSameLosses) {
  const std::vector<double> none = losses(mpi().world(), {});
  EXPECT_EQ(none, losses(mpi().world(), {"model.recompute_granularity=full", "model.recompute_method=uniform",
                                         "model.recompute_num_layers=1"}));
  EXPECT_EQ(none, losses(mpi().world(), {"model.recompute_granularity=selective",
                                         "model.recompute_modules=[layernorm,core_attn,moe_act,mlp,shared_experts]"}));
}

}  // namespace
}  // namespace epx
