#include "epx/config/scheduler_steps.hpp"

namespace epx {

OptInt train_iterations(const Config& c) {
  const TrainConfig& t = c.train;
  if (t.train_iters) return t.train_iters;
  if (t.train_samples && t.global_batch_size && *t.global_batch_size > 0) return *t.train_samples / *t.global_batch_size;
  return std::nullopt;
}

std::optional<SchedulerSteps> scheduler_steps(const Config& c) {
  const TrainConfig& t = c.train;
  const SchedulerConfig& s = c.scheduler;
  SchedulerSteps out;
  out.sample_based = t.train_samples.has_value();
  if (out.sample_based) {
    out.decay = s.lr_decay_samples.value_or(*t.train_samples);
    out.uncapped_warmup = static_cast<double>(s.lr_warmup_samples);
  } else {
    const OptInt decay_iters = s.max_steps ? s.max_steps : s.lr_decay_iters ? s.lr_decay_iters : t.train_iters;
    if (!decay_iters || !t.global_batch_size) return std::nullopt;
    out.decay = *decay_iters * *t.global_batch_size;
    out.uncapped_warmup = static_cast<double>(s.lr_warmup_iters * *t.global_batch_size);
  }
  if (s.lr_warmup_fraction) out.uncapped_warmup = *s.lr_warmup_fraction * static_cast<double>(out.decay);
  out.warmup = out.capped() ? static_cast<double>(out.decay - 1) : out.uncapped_warmup;
  return out;
}

}  // namespace epx
