// The pipeline split and the pipeline orders: Megatron's layer offsets (even, VPP, uneven,
// embedding / loss counted), and every order run through a simulation of the stages that
// respects the data dependencies: each chunk's forward and backward of each micro-batch runs
// exactly once, and the stages never wait on one another in a cycle (no deadlock).
#include <map>
#include <set>

#include <gtest/gtest.h>

#include "epx/base/error.hpp"
#include "epx/check/pipeline_split.hpp"
#include "epx/schedule/pipeline.hpp"

namespace epx {
namespace {

// The runtime's spec of a config's split (what job_spec builds).
PipelineSpec spec_of(const ModelConfig& m) {
  const PipelineSplit s = pipeline_split(m);
  return PipelineSpec::from_layer_counts(s.stages, s.chunks, s.interleaved, s.layers);
}

PipelineSpec split(int num_layers, int pp, std::optional<int> vpp, OptInt first, OptInt last, bool embedding_counts,
                   bool loss_counts) {
  ModelConfig m;
  m.num_layers = num_layers;
  m.pipeline_model_parallel_size = pp;
  if (vpp) m.virtual_pipeline_model_parallel_size = *vpp;
  m.num_layers_in_first_pipeline_stage = first;
  m.num_layers_in_last_pipeline_stage = last;
  m.account_for_embedding_in_pipeline_split = embedding_counts;
  m.account_for_loss_in_pipeline_split = loss_counts;
  return spec_of(m);
}

PipelineSpec from_layout(int num_layers, int pp, const std::string& layout, OptInt vpp = std::nullopt) {
  ModelConfig m;
  m.num_layers = num_layers;
  m.pipeline_model_parallel_size = pp;
  m.virtual_pipeline_model_parallel_size = vpp;
  m.pipeline_model_parallel_layout = layout;
  return spec_of(m);
}

std::vector<std::vector<std::pair<int, int>>> ranges(const PipelineSpec& p) {
  std::vector<std::vector<std::pair<int, int>>> out;
  for (const auto& stage : p.layers) {
    out.emplace_back();
    for (const LayerRange& r : stage) out.back().emplace_back(r.first, r.end);
  }
  return out;
}

using Ranges = std::vector<std::vector<std::pair<int, int>>>;

TEST(PipelineSplit, MatchesMegatronsLayerOffsets) {
  EXPECT_EQ(ranges(split(8, 2, std::nullopt, {}, {}, false, false)), (Ranges{{{0, 4}}, {{4, 8}}}));
  // VPP: chunk v of stage p is virtual stage v x PP + p.
  EXPECT_EQ(ranges(split(8, 2, 2, {}, {}, false, false)), (Ranges{{{0, 2}, {4, 6}}, {{2, 4}, {6, 8}}}));
  // Uneven: first stage 1, last 3, the middle two 2 each (get_transformer_layer_offset).
  EXPECT_EQ(ranges(split(8, 4, std::nullopt, 1, 3, false, false)),
            (Ranges{{{0, 1}}, {{1, 3}}, {{3, 5}}, {{5, 8}}}));
  // Uneven with VPP 2: first stage 2 (1 per chunk), middle 4 (2 per chunk), last 2.
  EXPECT_EQ(ranges(split(8, 3, 2, 2, 2, false, false)),
            (Ranges{{{0, 1}, {4, 5}}, {{1, 3}, {5, 7}}, {{3, 4}, {7, 8}}}));
  // The embedding and the loss counted as layers: 6 + 2 over 4 stages.
  EXPECT_EQ(ranges(split(6, 4, std::nullopt, {}, {}, true, true)),
            (Ranges{{{0, 1}}, {{1, 3}}, {{3, 5}}, {{5, 6}}}));
  EXPECT_FALSE(split(8, 2, std::nullopt, {}, {}, false, false).interleaved);
  EXPECT_TRUE(split(8, 2, 1, {}, {}, false, false).interleaved);  // VPP set, even to 1
}

TEST(PipelineSplit, FollowsTheLayout) {
  // Megatron-Core's example shape: the embedding with one layer, the loss alone on the last stage.
  EXPECT_EQ(ranges(from_layout(5, 4, "Et|tt|tt|L")), (Ranges{{{0, 1}}, {{1, 3}}, {{3, 5}}, {{5, 5}}}));
  // Eight stages over PP 4: VPP 2 detected, the interleaved schedule, chunk v of stage p is v*4+p.
  const PipelineSpec p = from_layout(7, 4, "E|(t|)*6tL");
  EXPECT_TRUE(p.interleaved);
  EXPECT_EQ(p.chunks, 2);
  EXPECT_EQ(ranges(p), (Ranges{{{0, 0}, {3, 4}}, {{0, 1}, {4, 5}}, {{1, 2}, {5, 6}}, {{2, 3}, {6, 7}}}));
  // One stage per rank: VPP stays None (1F1B) unless given, and given it must agree.
  EXPECT_FALSE(from_layout(4, 2, "Ett|ttL").interleaved);
  EXPECT_TRUE(from_layout(4, 2, "Ett|ttL", 1).interleaved);
  EXPECT_THROW(from_layout(4, 2, "Ett|ttL", 2), ConfigError);
  EXPECT_THROW(from_layout(4, 2, "Ett|tt|L"), ConfigError);   // 3 stages over PP 2
  EXPECT_THROW(from_layout(4, 2, "Ettt|ttL"), ConfigError);   // 5 decoder layers
  EXPECT_THROW(from_layout(4, 2, "tEt|ttL"), ConfigError);    // the embedding not first
  // The planner's stages: the embedding's and the loss's, and each stage's layers.
  ModelConfig m;
  m.num_layers = 5;
  m.pipeline_model_parallel_size = 4;
  m.pipeline_model_parallel_layout = "Et|tt|tt|L";
  const PipelineSplit s = pipeline_split(m);
  EXPECT_EQ(s.ranges_on(0), (std::vector<std::pair<int, int>>{{0, 1}}));
  EXPECT_EQ(s.ranges_on(3), (std::vector<std::pair<int, int>>{{5, 5}}));
  EXPECT_EQ(s.stage_of(s.loss_stage), 3);
  EXPECT_EQ(virtual_pipeline_size(m), std::nullopt);
  m.num_layers = 7;
  m.pipeline_model_parallel_layout = "E|(t|)*6tL";
  EXPECT_EQ(virtual_pipeline_size(m), 2);
}

TEST(PipelineSplit, RefusesSplitsThatDoNotDivide) {
  EXPECT_THROW(split(6, 4, std::nullopt, {}, {}, false, false), ConfigError);
  EXPECT_THROW(split(8, 2, 3, {}, {}, false, false), ConfigError);
  EXPECT_THROW(split(8, 3, std::nullopt, 1, {}, false, false), ConfigError);  // 7 over 2
  EXPECT_THROW(split(8, 3, 2, 1, 1, false, false), ConfigError);  // 1 layer over 2 chunks
  // Megatron-Core's words for the uneven split: middle stages with no layers left for them.
  try {
    split(4, 3, std::nullopt, 2, 2, false, false);
    FAIL() << "a middle stage without layers was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("Mismatch: 0 middle layers remaining but 1 middle PP stages available."),
              std::string::npos)
        << e.what();
  }
  try {
    split(6, 4, std::nullopt, {}, {}, false, false);
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("model.num_layers=6"), std::string::npos) << e.what();
  }
}

