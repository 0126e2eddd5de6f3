// Megatron-Core's pipeline split: which transformer layers each pipeline stage builds, as one or
// more model chunks (virtual stages). Chunk v of stage p is virtual stage v * PP + p: a
// micro-batch's forward runs virtual stages 0, 1, ... in order, so stage PP-1's chunk v feeds
// stage 0's chunk v+1 (get_transformer_layer_offset / get_num_layers_to_build).
#pragma once

#include <string>
#include <vector>

namespace epx {

struct LayerRange {
  int first = 0, end = 0;  // [first, end) in the whole model's layer numbering
  int size() const { return end - first; }
};

struct PipelineSpec {
  int stages = 1;            // pipeline_model_parallel_size
  int chunks = 1;            // virtual_pipeline_model_parallel_size (model chunks per stage)
  bool interleaved = false;  // VPP set (even to 1): Megatron's interleaved schedule
  int group = 0;             // its microbatch_group_size_per_vp_stage; 0: PP
  int micro_batch_group() const { return group > 0 ? group : stages; }
  std::vector<std::vector<LayerRange>> layers;  // [stage][chunk]
  // The virtual stage holding the MTP layers (-1: none). Before the last, it is Megatron's
  // standalone MTP stage: its output, and every later virtual stage's, is the decoder's hidden
  // states with each MTP depth's after them (1 + depths times the rows).
  int mtp_stage = -1;

  // The spec of `layers_per_virtual_stage` (PP x `chunks` counts, in virtual-stage order: the
  // layers run through them in order). The config's split is the check layer's pipeline_split.
  static PipelineSpec from_layer_counts(int pp, int chunks, bool interleaved,
                                        const std::vector<int>& layers_per_virtual_stage);

  int virtual_stages() const { return stages * chunks; }
  bool first_virtual(int stage, int chunk) const { return stage == 0 && chunk == 0; }
  bool last_virtual(int stage, int chunk) const { return stage == stages - 1 && chunk == chunks - 1; }
  int virtual_stage(int stage, int chunk) const { return chunk * stages + stage; }
  // Chunk `chunk` of `stage` is a standalone MTP stage; the loss's chunk comes after one.
  bool standalone_mtp(int stage, int chunk) const {
    return virtual_stage(stage, chunk) == mtp_stage && !last_virtual(stage, chunk);
  }
  bool mtp_before_loss() const { return mtp_stage >= 0 && mtp_stage != virtual_stages() - 1; }
  // Whether virtual stage v's output carries the MTP depths' hidden states too.
  bool carries_mtp(int v) const { return mtp_stage >= 0 && v >= mtp_stage; }
  // "PP 2 x VPP 2: stage 0 [0,2) [4,6), stage 1 [2,4) [6,8)" ("[4,6)+MTP": a standalone MTP stage)
  std::string describe() const;
};

}  // namespace epx
