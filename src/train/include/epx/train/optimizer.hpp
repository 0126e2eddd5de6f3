// Megatron's optimizer step for `epx run`: the learning-rate schedule (OptimizerParamScheduler:
// linear warmup, then constant, linear or cosine decay to min_lr) and Adam with decoupled weight
// decay (Megatron's "adam": Apex FusedAdam in AdamW mode) on the FP32 masters.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "epx/config/config.hpp"
#include "epx/tensor/param.hpp"

namespace epx {

// Counted in samples, as Megatron's scheduler (each step adds the global batch): Bridge caps a
// warmup that reaches the decay at one sample short of it.
struct LrSchedule {
  double max_lr = 0, min_lr = 0, warmup_init = 0;
  double warmup_samples = 0;  // fractional with Bridge's lr_warmup_fraction
  std::int64_t decay_samples = 0, samples_per_step = 1;
  std::string style = "linear";  // constant | linear | cosine

  // The learning rate after `step` optimizer steps (the step numbered step + 1 uses it).
  double at(std::int64_t step) const;
};

// The elements [begin, end) of a param's flat master that one Adam updates: the whole param, or
// this rank's shard of it with the distributed optimizer.
struct ParamRange {
  Param* param = nullptr;
  std::int64_t begin = 0, end = 0;
};

class Adam {
 public:
  // Norm gammas and sinks (1-D tensors) and biases get no weight decay, as in Megatron.
  Adam(std::vector<Param*> params, const OptimizerConfig& config);
  // Only `ranges` (the distributed optimizer's shard): their state alone is kept.
  Adam(std::vector<ParamRange> ranges, const OptimizerConfig& config);
  // One step on the ranges' grads with learning rate `lr`; refreshes the compute copies.
  void step(double lr);
  // The distributed optimizer's FP32 masters, as Megatron keeps them: each BF16 weight's range is
  // copied into this Adam's own shard master, so that the caller can free every BF16 weight's
  // full one (each rank then holds 4 bytes a weight for its shard only). FP32 weights keep theirs
  // (the forward reads them).
  void take_masters();

 private:
  struct State {
    ParamRange range;
    Tensor m, v;
    bool decay;
    Tensor master;  // the range's FP32 master, once taken
  };
  std::vector<State> states_;
  OptimizerConfig config_;
  std::int64_t steps_ = 0;
};

}  // namespace epx
