// Megatron-Core's placement of the decoder layers on the pipeline stages, from a config: even
// over PP x VPP model chunks, uneven with num_layers_in_first/last_pipeline_stage, with the
// embedding / loss counted as layers, or as pipeline_model_parallel_layout lists them
// (get_num_layers_to_build / get_transformer_layer_offset). Chunk v of stage p is virtual stage
// v * PP + p; the layers run through the virtual stages in order. One source for the runtime's
// pipeline (epx run) and the planner's per-stage memory and time.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "epx/config/config.hpp"

namespace epx {

struct PipelineSplit {
  int stages = 1;            // pipeline_model_parallel_size
  int chunks = 1;            // model chunks per stage: VPP, as given or as the layout has it
  bool interleaved = false;  // Megatron's interleaved schedule: VPP given (even 1) or detected above 1
  std::vector<int> layers;   // decoder layers per virtual stage, in virtual-stage order
  std::vector<int> first;    // the first layer of each virtual stage
  // The virtual stages that hold the embedding, the loss (the output layer) and the MTP layers:
  // the first, the last and the last, or where the layout puts them.
  int embedding_stage = 0, loss_stage = 0, mtp_stage = 0;

  int virtual_stages() const { return stages * chunks; }
  int stage_of(int virtual_stage) const { return virtual_stage % stages; }
  // A standalone MTP stage (before the loss's) in a later chunk of the first stage, beside the
  // embedding's chunk (check rule pipeline.mtp_first_rank_chunk; epx run refuses it).
  bool mtp_beside_first_chunk() const { return mtp_stage != loss_stage && mtp_stage > 0 && stage_of(mtp_stage) == 0; }
  // Stage p's layers, chunk by chunk: {first, end}.
  std::vector<std::pair<int, int>> ranges_on(int stage) const;
};

// Megatron-Core's VPP after its finalize: as given, else the layout's stages / PP when that is
// above 1 (TransformerConfig.__post_init__). A layout that does not parse counts as none.
std::optional<Int> virtual_pipeline_size(const ModelConfig& m);

// The split of `m`'s layers. Throws ConfigError naming the field when they do not split so.
PipelineSplit pipeline_split(const ModelConfig& m);

// Megatron-Core's requirements on the interleaved schedule's micro-batch count M and group N
// (microbatch_group_size_per_vp_stage, PP by default) on PP stages: PP <= N <= M, and M mod N
// either 0 or at least PP (schedules.py). Empty when M micro-batches can run, else why not, in
// Megatron's words. One source for the check's rule and epx run's job.
std::optional<std::string> interleaved_micro_batch_error(Int pp, Int group, Int micro_batches);

// Whether pipeline_split takes `m` (its layers split so).
bool layers_split(const ModelConfig& m);
// The smallest VPP from 2 up to `most` with which `m`'s layers split (none: none does).
std::optional<Int> smallest_splitting_vpp(const ModelConfig& m, Int most);
// The override that sets a VPP for EP overlap at PP > 1: the layout's stages per rank, else the
// smallest from 2 to 8 that splits the layers, else 1 (which Bridge accepts).
std::string vpp_to_set(const ModelConfig& m);

// For a config whose layers do not split (no layout): overrides that make them, nearest the
// config first: a smaller VPP, the embedding and loss counted as layers, an uneven first / last
// stage, no VPP, else a layout (at PP 1: the uneven fields or the VPP unset). Empty when none
// of these does.
std::vector<std::string> pipeline_split_fix(const ModelConfig& m);

// The overrides that set `layout` on `m`: the layout, and the fields Megatron-Core refuses beside
// one (uneven first / last stages, the embedding / loss counted) cleared.
std::vector<std::string> layout_overrides(const ModelConfig& m, const std::string& layout);

}  // namespace epx
