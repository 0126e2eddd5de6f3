// The EP-overlap schedule on 1, 2 and 4 real ranks (and across the emulated cluster's nodes, from
// cluster.2x2): one iteration's losses and every weight gradient with the merged 1F1B schedule,
// with and without delayed wgrad, and with shared-expert overlap, are bitwise those of the plain
// schedule, for each dispatcher in FP32 and BF16, and for 1 to 8 micro-batches (a schedule that
// deadlocked would hit the collective timeout and abort the job).
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "epx/check/check.hpp"
#include "epx/comm/collectives.hpp"
#include "epx/comm/process_groups.hpp"
#include "epx/dispatch/dispatcher.hpp"
#include "epx/schedule/schedule.hpp"
#include "epx/trace/trace.hpp"
#include "epx/train/job_spec.hpp"
#include "epx/train/mock_data.hpp"
#include "mpi_test_support.hpp"
#include "small_gpt.hpp"

namespace epx {
namespace {

using test::mpi;

struct StepResult {
  std::vector<double> losses;  // lm and aux loss of each micro-batch
  std::vector<std::vector<float>> grads;  // every Param::grad of this rank
};

StepResult one_step(const std::vector<std::string>& overrides, const ScheduleOptions& schedule, int micro_batches) {
  Communicator& world = mpi().world();
  Config c = load_config_text(test::kSmallGpt, "small");
  c.target.num_gpus = world.size();
  apply_override(c, "model.expert_model_parallel_size=" + std::to_string(world.size()));
  for (const auto& o : overrides) apply_override(c, o);
  const Config r = resolve_config(c, std::nullopt);
  const ModelSpec spec = model_spec_from_config(r);
  ProcessGroups groups(world, parallel_layout_from_config(r, world.size()));
  CommStream stream;
  const DispatcherOptions dispatcher = dispatcher_options_from_config(r);
  GPTModel model(spec, [&] { return make_dispatcher(dispatcher, spec.moe->num_experts, groups, stream); },
                 {.aux_loss_scale = 1.0 / micro_batches, .rank = static_cast<std::uint64_t>(world.rank())});
  model.init_weights(spec.seed);
  const MockData data(MockData::Mode::random, spec.vocab, spec.seq_length, spec.seed);
  model.zero_grad();
  StepResult out;
  const auto batch = [&](int j, Tensor& tokens, Tensor& targets) {
    data.micro_batch(world.rank() * micro_batches + j, 1, tokens, targets);
  };
  for (const MicroBatchLosses& l : forward_backward(model, micro_batches, batch, schedule)) {
    out.losses.push_back(l.lm_loss);
    out.losses.insert(out.losses.end(), l.aux_losses.begin(), l.aux_losses.end());
  }
  for (const Param* p : model.params()) {
    const float* g = p->grad.data<float>();
    out.grads.emplace_back(g, g + p->grad.numel());
  }
  return out;
}

void expect_bitwise_equal(const StepResult& a, const StepResult& b, const std::string& what) {
  EXPECT_EQ(a.losses, b.losses) << what;
  ASSERT_EQ(a.grads.size(), b.grads.size()) << what;
  for (std::size_t i = 0; i < a.grads.size(); ++i)
    EXPECT_TRUE(a.grads[i] == b.grads[i]) << what << ": gradient of parameter " << i << " differs";
}

const std::vector<std::pair<std::string, std::vector<std::string>>> kDispatchers = {
    {"alltoall", {"model.moe_token_dispatcher_type=alltoall"}},
    {"flex deepep", {"model.moe_token_dispatcher_type=flex", "model.moe_flex_dispatcher_backend=deepep"}},
    {"flex hybridep", {"model.moe_token_dispatcher_type=flex", "model.moe_flex_dispatcher_backend=hybridep"}},
};

std::vector<std::string> with(std::vector<std::string> a, const std::string& b) {
  a.push_back(b);
  return a;
}

TEST(EpOverlap, GradientsAreBitwiseThoseOfThePlainSchedule) {
  for (const auto& [name, dispatcher] : kDispatchers)
    for (const char* bf16 : {"model.bf16=false", "model.bf16=true"}) {
      const std::vector<std::string> o = with(dispatcher, bf16);
      const StepResult plain = one_step(o, {}, 4);
      expect_bitwise_equal(plain, one_step(o, {.ep_overlap = true}, 4), name + ", " + bf16 + ", EP overlap");
      expect_bitwise_equal(plain, one_step(o, {.ep_overlap = true, .delay_wgrad = true}, 4),
                           name + ", " + bf16 + ", EP overlap + delay_wgrad");
    }
}

TEST(EpOverlap, OneToEightMicroBatchesFinishWithTheSameGradients) {
  for (const auto& [name, dispatcher] : kDispatchers)
    for (int n = 1; n <= 8; ++n)
      expect_bitwise_equal(one_step(dispatcher, {}, n), one_step(dispatcher, {.ep_overlap = true, .delay_wgrad = true}, n),
                           fmt::format("{}, {} micro-batches", name, n));
}

TEST(EpOverlap, EveryLayerMoeAndSelectiveRecompute) {
  // Both sides of every merged layer pair are MoE layers, so two micro-batches' exchanges share
  // the comm stream, and with 3 layers one dispatcher serves the forward and the backward of
  // the same pair.
  const std::vector<std::vector<std::string>> variants = {
      {"model.moe_layer_freq=[1,1]"},
      {"model.num_layers=3", "model.moe_layer_freq=[1,1,1]"},
      {"model.moe_layer_freq=[1,1]", "model.recompute_granularity=selective",
       "model.recompute_modules=[layernorm,core_attn,moe_act,shared_experts]"}};
  for (const auto& [name, dispatcher] : kDispatchers)
    for (const auto& v : variants) {
      std::vector<std::string> o = dispatcher;
      o.insert(o.end(), v.begin(), v.end());
      expect_bitwise_equal(one_step(o, {}, 3), one_step(o, {.ep_overlap = true, .delay_wgrad = true}, 3),
                           fmt::format("{}, {}", name, fmt::join(v, " ")));
    }
}

// The comm stream runs tasks in the order they were started, so its trace shows the schedule:
// in every merged layer pair the backward's combine-backward, then the forward's dispatch, the
// backward's dispatch-backward and the forward's combine, where the plain schedule runs each
// micro-batch's dispatch and combine, then its backward's.
TEST(EpOverlap, MergedStepsInterleaveTheExchangesOfTwoMicroBatches) {
  Communicator& world = mpi().world();
  const std::string path = (std::filesystem::temp_directory_path() /
                            fmt::format("epx_overlap_order_np{}.json", world.size())).string();
  const auto comm_order = [&](const ScheduleOptions& schedule) {
    const auto origin = trace::Clock::now();
    trace::enable(true);
    one_step({"model.moe_layer_freq=[1,1]"}, schedule, 4);
    trace::enable(false);
    const std::vector<std::string> events = allgather_text(world, trace::take_events_json(world.rank(), origin));
    if (world.rank() == 0) trace::write(path, events);
    std::string order;
    if (world.rank() == 0) {
      std::vector<std::pair<double, std::string>> tasks;
      const nlohmann::json trace = nlohmann::json::parse(std::ifstream(path));
      for (const auto& e : trace["traceEvents"])
        if (e.value("cat", std::string()) == "comm" && e["pid"] == 0) tasks.emplace_back(e["ts"].get<double>(), e["name"]);
      std::sort(tasks.begin(), tasks.end());
      for (const auto& t : tasks) order += t.second + ", ";
      std::filesystem::remove(path);
    }
    return order;
  };
  const std::string pair = "combine backward, dispatch, dispatch backward, combine, ";
  const std::string fwd = "dispatch, combine, ", bwd = "combine backward, dispatch backward, ";
  const std::string plain = comm_order({}), merged = comm_order({.ep_overlap = true, .delay_wgrad = true});
  if (world.rank() != 0) return;
  std::string expect_plain, expect_merged = fwd + fwd;  // F(0) alone
  for (int mb = 0; mb < 4; ++mb) expect_plain += fwd + fwd + bwd + bwd;
  for (int mb = 1; mb < 4; ++mb) expect_merged += pair + pair;
  expect_merged += bwd + bwd;  // B(3) alone
  EXPECT_EQ(plain, expect_plain);
  EXPECT_EQ(merged, expect_merged);
}

TEST(EpOverlap, WithExpertTensorParallelism) {
  if (mpi().world().size() != 4) GTEST_SKIP() << "needs 4 ranks (EP 2 x ETP 2)";
  for (const auto& [name, dispatcher] : kDispatchers) {
    std::vector<std::string> o = with(with(dispatcher, "model.expert_model_parallel_size=2"), "model.expert_tensor_parallel_size=2");
    expect_bitwise_equal(one_step(o, {}, 3), one_step(o, {.ep_overlap = true, .delay_wgrad = true}, 3), name + ", EP 2 x ETP 2");
  }
}

TEST(SharedExpertOverlap, GradientsAreBitwiseThoseWithoutIt) {
  // Every dispatcher: Megatron-Core allows flex since April 2026.
  for (const auto& [name, dispatcher] : kDispatchers)
    for (const char* bf16 : {"model.bf16=false", "model.bf16=true"})
      expect_bitwise_equal(one_step(with(dispatcher, bf16), {}, 3),
                           one_step(with(with(dispatcher, bf16), "model.moe_shared_expert_overlap=true"), {}, 3),
                           name + ", " + bf16);
}

}  // namespace
}  // namespace epx
