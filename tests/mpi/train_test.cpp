// `epx run`'s training loop on 1, 2 and 4 real ranks: the loss curve of an EP = world run equals
// the single-rank run of the same global batch; the same seed gives bitwise the same losses; the
// loss falls on the learnable mock data; recompute and overlapped gradient reduction change no
// loss.
#include <sstream>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "epx/check/check.hpp"
#include "epx/train/trainer.hpp"
#include "mpi_test_support.hpp"
#include "small_gpt.hpp"

namespace epx {
namespace {

using test::mpi;


TrainResult train_with(Communicator& world, const std::vector<std::string>& overrides,
                       MockData::Mode data = MockData::Mode::random) {
  Config c = load_config_text(test::kSmallGpt, "small");
  c.target.num_gpus = world.size();
  apply_override(c, "model.expert_model_parallel_size=" + std::to_string(world.size()));
  for (const auto& o : overrides) apply_override(c, o);
  TrainOptions options;
  options.log = false;
  options.data = data;
  std::ostringstream out;
  return train(resolve_config(c, std::nullopt), world, options, out);
}

std::vector<double> losses(Communicator& world, const std::vector<std::string>& overrides,
                           MockData::Mode data = MockData::Mode::random) {
  const TrainResult r = train_with(world, overrides, data);
  std::vector<double> l;
  for (const auto& it : r.iterations) l.push_back(it.lm_loss);
  return l;
}

// Per iteration: the LM loss, the gradient norm, each MTP depth's loss and (with
// mtp_detach_heads) the MTP layers' gradient norm.
std::vector<double> losses_and_norms(Communicator& world, const std::vector<std::string>& overrides) {
  std::vector<double> l;
  for (const auto& it : train_with(world, overrides).iterations) {
    l.insert(l.end(), {it.lm_loss, it.grad_norm});
    l.insert(l.end(), it.mtp_losses.begin(), it.mtp_losses.end());
    if (it.mtp_grad_norm) l.push_back(*it.mtp_grad_norm);
  }
  return l;
}

// Every iteration's loss within `rel` of the reference's (relative to the reference).
void expect_losses_near(const std::vector<double>& got, const std::vector<double>& want, double rel, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (std::size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], rel * want[i]) << what << " iteration " << i + 1;
}

TEST(Training, EveryLayoutGivesTheSingleRankLossCurve) {
  for (const char* dispatcher : {"alltoall", "flex"}) {
    const std::vector<std::string> o{std::string("model.moe_token_dispatcher_type=") + dispatcher};
    const std::vector<double> distributed = losses(mpi().world(), o);
    auto self = mpi().world().split(mpi().rank(), 0, "self");
    const std::vector<double> single = losses(*self, o);
    expect_losses_near(distributed, single, 2e-4, dispatcher);
  }
}

TEST(Training, PipelineGivesTheSingleRankLossCurve) {
  // 4 layers (dense, MoE, dense, MoE) over PP = 2 and 4 stages, 1F1B, interleaved (VPP 2, or 1 at
  // PP 4), uneven stages, a pipeline layout, alltoall and flex, the overlapped distributed optimizer: the single-rank
  // FP32 losses within the same bound as the EP layouts (the gradient sums over DP and the norm
  // over PP change the order of FP32 adds).
  const int world = mpi().size();
  if (world < 2) GTEST_SKIP() << "pipeline stages need 2 or more ranks";
  const std::vector<std::string> model{"model.num_layers=4", "model.moe_layer_freq=[0,1,0,1]"};
  auto self = mpi().world().split(mpi().rank(), 0, "self");
  std::vector<std::string> one = model;
  one.push_back("model.expert_model_parallel_size=1");
  const std::vector<double> single = losses(*self, one);
  for (const int pp : {2, 4}) {
    if (world % pp != 0) continue;
    for (const std::vector<std::string>& knobs :
         {std::vector<std::string>{"model.moe_token_dispatcher_type=alltoall"},
          std::vector<std::string>{"model.moe_token_dispatcher_type=flex", pp == 2 ? "model.virtual_pipeline_model_parallel_size=2"
                                                                                  : "model.virtual_pipeline_model_parallel_size=1"},
          // Groups of 4 micro-batches per chunk (Megatron-Core's microbatch_group_size_per_vp_stage).
          std::vector<std::string>{"model.virtual_pipeline_model_parallel_size=" + std::string(pp == 2 ? "2" : "1"),
                                   "model.microbatch_group_size_per_vp_stage=" + std::to_string(pp == 2 ? 4 : 8)},
          std::vector<std::string>{"model.num_layers_in_first_pipeline_stage=1", pp == 2 ? "model.num_layers_in_last_pipeline_stage=3"
                                                                                       : "model.num_layers_in_last_pipeline_stage=1"},
          std::vector<std::string>{"ddp.use_distributed_optimizer=true", "ddp.overlap_grad_reduce=true", "ddp.bucket_size=2000",
                                   "ddp.overlap_param_gather=true", "model.virtual_pipeline_model_parallel_size=1"},
          // A layout: at PP 2 three chunks per stage (VPP 3 detected; the embedding's and the
          // loss's chunks hold no layer), at PP 4 the embedding and the loss beside a layer.
          std::vector<std::string>{pp == 2 ? "model.pipeline_model_parallel_layout=E|t|t|t|t|L"
                                           : "model.pipeline_model_parallel_layout=Et|t|t|tL"}}) {
      if (pp == 4 && knobs.front() == "model.num_layers_in_first_pipeline_stage=1") continue;  // 2 left over 2 middle stages
      std::vector<std::string> o = model;
      o.insert(o.end(), {"model.pipeline_model_parallel_size=" + std::to_string(pp),
                         "model.expert_model_parallel_size=" + std::to_string(world / pp)});
      o.insert(o.end(), knobs.begin(), knobs.end());
      const std::vector<double> piped = losses(mpi().world(), o);
      expect_losses_near(piped, single, 2e-4, testing::PrintToString(o));
    }
  }
}

// Tied embeddings and MTP over pipeline stages: the last stage's copy of the embedding has its
// gradient summed with the first stage's after the DP reduction, and the gradient norm counts it
// once. The single-rank LM and MTP losses and gradient norms, within the pipeline's FP32 bound,
// with 1F1B, the interleaved schedule, the overlapped distributed optimizer (the embedding a
// bucket of its own on both stages), the embedding's rows reduction and EP overlap.
TEST(Training, SharedEmbeddingOverPipelineStagesGivesTheSingleRankCurve) {
  const int world = mpi().size();
  if (world < 2) GTEST_SKIP() << "pipeline stages need 2 or more ranks";
  auto self = mpi().world().split(mpi().rank(), 0, "self");
  for (const std::vector<std::string>& shared :
       {std::vector<std::string>{"model.share_embeddings_and_output_weights=true"},
        std::vector<std::string>{"model.mtp_num_layers=1"},
        std::vector<std::string>{"model.mtp_num_layers=2", "model.share_embeddings_and_output_weights=true"}}) {
    std::vector<std::string> model{"model.num_layers=4", "model.moe_layer_freq=[0,1,0,1]"};
    model.insert(model.end(), shared.begin(), shared.end());
    std::vector<std::string> one = model;
    one.push_back("model.expert_model_parallel_size=1");
    const std::vector<double> single = losses_and_norms(*self, one);
    for (const int pp : {2, 4}) {
      if (world % pp != 0) continue;
      const std::string vpp = "model.virtual_pipeline_model_parallel_size=" + std::string(pp == 2 ? "2" : "1");
      std::vector<std::vector<std::string>> runs{
          {}, {vpp}, {vpp, "ddp.use_distributed_optimizer=true", "ddp.overlap_grad_reduce=true", "ddp.bucket_size=2000",
                      "ddp.overlap_param_gather=true"}};
      // The first stage's gradient is rows even when tied: the head's part is the copy's.
      runs.push_back({"ddp.overlap_grad_reduce=true", "ddp.use_distributed_optimizer=true", "ddp.reduce_embedding_rows=true"});
      if (pp == 2) runs.push_back({vpp, "model.overlap_moe_expert_parallel_comm=true", "model.delay_wgrad_compute=true"});
      for (const std::vector<std::string>& knobs : runs) {
        std::vector<std::string> o = model;
        o.insert(o.end(), {"model.pipeline_model_parallel_size=" + std::to_string(pp),
                           "model.expert_model_parallel_size=" + std::to_string(world / pp)});
        o.insert(o.end(), knobs.begin(), knobs.end());
        expect_losses_near(losses_and_norms(mpi().world(), o), single, 2e-4, testing::PrintToString(o));
      }
    }
  }
}

// Megatron's standalone MTP stage (a layout's m in a chunk before the loss's): that chunk runs the
// final norm and the MTP layers and sends the decoder's hidden states with each depth's to the
// loss's chunk, and keeps a copy of the embedding for the MTP inputs, summed with the first
// stage's (and, tied, the last's). The single-rank LM and MTP losses and gradient norms, within
// the pipeline's FP32 bound: the MTP in the first stage's only chunk (with the embedding), in a
// middle stage's last chunk with an empty chunk after it, tied over three stages, under the
// overlapped distributed optimizer, under EP overlap and under full recompute.
TEST(Training, StandaloneMtpStageGivesTheSingleRankCurve) {
  const int world = mpi().size();
  if (world < 2) GTEST_SKIP() << "pipeline stages need 2 or more ranks";
  auto self = mpi().world().split(mpi().rank(), 0, "self");
  for (const std::vector<std::string>& mtp :
       {std::vector<std::string>{"model.mtp_num_layers=1"},
        std::vector<std::string>{"model.mtp_num_layers=2", "model.share_embeddings_and_output_weights=true"}}) {
    std::vector<std::string> model{"model.num_layers=4", "model.moe_layer_freq=[0,1,0,1]"};
    model.insert(model.end(), mtp.begin(), mtp.end());
    std::vector<std::string> one = model;
    one.push_back("model.expert_model_parallel_size=1");
    const std::vector<double> single = losses_and_norms(*self, one);
    const std::string m = mtp.front() == "model.mtp_num_layers=1" ? "m" : "mm";
    std::vector<std::vector<std::string>> runs{{"model.pipeline_model_parallel_size=2", "model.pipeline_model_parallel_layout=Etttt" + m + "|L"}};
    if (world == 4) {  // (PP 2 x DP 2; PP 4 x DP 1)
      runs.push_back({"model.pipeline_model_parallel_size=2", "model.pipeline_model_parallel_layout=Etttt" + m + "|L",
                      "ddp.use_distributed_optimizer=true", "ddp.overlap_grad_reduce=true", "ddp.bucket_size=2000"});
      const std::vector<std::string> vpp{"model.pipeline_model_parallel_size=4", "model.pipeline_model_parallel_layout=E|t|t|t|t|" + m + "||L"};
      runs.push_back(vpp);
      runs.push_back({"model.pipeline_model_parallel_size=4", "model.pipeline_model_parallel_layout=Et|t|tt" + m + "|L",
                      "ddp.use_distributed_optimizer=true", "ddp.overlap_grad_reduce=true", "ddp.bucket_size=2000",
                      "ddp.overlap_param_gather=true"});
      std::vector<std::string> overlap = vpp;
      overlap.insert(overlap.end(), {"model.virtual_pipeline_model_parallel_size=2", "model.overlap_moe_expert_parallel_comm=true",
                                     "model.delay_wgrad_compute=true"});
      runs.push_back(overlap);
      std::vector<std::string> full = vpp;  // the MTP stage reruns its MTP layers' forward
      full.insert(full.end(), {"model.recompute_granularity=full", "model.recompute_method=uniform", "model.recompute_num_layers=1"});
      runs.push_back(full);
    }
    for (const std::vector<std::string>& knobs : runs) {
      std::vector<std::string> o = model;
      o.insert(o.end(), knobs.begin(), knobs.end());
      o.push_back(fmt::format("model.expert_model_parallel_size={}", knobs.front().ends_with("=2") ? world / 2 : world / 4));
      expect_losses_near(losses_and_norms(mpi().world(), o), single, 2e-4, testing::PrintToString(o));
    }
  }
}

// mtp_detach_heads, with a clip that both norm groups exceed: the LM losses and gradient norms
// are those of the run whose MTP losses weigh 0 (the MTP's gradients leave the rest alone, and
// the logged norm and the rest's clip leave out the MTP layers, as Megatron's grad_norm_group),
// bit for bit, while the MTP layers still train. Each layout follows the single-rank curve: the
// MTP group's norm is summed over the ranks and stages like the main one's.
TEST(Training, DetachedMtpHeadsTrainTheMtpLayersAlone) {
  const int world = mpi().size();
  const std::vector<std::string> model{"model.num_layers=4", "model.moe_layer_freq=[0,1,0,1]", "model.mtp_num_layers=2",
                                       "model.moe_aux_loss_coeff=0", "optimizer.clip_grad=0.01"};
  std::vector<std::string> detached = model, weightless = model;
  detached.push_back("model.mtp_detach_heads=true");
  weightless.push_back("model.mtp_loss_scaling_factor=0");
  const auto every = [](const std::vector<double>& curve, std::size_t n, std::size_t first, std::size_t count) {
    std::vector<double> out;  // per iteration's n values, `count` from `first`
    for (std::size_t i = 0; i < curve.size(); i += n) out.insert(out.end(), curve.begin() + i + first, curve.begin() + i + first + count);
    return out;
  };
  // Per iteration, detached: LM loss, norm, 2 MTP losses, the MTP's norm; weightless without the last.
  const std::vector<double> d = losses_and_norms(mpi().world(), detached), w = losses_and_norms(mpi().world(), weightless);
  EXPECT_EQ(every(d, 5, 0, 2), every(w, 4, 0, 2));
  EXPECT_NE(every(d, 5, 2, 2).back(), every(w, 4, 2, 2).back());  // the last MTP loss: trained, against untrained
  for (double mtp_norm : every(d, 5, 4, 1)) EXPECT_GT(mtp_norm, 0.01);  // the clip reaches it
  // Clipped by their own norm, the MTP layers' gradients lose the MTP losses' weight: twice the
  // weight trains them the same (to rounding). A large adam_eps makes Adam's step follow the
  // gradient's size (and a large learning rate makes it show), which clipping by the main norm
  // would then leave doubled.
  std::vector<std::string> linear = detached;
  linear.insert(linear.end(), {"optimizer.adam_eps=1", "optimizer.lr=30"});
  std::vector<std::string> heavier = linear;
  heavier.push_back("model.mtp_loss_scaling_factor=0.2");
  const std::vector<double> base_mtp = every(losses_and_norms(mpi().world(), linear), 5, 2, 2),
                            heavier_mtp = every(losses_and_norms(mpi().world(), heavier), 5, 2, 2);
  expect_losses_near(heavier_mtp, base_mtp, 1e-6, "MTP losses, twice the weight");
  auto self = mpi().world().split(mpi().rank(), 0, "self");
  std::vector<std::string> one = detached;
  one.push_back("model.expert_model_parallel_size=1");
  const std::vector<double> single = losses_and_norms(*self, one);
  expect_losses_near(d, single, 2e-4, "detached MTP heads");
  std::vector<std::vector<std::string>> runs;
  if (world % 2 == 0) {  // the MTP in the last stage's chunk beside an embedding copy, and a stage of its own
    const std::string ep = fmt::format("model.expert_model_parallel_size={}", world / 2);
    runs.push_back({"model.pipeline_model_parallel_size=2", ep, "model.virtual_pipeline_model_parallel_size=2",
                    "ddp.use_distributed_optimizer=true", "ddp.overlap_grad_reduce=true", "ddp.bucket_size=2000"});
    runs.push_back({"model.pipeline_model_parallel_size=2", ep, "model.pipeline_model_parallel_layout=Etttt|mmL",
                    "model.share_embeddings_and_output_weights=true"});
    runs.push_back({"model.pipeline_model_parallel_size=2", ep, "model.pipeline_model_parallel_layout=Ettttmm|L"});
  }
  if (world == 4)
    runs.push_back({"model.pipeline_model_parallel_size=2", "model.expert_model_parallel_size=2",
                    "model.virtual_pipeline_model_parallel_size=2", "model.overlap_moe_expert_parallel_comm=true",
                    "model.delay_wgrad_compute=true", "model.mtp_num_layers=1"});
  for (const std::vector<std::string>& knobs : runs) {
    std::vector<std::string> o = detached, ref = one;
    o.insert(o.end(), knobs.begin(), knobs.end());
    for (const std::string& k : knobs)  // the model's own knobs on the single rank too
      if (k.starts_with("model.share_") || k.starts_with("model.mtp_")) ref.push_back(k);
    expect_losses_near(losses_and_norms(mpi().world(), o), ref == one ? single : losses_and_norms(*self, ref), 2e-4,
                       testing::PrintToString(o));
  }
}

TEST(Training, EpOverlapAcrossPipelineStagesGivesTheSameLossesBitwise) {
  // The interleaved schedule with merged steps (one chunk's forward with another's backward):
  // every weight still accumulates its micro-batches' gradients in the same order.
  if (mpi().size() != 4) GTEST_SKIP() << "PP 2 x EP 2 needs 4 ranks";
  for (const char* dispatcher : {"alltoall", "flex"}) {
    const std::vector<std::string> o{"model.bf16=true", "model.num_layers=4", "model.moe_layer_freq=[0,1,0,1]",
                                     "model.pipeline_model_parallel_size=2", "model.expert_model_parallel_size=2",
                                     "model.virtual_pipeline_model_parallel_size=2",
                                     std::string("model.moe_token_dispatcher_type=") + dispatcher};
    std::vector<std::string> overlap = o;
    overlap.insert(overlap.end(), {"model.overlap_moe_expert_parallel_comm=true", "model.delay_wgrad_compute=true",
                                   "ddp.overlap_grad_reduce=true", "ddp.bucket_size=2000"});
    EXPECT_EQ(losses(mpi().world(), o), losses(mpi().world(), overlap)) << dispatcher;
  }
}

// Every aux loss at once (the global one's counts summed over DP on the compute thread), and
// quantile balancing (its bias averaged over DP once per iteration): the EP-overlap schedule,
// recompute and the interleaved pipeline take each router's micro-batches in the same order, and
// a recompute counts nothing again, so the losses are bitwise the plain schedule's.
TEST(Training, LoadBalancingIsTheSameUnderEveryScheduleBitwise) {
  using Overrides = std::vector<std::string>;
  const auto with = [](Overrides a, const Overrides& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  const Overrides overlap{"model.overlap_moe_expert_parallel_comm=true", "model.delay_wgrad_compute=true"};
  const Overrides full{"model.recompute_granularity=full", "model.recompute_method=uniform", "model.recompute_num_layers=1"};
  // The reruns of the moe recompute and of a checkpointed MTP layer replay the router's draw and
  // count no token twice (a second count would move the global aux loss and quantile balancing).
  const Overrides moe{"model.recompute_granularity=selective", "model.recompute_modules=[moe,layernorm]"};
  const Overrides mtp{"model.mtp_num_layers=1"};
  const Overrides none{"model.bf16=true", "model.moe_router_load_balancing_type=none"};
  for (const Overrides& balancing :
       {Overrides{"model.moe_router_load_balancing_type=[aux_loss,seq_aux_loss,global_aux_loss]",
                  "model.moe_aux_loss_coeff=[1e-2,1e-2,1e-1]"},
        Overrides{"model.moe_router_load_balancing_type=quantile_balancing", "model.moe_aux_loss_coeff=0.0",
                  "model.moe_router_quantile_balancing_ema=0.5"},
        Overrides{"model.moe_router_force_load_balancing=true"}}) {
    const Overrides o = with({"model.bf16=true"}, balancing);
    const std::vector<double> plain = losses(mpi().world(), o);
    EXPECT_NE(plain, losses(mpi().world(), none)) << balancing[0] << " changes nothing";
    EXPECT_EQ(plain, losses(mpi().world(), with(o, overlap))) << balancing[0];
    EXPECT_EQ(plain, losses(mpi().world(), with(o, full))) << balancing[0];
    EXPECT_EQ(plain, losses(mpi().world(), with(o, moe))) << balancing[0];
    EXPECT_EQ(losses(mpi().world(), with(o, mtp)), losses(mpi().world(), with(with(o, mtp), full))) << balancing[0];
    if (mpi().size() == 4) {  // PP 2 x EP 2, interleaved: each stage's DP group balances its own routers
      const Overrides pp = with(o, {"model.num_layers=4", "model.moe_layer_freq=[0,1,0,1]", "model.pipeline_model_parallel_size=2",
                                    "model.expert_model_parallel_size=2", "model.virtual_pipeline_model_parallel_size=2"});
      EXPECT_EQ(losses(mpi().world(), pp), losses(mpi().world(), with(pp, overlap))) << balancing[0];
    }
  }
}

// With one micro-batch an iteration on one rank, the global aux loss is the aux loss: its counts
// restart every global batch.
TEST(Training, GlobalAuxLossRestartsEveryGlobalBatch) {
  auto self = mpi().world().split(mpi().rank(), 0, "self");
  const std::vector<std::string> one{"train.global_batch_size=1", "model.moe_aux_loss_coeff=1e-1"};
  std::vector<std::string> global = one, aux = one;
  global.push_back("model.moe_router_load_balancing_type=global_aux_loss");
  aux.push_back("model.moe_router_load_balancing_type=aux_loss");
  EXPECT_EQ(losses(*self, global), losses(*self, aux));
}

// Quantile balancing's bias is the mean of every micro-batch's estimate, averaged over DP: the
// distributed run follows the single-rank loss curve of the same global batch.
TEST(Training, QuantileBalancingGivesTheSingleRankLossCurve) {
  const std::vector<std::string> o{"model.moe_router_load_balancing_type=quantile_balancing", "model.moe_aux_loss_coeff=0",
                                   "train.train_iters=6"};
  auto self = mpi().world().split(mpi().rank(), 0, "self");
  expect_losses_near(losses(mpi().world(), o), losses(*self, o), 2e-4, "quantile balancing");
}

// The shared expert's gate (Qwen3-Next): its weight is a dense one, reduced over DP like the
// router's, and the gate runs where the shared expert does: the distributed run follows the
// single-rank curve, and overlapping the shared expert or the EP exchanges changes no bit.
TEST(Training, SharedExpertGateUnderEveryScheduleAndLayout) {
  const std::vector<std::string> o{"model.moe_shared_expert_gate=true", "model.bf16=true"};
  const std::vector<double> plain = losses(mpi().world(), o);
  std::vector<std::string> ungated = o;
  ungated[0] = "model.moe_shared_expert_gate=false";
  EXPECT_NE(plain, losses(mpi().world(), ungated));
  auto self = mpi().world().split(mpi().rank(), 0, "self");
  expect_losses_near(plain, losses(*self, o), 2e-3, "shared expert gate (BF16)");
  std::vector<std::string> shared_overlap = o, ep_overlap = o;
  shared_overlap.push_back("model.moe_shared_expert_overlap=true");
  ep_overlap.insert(ep_overlap.end(), {"model.overlap_moe_expert_parallel_comm=true", "model.delay_wgrad_compute=true"});
  EXPECT_EQ(plain, losses(mpi().world(), shared_overlap));
  EXPECT_EQ(plain, losses(mpi().world(), ep_overlap));
}

// GPT-OSS's activation (quick-GELU, the GLU's input clamped, the linear half offset by 1) in the
// dense MLP, the experts and the shared expert: the distributed run follows the single-rank curve,
// and the overlapped schedules and the recomputed activation change no bit.
TEST(Training, ClampedQuickGegluUnderEveryScheduleAndLayout) {
  const std::vector<std::string> o{"model.activation_func=quick_gelu", "model.activation_func_clamp_value=0.1",
                                   "model.glu_linear_offset=1.0"};
  const std::vector<double> plain = losses(mpi().world(), o);
  EXPECT_NE(plain, losses(mpi().world(), {"model.activation_func=quick_gelu", "model.glu_linear_offset=1.0"}));
  EXPECT_NE(plain, losses(mpi().world(), {}));
  auto self = mpi().world().split(mpi().rank(), 0, "self");
  expect_losses_near(plain, losses(*self, o), 2e-4, "clamped quick-GEGLU");
  std::vector<std::string> ep_overlap = o, recompute = o;
  ep_overlap.insert(ep_overlap.end(), {"model.overlap_moe_expert_parallel_comm=true", "model.delay_wgrad_compute=true",
                                       "model.moe_shared_expert_overlap=false"});
  recompute.insert(recompute.end(), {"model.recompute_granularity=selective", "model.recompute_modules=[moe_act,mlp]"});
  EXPECT_EQ(plain, losses(mpi().world(), ep_overlap));
  EXPECT_EQ(plain, losses(mpi().world(), recompute));
}

// `o` (4 layers) on every rank against the single-rank curve (EP = 1); bitwise the same under EP
// overlap + delay_wgrad and under moe_act / mlp recompute; near the single-rank curve with the
// flex dispatcher and over 2 pipeline stages with the overlapped distributed optimizer. Returns
// the distributed run's losses.
std::vector<double> expect_every_schedule_and_layout(const std::vector<std::string>& o, const std::string& what) {
  const std::vector<double> plain = losses(mpi().world(), o);
  auto self = mpi().world().split(mpi().rank(), 0, "self");
  std::vector<std::string> one = o;
  one.push_back("model.expert_model_parallel_size=1");
  const std::vector<double> single = losses(*self, one);
  expect_losses_near(plain, single, 2e-4, what);
  std::vector<std::string> ep_overlap = o, recompute = o, flex = o;
  ep_overlap.insert(ep_overlap.end(), {"model.overlap_moe_expert_parallel_comm=true", "model.delay_wgrad_compute=true"});
  EXPECT_EQ(plain, losses(mpi().world(), ep_overlap)) << what;
  recompute.insert(recompute.end(), {"model.recompute_granularity=selective", "model.recompute_modules=[moe_act,mlp]"});
  EXPECT_EQ(plain, losses(mpi().world(), recompute)) << what;
  flex.push_back("model.moe_token_dispatcher_type=flex");
  expect_losses_near(losses(mpi().world(), flex), single, 2e-4, what + ", flex");
  if (mpi().size() >= 2) {
    std::vector<std::string> pp = o;
    pp.insert(pp.end(), {"model.pipeline_model_parallel_size=2",
                         "model.expert_model_parallel_size=" + std::to_string(mpi().size() / 2),
                         "ddp.use_distributed_optimizer=true", "ddp.overlap_grad_reduce=true", "ddp.bucket_size=2000"});
    expect_losses_near(losses(mpi().world(), pp), single, 2e-4, what + " over 2 stages");
  }
  return plain;
}

// GPT-OSS's attention (a sliding window on every other layer, learned sinks per head, YaRN): the
// sinks are dense weights reduced over DP, and the window follows the global layer number over
// pipeline stages.
TEST(Training, SlidingWindowAndSinksUnderEveryScheduleAndLayout) {
  const std::vector<std::string> o{"model.window_size=[3,0]", "model.window_attn_skip_freq=2",
                                   "model.softmax_type=learnable", "model.num_layers=4", "model.moe_layer_freq=[0,1,0,1]",
                                   "model.position_embedding_type=yarn", "model.yarn_rotary_scaling_factor=8.0",
                                   "model.yarn_original_max_position_embeddings=4", "model.yarn_beta_fast=32.0",
                                   "model.yarn_beta_slow=1.0"};
  const std::vector<double> plain = expect_every_schedule_and_layout(o, "window and sinks");
  EXPECT_NE(plain, losses(mpi().world(), {"model.num_layers=4", "model.moe_layer_freq=[0,1,0,1]"}));
}

// add_bias_linear (GPT-OSS's, Megatron's default): the experts' biases are expert weights reduced
// over EDP, the others (the router's too) dense ones reduced over DP, and fc2's, scaled by the
// probability, sends its gradient to the router.
TEST(Training, LinearBiasesUnderEveryScheduleAndLayout) {
  const std::vector<std::string> o{"model.add_bias_linear=true", "model.num_layers=4", "model.moe_layer_freq=[0,1,0,1]",
                                   "model.moe_shared_expert_intermediate_size=null"};  // Megatron's shared experts have none
  const std::vector<double> plain = expect_every_schedule_and_layout(o, "linear biases");
  std::vector<std::string> unbiased = o;
  unbiased[0] = "model.add_bias_linear=false";
  EXPECT_NE(plain.front(), losses(mpi().world(), unbiased).front());  // the router's bias is drawn, not zero
  // In BF16 (biases rounded from FP32 masters, added to the GEMMs' FP32 output) the schedules
  // still give the same bits.
  std::vector<std::string> bf16 = o;
  bf16.push_back("model.bf16=true");
  const std::vector<double> plain16 = losses(mpi().world(), bf16);
  EXPECT_NE(plain16, plain);
  std::vector<std::string> ep_overlap = bf16, recompute = bf16;
  ep_overlap.insert(ep_overlap.end(), {"model.overlap_moe_expert_parallel_comm=true", "model.delay_wgrad_compute=true"});
  recompute.insert(recompute.end(), {"model.recompute_granularity=selective", "model.recompute_modules=[moe_act,mlp]"});
  EXPECT_EQ(plain16, losses(mpi().world(), ep_overlap)) << "BF16 biases, EP overlap";
  EXPECT_EQ(plain16, losses(mpi().world(), recompute)) << "BF16 biases, recompute";
}

// DeepSeek's multi-latent attention (the latents' projections and norms are dense weights reduced
// over DP; YaRN over the RoPE channels, the logits at mscale^2 / sqrt(head_dim)).
TEST(Training, MultiLatentAttentionUnderEveryScheduleAndLayout) {
  const std::vector<std::string> o{"model.multi_latent_attention=true", "model.q_lora_rank=8", "model.kv_lora_rank=8",
                                   "model.qk_head_dim=4", "model.qk_pos_emb_head_dim=4", "model.v_head_dim=6",
                                   "model.rotary_scaling_factor=4.0", "model.original_max_position_embeddings=4",
                                   "model.mscale_all_dim=1.0", "model.num_layers=4", "model.moe_layer_freq=[0,1,0,1]"};
  const std::vector<double> plain = expect_every_schedule_and_layout(o, "MLA");
  EXPECT_NE(plain, losses(mpi().world(), {"model.num_layers=4", "model.moe_layer_freq=[0,1,0,1]"}));
  // mla_up_proj recomputes q, k and v in the backward: the same bits, alone and under EP overlap
  // with delayed wgrad (where the recomputed latents wait for the deferred wgrad).
  std::vector<std::string> up = o;
  up.insert(up.end(), {"model.recompute_granularity=selective", "model.recompute_modules=[layernorm,mla_up_proj]"});
  EXPECT_EQ(plain, losses(mpi().world(), up)) << "mla_up_proj";
  up.insert(up.end(), {"model.overlap_moe_expert_parallel_comm=true", "model.delay_wgrad_compute=true"});
  EXPECT_EQ(plain, losses(mpi().world(), up)) << "mla_up_proj under EP overlap";
}

// Multi-token prediction (DeepSeek-V3's MTP after the decoder's last layer, MoE as it is): the MTP
// layers' weights are dense ones reduced over DP or experts reduced over EDP, and the rolled
// tokens' embedding rows join the embedding's gradient. The distributed run follows the
// single-rank curve of the LM and MTP losses; EP overlap (the MTP layers in its merged steps),
// selective and full recompute (which reruns the MTP layers too, exchanging
// their tokens again) and the flex dispatcher change nothing, nor does reducing the embedding's
// gradient as token rows.
TEST(Training, MultiTokenPredictionUnderEveryScheduleAndLayout) {
  const auto curve = [](Communicator& world, const std::vector<std::string>& o) {
    std::vector<double> l;
    for (const auto& it : train_with(world, o).iterations) {
      l.push_back(it.lm_loss);
      l.insert(l.end(), it.mtp_losses.begin(), it.mtp_losses.end());
    }
    return l;
  };
  auto self = mpi().world().split(mpi().rank(), 0, "self");
  for (const char* depths : {"1", "2"}) {
    const std::vector<std::string> o{fmt::format("model.mtp_num_layers={}", depths), "model.mtp_loss_scaling_factor=0.3",
                                     "model.num_layers=4", "model.moe_layer_freq=[0,1,0,1]"};
    const std::vector<double> plain = curve(mpi().world(), o);
    ASSERT_EQ(plain.size(), 5 * (1 + std::stoul(depths)));  // the shared config's 5 iterations
    std::vector<std::string> one = o;
    one.push_back("model.expert_model_parallel_size=1");
    expect_losses_near(plain, curve(*self, one), 2e-4, fmt::format("MTP x{}", depths));
    std::vector<std::string> recompute = o, full = o, flex = o;
    recompute.insert(recompute.end(), {"model.recompute_granularity=selective", "model.recompute_modules=[layernorm,moe_act,mlp]"});
    EXPECT_EQ(plain, curve(mpi().world(), recompute)) << depths;
    full.insert(full.end(), {"model.recompute_granularity=full", "model.recompute_method=uniform", "model.recompute_num_layers=1"});
    EXPECT_EQ(plain, curve(mpi().world(), full)) << depths << ", full recompute";
    flex.push_back("model.moe_token_dispatcher_type=flex");
    expect_losses_near(curve(mpi().world(), flex), plain, 2e-4, fmt::format("MTP x{}, flex", depths));
  }
  // EP overlap runs the MTP layers node by node in the merged steps (after the decoder's in the
  // forward, before them in the backward): bitwise the plain schedule, with and without delayed
  // wgrad; one depth (Megatron's limit under EP overlap, check rule ep_overlap.mtp_layers) with
  // tied embeddings and the overlapped distributed optimizer (whose buckets start as the head's
  // group completes), and two over 2 pipeline stages with VPP (the pipeline's steps run the MTP
  // layers whole where they are not merged).
  for (const char* depths : {"1", "2"}) {
    std::vector<std::string> o{fmt::format("model.mtp_num_layers={}", depths), "model.num_layers=4",
                               "model.moe_layer_freq=[0,1,0,1]"};
    if (depths == std::string("1"))
      o.insert(o.end(), {"model.share_embeddings_and_output_weights=true", "ddp.overlap_grad_reduce=true",
                         "ddp.use_distributed_optimizer=true", "ddp.bucket_size=500"});
    else if (mpi().size() % 2 == 0)
      o.insert(o.end(), {"model.pipeline_model_parallel_size=2", "model.virtual_pipeline_model_parallel_size=2",
                         fmt::format("model.expert_model_parallel_size={}", mpi().size() / 2)});
    const std::vector<double> plain = curve(mpi().world(), o);
    for (const bool delay : {false, true}) {
      std::vector<std::string> ep_overlap = o;
      ep_overlap.insert(ep_overlap.end(), {"model.overlap_moe_expert_parallel_comm=true",
                                           fmt::format("model.delay_wgrad_compute={}", delay)});
      EXPECT_EQ(plain, curve(mpi().world(), ep_overlap)) << testing::PrintToString(ep_overlap);
    }
  }
  const std::vector<std::string> o{"model.mtp_num_layers=1", "model.num_layers=4", "model.moe_layer_freq=[0,1,0,1]"};
  const std::vector<double> plain = curve(mpi().world(), o);
  // The MTP's gradient trains the decoder too: the LM loss moves off the curve without MTP (from
  // iteration 3; the first step's learning rate is 0, the warmup's start).
  const std::vector<double> lm = losses(mpi().world(), o),
                            without = losses(mpi().world(), {"model.num_layers=4", "model.moe_layer_freq=[0,1,0,1]"});
  EXPECT_EQ(lm[1], without[1]);
  EXPECT_NE(lm[2], without[2]);
  if (mpi().size() >= 2) {
    std::vector<std::string> reduced = o;
    reduced.insert(reduced.end(), {"ddp.overlap_grad_reduce=true", "ddp.bucket_size=2000", "ddp.use_distributed_optimizer=true"});
    const std::vector<double> dense = curve(mpi().world(), reduced);
    expect_losses_near(dense, plain, 1e-6, "MTP, distributed optimizer");
    reduced.push_back("ddp.reduce_embedding_rows=true");
    expect_losses_near(curve(mpi().world(), reduced), dense, 1e-6, "MTP, embedding rows");
  }
}

// mtp_use_repeated_layer: one MTP layer at both depths follows the single-rank curve, and EP
// overlap (over 2 pipeline stages with VPP where the ranks allow) and full recompute change no bit.
TEST(Training, ARepeatedMtpLayerUnderEveryScheduleAndLayout) {
  const std::vector<std::string> o{"model.mtp_num_layers=2", "model.mtp_use_repeated_layer=true", "model.num_layers=4", "model.moe_layer_freq=[0,1,0,1]"};
  const std::vector<double> plain = losses_and_norms(mpi().world(), o);
  auto self = mpi().world().split(mpi().rank(), 0, "self");
  std::vector<std::string> one = o;
  one.push_back("model.expert_model_parallel_size=1");
  expect_losses_near(plain, losses_and_norms(*self, one), 2e-4, "repeated MTP");
  // A second depth's layer of its own changes the curve.
  EXPECT_NE(plain, losses_and_norms(mpi().world(), {"model.mtp_num_layers=2", "model.num_layers=4", "model.moe_layer_freq=[0,1,0,1]"}));
  std::vector<std::string> full = o;
  full.insert(full.end(), {"model.recompute_granularity=full", "model.recompute_method=uniform", "model.recompute_num_layers=1"});
  EXPECT_EQ(plain, losses_and_norms(mpi().world(), full));
  std::vector<std::string> base = o;
  if (mpi().size() % 2 == 0)
    base.insert(base.end(), {"model.pipeline_model_parallel_size=2", "model.virtual_pipeline_model_parallel_size=2",
                             fmt::format("model.expert_model_parallel_size={}", mpi().size() / 2)});
  std::vector<std::string> overlap = base;
  overlap.insert(overlap.end(), {"model.overlap_moe_expert_parallel_comm=true", "model.delay_wgrad_compute=true"});
  EXPECT_EQ(losses_and_norms(mpi().world(), base), losses_and_norms(mpi().world(), overlap));
}

// recompute_modules' moe: the whole MoE layer reruns before its backward, its tokens exchanged
// again and its router replaying the draw: the same bits as without, with the alltoall and flex
// dispatchers, with the layernorm recompute, and over 2 pipeline stages.
TEST(Training, MoeRecomputeChangesNothing) {
  const std::vector<std::string> base{"model.num_layers=4", "model.moe_layer_freq=[0,1,0,1]", "model.bf16=true"};
  std::vector<std::vector<std::string>> layouts{{}, {"model.moe_token_dispatcher_type=flex"}};
  if (mpi().size() >= 2)
    layouts.push_back({"model.pipeline_model_parallel_size=2",
                       "model.expert_model_parallel_size=" + std::to_string(mpi().size() / 2)});
  for (const auto& layout : layouts) {
    std::vector<std::string> o = base;
    o.insert(o.end(), layout.begin(), layout.end());
    const std::vector<double> plain = losses(mpi().world(), o);
    for (const char* modules : {"model.recompute_modules=[moe]", "model.recompute_modules=[moe,layernorm,moe_act]"}) {
      std::vector<std::string> r = o;
      r.insert(r.end(), {"model.recompute_granularity=selective", modules});
      EXPECT_EQ(plain, losses(mpi().world(), r)) << testing::PrintToString(r);
    }
  }
}

// gated_linear_unit=false (Megatron's default MLP; Nemotron-H's squared ReLU): fc1 is F wide in
// the experts, the shared expert and the dense MLPs.
TEST(Training, UngatedMlpsUnderEveryScheduleAndLayout) {
  const std::vector<std::string> o{"model.gated_linear_unit=false", "model.activation_func=squared_relu",
                                   "model.num_layers=4", "model.moe_layer_freq=[0,1,0,1]"};
  const std::vector<double> plain = expect_every_schedule_and_layout(o, "ungated MLPs");
  std::vector<std::string> gated = o;
  gated[0] = "model.gated_linear_unit=true";
  EXPECT_NE(plain, losses(mpi().world(), gated));
}

// The expert bias moves by the sign of each expert's tokens summed over DP (one all-reduce with
// the other router counts): the distributed run follows the single-rank loss curve, and the
// bias changes it.
TEST(Training, ExpertBiasGivesTheSingleRankLossCurve) {
  const std::vector<std::string> o{"model.moe_router_score_function=sigmoid", "model.moe_router_enable_expert_bias=true",
                                   "model.moe_router_bias_update_rate=0.05", "train.train_iters=6"};
  auto self = mpi().world().split(mpi().rank(), 0, "self");
  const std::vector<double> single = losses(*self, o);
  expect_losses_near(losses(mpi().world(), o), single, 2e-4, "expert bias");
  std::vector<std::string> no_bias = o;
  no_bias[1] = "model.moe_router_enable_expert_bias=false";
  EXPECT_NE(single, losses(*self, no_bias));
}

// The expert load counts every rank's tokens: the first iteration (the same weights, the same
// global batch) is the single-rank run's; uniform random routing is near balance.
TEST(Training, ExpertLoadCountsEveryRanksTokens) {
  auto self = mpi().world().split(mpi().rank(), 0, "self");
  const TrainResult distributed = train_with(mpi().world(), {}), single = train_with(*self, {});
  EXPECT_NEAR(distributed.iterations[0].expert_load, single.iterations[0].expert_load, 1e-4);
  EXPECT_GT(single.iterations[0].expert_load, 1.05);
  // EP 1 holds every expert; over EP ranks the busiest rank's experts route more than the mean.
  EXPECT_EQ(single.iterations[0].ep_rank_load, 1.0);
  if (mpi().size() > 1) {
    EXPECT_GT(distributed.iterations[0].ep_rank_load, 1.0);
  }
  const TrainResult forced = train_with(mpi().world(), {"model.moe_router_force_load_balancing=true", "train.train_iters=1"});
  EXPECT_LT(forced.iterations[0].expert_load, single.iterations[0].expert_load);
}

// The MoE losses under training.py's names: a type string holds the names it contains ("aux_loss"
// is in "seq_aux_loss", shown at 0), a list its elements; z_loss where its coefficient is set, and
// not at all where it is 0 (Megatron's log drops the NaN of 0 / 0).
TEST(Training, TheLogNamesTheMoeLossesAsMegatron) {
  const auto line = [](const std::vector<std::string>& overrides) {
    Config c = load_config_text(test::kSmallGpt, "small");
    c.target.num_gpus = mpi().size();
    apply_override(c, "model.expert_model_parallel_size=" + std::to_string(mpi().size()));
    apply_override(c, "train.train_iters=1");
    for (const auto& o : overrides) apply_override(c, o);
    TrainOptions options;
    options.steady_first = 1;
    std::ostringstream out;
    train(resolve_config(c, std::nullopt), mpi().world(), options, out);
    const std::string log = out.str();
    const std::size_t at = log.find("lm loss:");
    return at == std::string::npos ? std::string() : log.substr(at, log.find(" loss scale", at) - at);
  };
  const std::string str = line({"model.moe_router_load_balancing_type=seq_aux_loss", "model.moe_z_loss_coeff=1e-3"});
  const std::string list = line({"model.moe_router_load_balancing_type=[seq_aux_loss]", "model.moe_aux_loss_coeff=[1e-2]"});
  const std::string no_z = line({"model.moe_z_loss_coeff=0"});
  if (mpi().rank() != mpi().size() - 1) return;  // the last rank prints the iteration line
  EXPECT_NE(str.find("| load_balancing_loss: 0.000000E+00 | seq_load_balancing_loss: "), std::string::npos) << str;
  EXPECT_NE(str.find("| z_loss: "), std::string::npos) << str;
  EXPECT_EQ(list.find(" load_balancing_loss"), std::string::npos) << list;
  EXPECT_NE(list.find("seq_load_balancing_loss: "), std::string::npos) << list;
  EXPECT_EQ(no_z.find("z_loss"), std::string::npos) << no_z;
  EXPECT_NE(no_z.find("load_balancing_loss: "), std::string::npos) << no_z;
}

TEST(Training, SameSeedSameLossesBitwise) {
  const std::vector<std::string> o{"model.bf16=true"};
  EXPECT_EQ(losses(mpi().world(), o), losses(mpi().world(), o));
}

TEST(Training, LossFallsOnTheLearnablePattern) {
  const std::vector<double> l = losses(mpi().world(), {"train.train_iters=30", "optimizer.lr=3.0e-2"}, MockData::Mode::pattern);
  EXPECT_LT(l.back(), 0.5 * l.front()) << "from " << l.front() << " to " << l.back();
}

TEST(Training, EpOverlapGivesTheSameLossesBitwise) {
  for (const char* dispatcher : {"alltoall", "flex"}) {
    const std::vector<std::string> o{"model.bf16=true", std::string("model.moe_token_dispatcher_type=") + dispatcher};
    std::vector<std::string> overlap = o;
    overlap.insert(overlap.end(), {"model.overlap_moe_expert_parallel_comm=true", "model.delay_wgrad_compute=true"});
    EXPECT_EQ(losses(mpi().world(), o), losses(mpi().world(), overlap)) << dispatcher;
  }
}

TEST(Training, OverlappedGradientReductionGivesThePlainResult) {
  // Buckets of ~2k elements (several per layer) reduced while the last micro-batch's backward
  // runs, with and without EP overlap + delayed wgrad. Each element is summed over the same
  // ranks: on 2 ranks bitwise; on 4, MPI may pick another reduction order for smaller messages.
  for (const bool ep_overlap : {false, true}) {
    std::vector<std::string> o{"model.bf16=true", "train.train_iters=4"};
    if (ep_overlap) o.insert(o.end(), {"model.overlap_moe_expert_parallel_comm=true", "model.delay_wgrad_compute=true"});
    std::vector<std::string> bucketed = o;
    bucketed.insert(bucketed.end(), {"ddp.overlap_grad_reduce=true", "ddp.bucket_size=2000"});
    const std::vector<double> plain = losses(mpi().world(), o), overlapped = losses(mpi().world(), bucketed);
    if (mpi().size() <= 2) {
      EXPECT_EQ(plain, overlapped) << "EP overlap " << ep_overlap;
    } else {
      expect_losses_near(overlapped, plain, 1e-5, "EP overlap " + std::to_string(ep_overlap));
    }
  }
}

TEST(Training, DistributedOptimizerGivesThePlainResult) {
  // Gradients reduce-scattered in buckets, Adam on each rank's shard, weights all-gathered (or,
  // with overlap_param_gather, completed bucket by bucket as the next forward needs them): the
  // same elementwise arithmetic as the plain path. The gradient norm is summed from the shards
  // in another order, so clipping (when it triggers) may differ in the last bits.
  std::vector<std::string> o{"model.bf16=true", "train.train_iters=4"};
  const std::vector<double> plain = losses(mpi().world(), o);
  for (const std::vector<std::string>& knobs :
       {std::vector<std::string>{"ddp.use_distributed_optimizer=true"},
        std::vector<std::string>{"ddp.use_distributed_optimizer=true", "ddp.overlap_grad_reduce=true", "ddp.bucket_size=2000",
                                 "model.overlap_moe_expert_parallel_comm=true", "model.delay_wgrad_compute=true"},
        std::vector<std::string>{"ddp.use_distributed_optimizer=true", "ddp.overlap_grad_reduce=true", "ddp.bucket_size=2000",
                                 "ddp.overlap_param_gather=true"}}) {
    std::vector<std::string> with = o;
    with.insert(with.end(), knobs.begin(), knobs.end());
    const std::vector<double> sharded = losses(mpi().world(), with);
    expect_losses_near(sharded, plain, 1e-6, testing::PrintToString(knobs));
  }
}

TEST(Training, DistributedOptimizerKeepsOnlyItsShardOfTheState) {
  // Adam's moments and the FP32 masters of BF16 weights only for this rank's shard (as Megatron):
  // on 2 ranks the peak falls to 0.82x of the plain run's; with the masters kept whole as well as
  // the shard's it is 1.01x.
  if (mpi().size() != 2) GTEST_SKIP() << "measured on DP 2";
  const std::vector<std::string> o{"model.bf16=true", "train.train_iters=2"};
  const std::int64_t plain = train_with(mpi().world(), o).peak_memory_bytes;
  std::vector<std::string> sharded = o;
  sharded.push_back("ddp.use_distributed_optimizer=true");
  const std::int64_t distributed = train_with(mpi().world(), sharded).peak_memory_bytes;
  EXPECT_LT(static_cast<double>(distributed), 0.86 * static_cast<double>(plain)) << distributed << " against " << plain;
}

TEST(Training, EmbeddingRowsReductionGivesThePlainResult) {
  // ddp.reduce_embedding_rows: the embedding's gradient summed as the earlier micro-batches' sum
  // plus every rank's last-micro-batch rows. FP32 reduction: the same sums in another order;
  // BF16: the rows skip one rounding to BF16. With EP overlap and with the distributed optimizer.
  if (mpi().size() < 2) GTEST_SKIP() << "no DP reduction on one rank";
  const std::vector<std::string> overlap{"train.train_iters=4", "ddp.overlap_grad_reduce=true", "ddp.bucket_size=2000"};
  for (const std::vector<std::string>& knobs :
       {std::vector<std::string>{}, std::vector<std::string>{"model.overlap_moe_expert_parallel_comm=true", "model.delay_wgrad_compute=true"},
        std::vector<std::string>{"ddp.use_distributed_optimizer=true"}}) {
    for (const bool bf16 : {false, true}) {
      std::vector<std::string> o = overlap;
      o.insert(o.end(), knobs.begin(), knobs.end());
      if (bf16) o.push_back("model.bf16=true");
      std::vector<std::string> rows = o;
      rows.push_back("ddp.reduce_embedding_rows=true");
      const std::string what = testing::PrintToString(rows);
      const std::vector<double> dense = losses(mpi().world(), o), split = losses(mpi().world(), rows);
      expect_losses_near(split, dense, bf16 ? 2e-4 : 1e-6, what);
    }
  }
}

TEST(Training, Bf16GradientReductionFollowsGradReduceInFp32) {
  // A BF16 model reduces its gradients in BF16 buckets unless ddp.grad_reduce_in_fp32 (Megatron's
  // DDP): close to the FP32 reduction, and not the same once there is a DP group to reduce over.
  if (mpi().size() < 2) GTEST_SKIP() << "no DP reduction on one rank";
  const std::vector<std::string> o{"model.bf16=true", "model.expert_model_parallel_size=1"};
  std::vector<std::string> fp32 = o;
  fp32.push_back("ddp.grad_reduce_in_fp32=true");
  const std::vector<double> in_bf16 = losses(mpi().world(), o), in_fp32 = losses(mpi().world(), fp32);
  expect_losses_near(in_bf16, in_fp32, 2e-3, "BF16 against FP32 reduction");
  EXPECT_NE(in_bf16, in_fp32);
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