// Runs every stage's order, a step at a time on whichever stage can go on, as the runtime does:
// sends never block, a step waits only for its inputs.
void expect_runs_to_completion(const PipelineSpec& p, int m, bool merge) {
  const int PP = p.stages, V = p.chunks;
  std::vector<std::vector<PipelineStep>> order;
  for (int s = 0; s < PP; ++s) order.push_back(pipeline_order(p, s, m, merge));
  std::set<std::pair<int, int>> forward_done, backward_done;  // (virtual stage, micro-batch)
  const auto input_ready = [&](int stage, const PipelineStep& step) {
    if (step.forward) {
      const int vs = step.forward->chunk * PP + stage;
      if (vs > 0 && !forward_done.count({vs - 1, step.forward->micro_batch})) return false;
    }
    if (step.backward) {
      const int vs = step.backward->chunk * PP + stage;
      if (!forward_done.count({vs, step.backward->micro_batch})) return false;
      if (vs < PP * V - 1 && !backward_done.count({vs + 1, step.backward->micro_batch})) return false;
    }
    return true;
  };
  std::vector<std::size_t> next(static_cast<std::size_t>(PP), 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < PP; ++s) {
      auto& k = next[static_cast<std::size_t>(s)];
      const auto& steps = order[static_cast<std::size_t>(s)];
      if (k == steps.size() || !input_ready(s, steps[k])) continue;
      const PipelineStep& step = steps[k];
      if (step.forward) {
        EXPECT_TRUE(forward_done.insert({step.forward->chunk * PP + s, step.forward->micro_batch}).second);
      }
      if (step.backward) {
        EXPECT_TRUE(backward_done.insert({step.backward->chunk * PP + s, step.backward->micro_batch}).second);
      }
      ++k;
      progress = true;
    }
  }
  for (int s = 0; s < PP; ++s)
    EXPECT_EQ(next[static_cast<std::size_t>(s)], order[static_cast<std::size_t>(s)].size())
        << "stage " << s << " is stuck: PP " << PP << " VPP " << V << " m " << m << " merge " << merge;
  EXPECT_EQ(forward_done.size(), static_cast<std::size_t>(PP * V * m));
  EXPECT_EQ(backward_done.size(), static_cast<std::size_t>(PP * V * m));
}

