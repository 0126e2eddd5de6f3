// Megatron-Bridge's ConfigContainer._calculate_scheduler_steps: the learning-rate scheduler's
// warmup and decay, in samples, for iteration-based training (train_iters; decay over
// scheduler.max_steps, else lr_decay_iters, else train_iters) or sample-based training
// (train_samples; lr_decay_samples, else train_samples), the warmup as lr_warmup_fraction of the
// decay or as given, and Bridge's cap of a warmup as long as the decay (one sample short of it).
// One source for the check rule scheduler.warmup_capped and `epx run`'s schedule.
#pragma once

#include <optional>

#include "epx/config/config.hpp"

namespace epx {

struct SchedulerSteps {
  double warmup = 0;           // lr_warmup_steps, after the cap (fractional with lr_warmup_fraction)
  double uncapped_warmup = 0;  // before it
  Int decay = 0;               // lr_decay_steps
  bool sample_based = false;
  bool capped() const { return uncapped_warmup >= static_cast<double>(decay); }
};

// The iterations a config trains: train_iters, else train_samples // global_batch_size.
OptInt train_iterations(const Config& c);

// nullopt where the config lacks what the steps need (the run's length, the global batch).
std::optional<SchedulerSteps> scheduler_steps(const Config& c);

}  // namespace epx