TEST(PipelineOrder, EveryOrderRunsEachPassOnceWithoutDeadlock) {
  for (int pp : {2, 3, 4})
    for (int m = 1; m <= 12; ++m) {
      expect_runs_to_completion(split(pp * 4, pp, std::nullopt, {}, {}, false, false), m, false);
      // Merging needs the interleaved schedule's extra warm-up forward: 1F1B refuses it.
      EXPECT_THROW(pipeline_order(split(pp * 4, pp, std::nullopt, {}, {}, false, false), 0, m, true), std::logic_error);
      for (int vpp : {1, 2, 4})
        for (int group : {0, pp + 1, 2 * pp}) {  // microbatch_group_size_per_vp_stage: PP, or more
          PipelineSpec p = split(pp * 4, pp, vpp, {}, {}, false, false);
          p.group = group;
          if (interleaved_micro_batch_error(pp, p.micro_batch_group(), m)) continue;
          expect_runs_to_completion(p, m, false);
          expect_runs_to_completion(p, m, true);
        }
    }
}

TEST(PipelineOrder, OneF1BWarmsUpWithTheLaterStagesForwards) {
  const PipelineSpec p = split(4, 4, std::nullopt, {}, {}, false, false);
  // Stage 1 of 4 with 6 micro-batches: 2 warm-up forwards, then F B alternating, then 2 backwards.
  const std::vector<PipelineStep> steps = pipeline_order(p, 1, 6, false);
  std::string shape;
  for (const PipelineStep& s : steps) {
    shape += s.forward ? "F" + std::to_string(s.forward->micro_batch) : "B" + std::to_string(s.backward->micro_batch);
  }
  EXPECT_EQ(shape, "F0F1F2B0F3B1F4B2F5B3B4B5");
}

TEST(PipelineOrder, InterleavedFollowsTheScheduleTable) {
  const PipelineSpec p = split(8, 2, 2, {}, {}, false, false);
  // Stage 0 of 2, VPP 2, 4 micro-batches: warm-up 2 (PP - 1) + (VPP - 1) PP = 4 forwards in the
  // table's order (0,c0) (1,c0) (0,c1) (1,c1), then 1F1B with the backward's chunks reversed.
  const std::vector<PipelineStep> steps = pipeline_order(p, 0, 4, false);
  std::string shape;
  for (const PipelineStep& s : steps)
    shape += (s.forward ? "F" : "B") + std::to_string(s.forward ? s.forward->micro_batch : s.backward->micro_batch) +
             "c" + std::to_string(s.forward ? s.forward->chunk : s.backward->chunk) + " ";
  EXPECT_EQ(shape, "F0c0 F1c0 F0c1 F1c1 F2c0 B0c1 F3c0 B1c1 F2c1 B0c0 F3c1 B1c0 B2c1 B3c1 B2c0 B3c0 ");
  // With EP overlap one more warm-up forward, then merged steps.
  const std::vector<PipelineStep> merged = pipeline_order(p, 0, 4, true);
  EXPECT_TRUE(merged[4].forward && !merged[4].backward);
  EXPECT_TRUE(merged[5].forward && merged[5].backward);
  EXPECT_TRUE(interleaved_micro_batch_error(2, p.micro_batch_group(), 3).has_value());
  EXPECT_FALSE(interleaved_micro_batch_error(2, p.micro_batch_group(), 6).has_value());
}

TEST(PipelineOrder, AMicroBatchGroupRunsThatManyThroughEachChunk) {
  // Megatron-Core's docstring: PP 2, VPP 2, microbatch_group_size_per_vp_stage 3, 5 micro-batches:
  // rank 0 runs the forwards 0 1 2 | 0 1 2 | 3 4 | 3 4 (chunk 0, chunk 1, ...), warm-up
  // 2 (PP - 1) + (VPP - 1) N = 5 forwards, so the first backward comes after the sixth.
  PipelineSpec p = split(8, 2, 2, {}, {}, false, false);
  p.group = 3;
  std::string forwards;
  int before_backward = 0;
  bool backward = false;
  for (const PipelineStep& s : pipeline_order(p, 0, 5, false)) {
    if (s.forward) forwards += std::to_string(s.forward->micro_batch) + "c" + std::to_string(s.forward->chunk) + " ";
    backward = backward || s.backward.has_value();
    if (!backward) ++before_backward;
  }
  EXPECT_EQ(forwards, "0c0 1c0 2c0 0c1 1c1 2c1 3c0 4c0 3c1 4c1 ");
  EXPECT_EQ(before_backward, 6);
  // Megatron-Core's checks: PP <= N <= M, and M mod N either 0 or at least PP.
  EXPECT_FALSE(interleaved_micro_batch_error(2, p.micro_batch_group(), 5).has_value());  // 5 mod 3 = 2 = PP
  EXPECT_TRUE(interleaved_micro_batch_error(2, p.micro_batch_group(), 4).has_value());   // 4 mod 3 = 1 < PP
  EXPECT_TRUE(interleaved_micro_batch_error(2, p.micro_batch_group(), 2).has_value());   // N > M
  p.group = 1;
  EXPECT_TRUE(interleaved_micro_batch_error(2, p.micro_batch_group(), 6).has_value());   // N < PP
}

}  // namespace
}  // namespace epx
