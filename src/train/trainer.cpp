#include "epx/train/trainer.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <numeric>
#include <ctime>
#include <fstream>
#include <iostream>
#include <memory>
#include <unordered_map>
#include <unordered_set>

#include <fmt/format.h>

#include "epx/base/cpu_clock.hpp"
#include "epx/base/error.hpp"
#include "epx/comm/collectives.hpp"
#include "epx/comm/comm_stream.hpp"
#include "epx/comm/process_groups.hpp"
#include "epx/kernels/kernels.hpp"
#include "epx/model/gpt_model.hpp"
#include "epx/schedule/pipeline.hpp"
#include "epx/schedule/schedule.hpp"
#include "epx/tensor/random.hpp"
#include "epx/trace/trace.hpp"
#include "epx/train/job_spec.hpp"
#include "epx/train/optimizer.hpp"
#include "grad_reducer.hpp"
#include "rank_cpu.hpp"

namespace epx {
namespace {

using Clock = std::chrono::steady_clock;

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// A NaN as Python prints it, without the sign bit fmt would show ("-nan").
double python_nan(double x) { return std::isnan(x) ? std::fabs(x) : x; }

double grad_sum_of_squares(const Param* p) { return sum_of_squares(p->grad.data<float>(), p->grad.numel()); }

// The gradients' sum of squares per norm group: [0] the main one, [1] the MTP layers' where
// mtp_detach_heads makes them a group of their own (`mtp`, else empty). A param's in `known`
// (computed once its gradient was final) is taken from there; the sum's order is the params'.
std::array<double, 2> grad_sums_of_squares(const std::vector<Param*>& params, const std::unordered_set<const Param*>& mtp,
                                           const std::unordered_map<const Param*, double>& known) {
  std::array<double, 2> s{};
  for (const Param* p : params) {
    const auto it = known.find(p);
    s[mtp.count(p)] += it != known.end() ? it->second : grad_sum_of_squares(p);
  }
  return s;
}

std::string timestamp() {
  const std::time_t now = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", std::localtime(&now));
  return buf;
}

// One `epx run` on this rank: the job's specs, this rank's process groups and comm stream, the
// model and its optimizer, the data. The phases of an iteration are Megatron's: train_step
// (forward_backward_func over the micro-batches, then finalize_model_grads and the optimizer step)
// and training_log.
class Trainer {
 public:
  Trainer(const Config& cfg, Communicator& world, const TrainOptions& options, std::ostream& out)
      : cfg_(cfg),
        world_(world),
        options_(options),
        out_(out),
        job_(JobSpec::from_config(cfg, world.size())),
        groups_(world, job_.layout),
        grad_stream_(trace::Track::grad_comm),
        stage_(job_.layout.rank_in(GroupKind::pp, world.rank())),
        chunks_(build_chunks()),
        params_(all_of(&GPTModel::params)),
        experts_(all_of(&GPTModel::expert_params)),
        shared_embedding_(shared_embedding()),
        embedding_stages_(embedding_stages()),
        reducer_(grad_groups(), group_chunks(), params_, groups_.get(GroupKind::dp_cp), groups_.get(GroupKind::edp),
                 grad_stream_, job_.grad_reduce, embedding_group(), shared_embedding_),
        adam_(job_.grad_reduce.distributed ? Adam(reducer_.owned_ranges(), cfg.optimizer) : Adam(params_, cfg.optimizer)),
        data_(options.data, job_.model.vocab, job_.model.seq_length, job_.model.seed),
        flops_per_iteration_(job_.model.flops_per_token() * static_cast<double>(job_.model.seq_length * job_.global_batch)),
        dp_rank_(job_.layout.rank_in(GroupKind::dp, world.rank())) {
    int offset = 0;  // each chunk's groups follow the previous chunk's in the reducer
    for (auto& chunk : chunks_) {
      chunk->init_weights(job_.model.seed);
      chunk->set_grads_ready_hook([this, offset](int group) { reducer_.grads_ready(offset + group); });
      chunk->set_params_needed_hook([this, offset](int group) { reducer_.params_needed(offset + group); });
      chunk->set_embedding_rows_hook([this](const Tensor& tokens, const Tensor& dx) { return reducer_.take_embedding_rows(tokens, dx); });
      offset += static_cast<int>(chunk->grad_groups().size());
    }
    for (Param* p : params_)  // the norm counts the shared embedding once, on the first stage (Megatron's `shared`)
      if (!p->expert && !(p == shared_embedding_ && stage_ > 0)) dense_.push_back(p);
    if (job_.model.mtp_detached)
      for (Param* p : all_of(&GPTModel::mtp_params)) mtp_norm_group_.insert(p);
    // The distributed optimizer keeps FP32 masters for this rank's shard only, in Adam; a BF16
    // weight's full master goes (the forward reads its BF16 copy, the all-gather refreshes it).
    if (job_.grad_reduce.distributed) {
      adam_.take_masters();
      for (Param* p : params_)
        if (p->compute.dtype() == DType::BF16) p->master = Tensor();
    }
  }

  TrainResult run();

 private:
  std::vector<std::unique_ptr<GPTModel>> build_chunks();
  template <class F>
  std::vector<Param*> all_of(F chunk_params) {
    std::vector<Param*> out;
    for (auto& c : chunks_)
      for (Param* p : ((*c).*chunk_params)()) out.push_back(p);
    return out;
  }
  std::vector<std::vector<Param*>> grad_groups();
  std::vector<int> group_chunks();  // each of grad_groups()'s chunk
  int embedding_group();            // the token embedding's in grad_groups(), or -1 (not on this stage)
  Param* shared_embedding();        // GPTModel::shared_embedding of this stage's chunks, or null
  // The ranks of this pipeline whose stages keep the embedding or a copy of it where tied
  // embeddings or MTP need it: the first, the last (tied) and the MTP's (Megatron's embedding
  // group, pretrain_gpt's get_embedding_ranks); null where not (every rank agrees).
  std::unique_ptr<Communicator> embedding_stages();
  void check_shared_embedding();  // after the run: the first stage's embedding and the copy are the same bits
  std::vector<MoELayer*> moe_layers();
  std::string schedule_name() const;
  void log_start(const TrainResult& r) const;
  IterationLog train_step(int it);
  std::array<double, 2> finalize_gradients();
  void training_log(const IterationLog& log) const;
  struct ExpertLoad {
    double expert = 0, ep_rank = 0;  // busiest / mean, summed over this stage's MoE layers
  };
  ExpertLoad update_routers();
  // The MoE losses Megatron's log line shows after the LM loss: " load_balancing_loss: 1.0E+00 |".
  static std::string moe_losses_text(const IterationLog& log) {
    std::string out;
    for (const auto& [name, value] : log.moe_losses)  // Megatron's training_log prints a loss only where >= 0
      if (value >= 0) out += fmt::format(" {}: {:.6E} |", name, value);
    for (std::size_t k = 0; k < log.mtp_losses.size(); ++k) out += fmt::format(" mtp_{} loss: {:.6E} |", k + 1, log.mtp_losses[k]);
    return out;
  }
  // The steady state's figures, taken as its last iteration ends (--steady-to may end it early).
  struct SteadyState {
    trace::Clock::time_point begin, end = trace::Clock::time_point::max();
    double cpu_begin_s = 0, cpu_s = 0;  // the process's CPU clock (every thread of this rank)
    CommStream::Stats stream, grad_stream;
    PipelineTiming pipeline;
  };
  void summarize(TrainResult& r, trace::Clock::time_point origin, const SteadyState& steady);
  PipelineStats pipeline_stats(const PipelineTiming& timing, int iterations);

  const Config& cfg_;
  Communicator& world_;
  const TrainOptions& options_;
  std::ostream& out_;
  const JobSpec job_;
  ProcessGroups groups_;
  CommStream stream_;
  CommStream grad_stream_;  // the gradient reduction's own stream, as Megatron's DDP has
  const int stage_;         // this rank's pipeline stage
  std::vector<std::unique_ptr<GPTModel>> chunks_;  // this stage's model chunks (one without VPP)
  const std::vector<Param*> params_, experts_;  // experts_: reduced over EDP
  Param* const shared_embedding_;
  const std::unique_ptr<Communicator> embedding_stages_;
  GradReducer reducer_;
  std::vector<Param*> dense_;                   // the rest: reduced over DP (in the norm: the embedding's copy left out)
  // mtp_detach_heads: the MTP layers' weights, a norm group of their own (Megatron's
  // grad_norm_group "mtp": left out of the logged norm and clipped by theirs); else empty.
  std::unordered_set<const Param*> mtp_norm_group_;
  Adam adam_;
  const MockData data_;
  const double flops_per_iteration_;
  const int dp_rank_;
  PipelineTiming pipeline_timing_;  // steady state
};

std::vector<std::unique_ptr<GPTModel>> Trainer::build_chunks() {
  const PipelineSpec& pl = job_.pipeline;
  std::vector<std::unique_ptr<GPTModel>> out;
  for (int v = 0; v < pl.chunks; ++v) {
    const bool last = pl.last_virtual(stage_, v);
    out.push_back(std::make_unique<GPTModel>(
        job_.model, [this] { return make_dispatcher(job_.dispatcher, job_.model.moe->num_experts, groups_, stream_); },
        MoELayerOptions{.aux_loss_scale = 1.0 / static_cast<double>(job_.micro_batches),
                        .rank = static_cast<std::uint64_t>(world_.rank()),
                        .global_aux_group = &groups_.router_counts()},
        ModelChunk{pl.layers[static_cast<std::size_t>(stage_)][static_cast<std::size_t>(v)], pl.first_virtual(stage_, v),
                   last, pl.standalone_mtp(stage_, v), last && pl.mtp_before_loss()}));
  }
  return out;
}

std::vector<std::vector<Param*>> Trainer::grad_groups() {
  std::vector<std::vector<Param*>> out;
  for (auto& c : chunks_)
    for (auto& g : c->grad_groups()) out.push_back(std::move(g));
  return out;
}

std::vector<int> Trainer::group_chunks() {
  std::vector<int> out;
  for (std::size_t c = 0; c < chunks_.size(); ++c) out.insert(out.end(), chunks_[c]->grad_groups().size(), static_cast<int>(c));
  return out;
}

int Trainer::embedding_group() {
  int offset = 0;
  for (auto& c : chunks_) {
    if (c->chunk().pre_process) return offset + c->embedding_grad_group();
    offset += static_cast<int>(c->grad_groups().size());
  }
  return -1;
}

Param* Trainer::shared_embedding() {
  for (auto& c : chunks_)
    if (Param* p = c->shared_embedding()) return p;
  return nullptr;
}

std::unique_ptr<Communicator> Trainer::embedding_stages() {
  const int stages = job_.pipeline.stages;
  if (stages == 1 || !(job_.model.tie_embeddings || job_.model.mtp_layers > 0)) return nullptr;
  Communicator& pp = groups_.get(GroupKind::pp);
  const int mtp = job_.pipeline.mtp_stage;
  const bool holds = pp.rank() == 0 || (job_.model.tie_embeddings && pp.rank() == stages - 1) ||
                     (mtp >= 0 && mtp % stages == pp.rank());
  return pp.split(holds ? 0 : 1, pp.rank(), pp.name() + " embedding");  // the others' group goes unused
}

// The stages step the same weights on the same summed gradient, so the copies stay bitwise equal;
// a difference is a bug in epx (exit 3), and would otherwise only show as a slow drift of the loss.
void Trainer::check_shared_embedding() {
  if (!embedding_stages_ || !shared_embedding_ || embedding_stages_->size() == 1) return;
  // FNV-1a (random.hpp's) over the bytes of the weights the forward reads.
  const Tensor& w = shared_embedding_->compute;
  std::uint64_t hash = stream_of(std::string_view(static_cast<const char*>(w.raw()), w.nbytes()));
  const auto n = static_cast<std::size_t>(embedding_stages_->size());
  std::vector<std::uint64_t> all(n);
  embedding_stages_->allgatherv(&hash, all.data(), std::vector<std::int64_t>(n, 1), DType::I64);
  if (std::adjacent_find(all.begin(), all.end(), std::not_equal_to<>()) != all.end())
    throw std::logic_error(fmt::format("the first pipeline stage's {} and another stage's copy of it differ after the "
                                       "run (they step on the same summed gradient)",
                                       shared_embedding_->name));
}

std::vector<MoELayer*> Trainer::moe_layers() {
  std::vector<MoELayer*> out;
  for (auto& c : chunks_)
    for (MoELayer* l : c->moe_layers()) out.push_back(l);
  return out;
}

std::string Trainer::schedule_name() const {
  const ScheduleOptions& s = job_.schedule;
  const PipelineSpec& p = job_.pipeline;
  const std::string pipeline = p.stages == 1 ? ""
                               : p.interleaved ? fmt::format("interleaved pipeline (VPP {}), ", p.chunks)
                                               : "1F1B pipeline, ";
  if (s.ep_overlap)
    return pipeline + (s.delay_wgrad ? "EP overlap (merged 1F1B) + delayed wgrad" : "EP overlap (merged 1F1B)");
  return pipeline + (job_.model.moe && job_.model.moe->shared_expert_overlap ? "shared-expert overlap" : "no overlap");
}

void Trainer::log_start(const TrainResult& r) const {
  if (!options_.log || world_.rank() != 0) return;
  std::int64_t n = 0;
  for (const Param* p : params_) n += p->grad.numel();
  out_ << fmt::format("epx run: {} | {} | dispatcher {} | {} | {} micro-batches of {} x {} tokens per rank per "
                      "iteration | recompute {} | {} parameters on rank 0\n",
                      cfg_.source, r.layout, r.dispatcher, r.schedule, job_.micro_batches, job_.model.micro_batch,
                      job_.model.seq_length, r.recompute, n)
       << std::flush;
}

// Once per global batch, every router's state that is summed over DP x CP, in one all-reduce
// (Megatron stacks its routers' tokens per expert for the expert bias): each MoE layer's routed
// tokens and, with quantile balancing, the mean of its bias estimates. Then the expert-bias
// update (_update_router_expert_bias), quantile balancing's EMA of the DP mean
// (_update_router_qb_beta) and the global aux loss's restart. Returns the iteration's expert
// load, summed over this stage's MoE layers: the busiest expert's tokens against the mean, and
// the busiest EP rank's (its local experts' tokens) against the mean.
Trainer::ExpertLoad Trainer::update_routers() {
  trace::Scope scope(trace::Track::compute, "router update");
  const std::vector<MoELayer*> layers = moe_layers();
  if (layers.empty()) return {};
  const MoESpec& spec = *job_.model.moe;
  const auto e = static_cast<std::size_t>(spec.num_experts);
  std::vector<float> counts, qb_means;
  for (MoELayer* l : layers) {
    std::vector<float>& routed = l->router.routed_tokens;
    counts.insert(counts.end(), routed.begin(), routed.end());
    routed.assign(e, 0.f);
    if (spec.quantile_balancing) {
      const std::vector<float> m = l->router.qb_local_mean();
      qb_means.insert(qb_means.end(), m.begin(), m.end());
    }
  }
  const std::size_t n_counts = counts.size();
  counts.insert(counts.end(), qb_means.begin(), qb_means.end());
  Communicator& dp_group = groups_.get(GroupKind::dp_cp);
  if (dp_group.size() > 1)
    stream_.run([&] { dp_group.allreduce(counts.data(), static_cast<std::int64_t>(counts.size()), DType::F32); },
                "router counts");
  const auto per_rank = e / static_cast<std::size_t>(job_.layout.ep);
  ExpertLoad load;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const float* c = counts.data() + i * e;
    if (spec.expert_bias) layers[i]->router.update_expert_bias(c);
    if (spec.quantile_balancing) {
      float* m = counts.data() + n_counts + i * e;
      for (std::size_t j = 0; j < e; ++j) m[j] /= static_cast<float>(dp_group.size());
      layers[i]->router.update_qb_beta(m);
    }
    layers[i]->router.reset_global_aux_loss();
    load.expert += busiest_over_mean({c, e}, 1);
    load.ep_rank += busiest_over_mean({c, e}, per_rank);
  }
  return load;
}

// Megatron's finalize_model_grads and clipping: gradients summed over DP (experts over EDP) and
// scaled by 1 / DP, then the shared embedding's over the stages that hold it. Returns the gradient
// norms before clipping, over every stage's weights: [0] all of them, or with mtp_detach_heads all
// but the MTP layers', and [1] those, clipped by their own norm (Megatron's grad_norm_group).
std::array<double, 2> Trainer::finalize_gradients() {
  Communicator& dp_group = groups_.get(GroupKind::dp_cp);
  Communicator& expert_mp = groups_.get(GroupKind::tp_ep);
  Communicator& edp_group = groups_.get(GroupKind::edp);
  // The norm over every weight once: each rank's own experts (summed over EP); with the
  // distributed optimizer each rank holds only its shard of the rest, summed over DP and EDP.
  // Each sum carries one value per norm group (two on every rank where any has the MTP's).
  const int norm_groups = job_.model.mtp_detached ? 2 : 1;
  const auto as_float = [](const std::array<double, 2>& v) { return std::array<float, 2>{static_cast<float>(v[0]), static_cast<float>(v[1])}; };
  // Each gradient's sum of squares as soon as it is final, while the last buckets are in flight
  // (the same sums in the same order as after them: the same bits); the shared embedding's
  // changes after the buckets. The experts' EP sum starts once they are all in, on the token
  // stream (idle now), unless it must follow an EDP sum on the gradient stream.
  std::unordered_map<const Param*, double> squares;
  const Param* later = embedding_stages_ ? shared_embedding_ : nullptr;
  const bool ep_early = !(job_.grad_reduce.distributed && edp_group.size() > 1);
  std::size_t experts_in = 0;
  // Shared with the EP sum's task, which an exception here may leave in flight.
  const auto expert_sq_held = std::make_shared<std::array<float, 2>>();
  std::array<float, 2>& expert_sq = *expert_sq_held;
  CommEvent ep_sum;
  bool ep_started = false;
  const auto sum_experts = [&] {  // their squares, over EDP where it must come first, then over EP in the background
    expert_sq = as_float(grad_sums_of_squares(experts_, mtp_norm_group_, squares));
    if (!ep_early) grad_stream_.run([&] { edp_group.allreduce(expert_sq.data(), norm_groups, DType::F32); }, "grad norm (EDP)");
    if (expert_mp.size() > 1)
      ep_sum = stream_.submit([sq = expert_sq_held, &expert_mp, norm_groups] { expert_mp.allreduce(sq->data(), norm_groups, DType::F32); },
                              "grad norm (EP)");
    ep_started = true;
  };
  {
    trace::Scope scope(trace::Track::compute, "gradient buckets out");
    reducer_.finish(1.f / static_cast<float>(job_.layout.dp), [&](const std::vector<Param*>& final) {
      for (const Param* p : final) {
        if (p != later) squares.emplace(p, grad_sum_of_squares(p));
        experts_in += p->expert;
      }
      if (ep_early && !ep_started && experts_in == experts_.size()) sum_experts();
    });
  }
  if (embedding_stages_) reducer_.sum_shared_embedding(*embedding_stages_);
  trace::Scope scope(trace::Track::compute, "grad norm");
  std::array<double, 2> dense_sq = grad_sums_of_squares(dense_, mtp_norm_group_, squares);
  if (job_.grad_reduce.distributed) {
    std::array<float, 2> shard_sq = as_float(dense_sq);
    if (dp_group.size() > 1) grad_stream_.run([&] { dp_group.allreduce(shard_sq.data(), norm_groups, DType::F32); }, "grad norm (DP)");
    dense_sq = {shard_sq[0], shard_sq[1]};
  }
  if (!ep_started) sum_experts();
  ep_sum.wait();
  std::array<double, 2> sq{dense_sq[0] + expert_sq[0], dense_sq[1] + expert_sq[1]};
  if (Communicator& pp_group = groups_.get(GroupKind::pp); pp_group.size() > 1) {  // each stage's weights
    std::array<float, 2> stage_sq = as_float(sq);
    stream_.run([&] { pp_group.allreduce(stage_sq.data(), norm_groups, DType::F32); }, "grad norm (PP)");
    sq = {stage_sq[0], stage_sq[1]};
  }
  const std::array<double, 2> norm{std::sqrt(sq[0]), std::sqrt(sq[1])};
  const double clip = cfg_.optimizer.clip_grad;
  for (int group = 0; group < norm_groups; ++group) {
    if (!(clip > 0 && norm[group] > clip)) continue;
    const float c = static_cast<float>(clip / (norm[group] + 1e-6));
    for (Param* p : params_) {
      if (static_cast<int>(mtp_norm_group_.count(p)) != group) continue;
      float* g = p->grad.data<float>();
      const std::int64_t n = p->grad.numel();
      for (std::int64_t i = 0; i < n; ++i) g[i] *= c;
    }
  }
  return norm;
}

IterationLog Trainer::train_step(int it) {
  const Clock::time_point t0 = Clock::now();
  const std::int64_t gbs = job_.global_batch, mbs = job_.model.micro_batch, micro_batches = job_.micro_batches;
  for (auto& c : chunks_) c->zero_grad();
  reducer_.start(static_cast<int>(micro_batches));
  // lm loss, each aux loss, z-loss (summed over micro-batches), this stage's expert and EP-rank
  // loads (summed over its layers)
  double sums[4 + kAuxLosses.size()] = {};
  const auto micro_batch = [&](int j, Tensor& tokens, Tensor& targets) {
    data_.micro_batch((it - 1) * gbs + dp_rank_ * micro_batches * mbs + j * mbs, mbs, tokens, targets);
  };
  std::vector<MicroBatchLosses> losses;
  if (job_.pipeline.stages == 1) {
    losses = forward_backward(*chunks_.front(), static_cast<int>(micro_batches), micro_batch, job_.schedule);
  } else {
    std::vector<GPTModel*> chunks;
    for (auto& c : chunks_) chunks.push_back(c.get());
    losses = forward_backward_pipelining(chunks, groups_.get(GroupKind::pp), job_.pipeline, static_cast<int>(micro_batches),
                                         micro_batch, job_.schedule, &pipeline_timing_);
  }
  std::vector<double> mtp_sums(static_cast<std::size_t>(job_.model.mtp_layers), 0.0);  // over micro-batches
  for (const MicroBatchLosses& l : losses) {
    for (std::size_t k = 0; k < l.mtp_losses.size(); ++k) mtp_sums[k] += l.mtp_losses[k];
    sums[0] += l.lm_loss;
    for (std::size_t k = 0; k < kAuxLosses.size(); ++k) sums[k + 1] += l.aux_losses[k];
    sums[1 + kAuxLosses.size()] += l.z_loss;
  }
  std::array<double, 2> grad_norms{};
  {
    trace::Scope scope(trace::Track::compute, "optimizer step");
    grad_norms = finalize_gradients();
    const ExpertLoad load = update_routers();
    sums[std::size(sums) - 2] = load.expert;
    sums[std::size(sums) - 1] = load.ep_rank;
    // Every weight the last step gathered is in place before Adam writes this step's (the
    // forward needed each group, so this only waits where one was not).
    reducer_.finish_param_gathers();
    { trace::Scope s(trace::Track::compute, "adam"); adam_.step(job_.lr.at(it - 1)); }
    if (job_.grad_reduce.distributed) reducer_.gather_params(job_.grad_reduce.overlap_param_gather);
  }
  float reduced[std::size(sums)];
  for (std::size_t i = 0; i < std::size(reduced); ++i) reduced[i] = static_cast<float>(sums[i]);
  world_.allreduce(reduced, std::size(reduced), DType::F32);
  std::vector<float> mtp(mtp_sums.begin(), mtp_sums.end());
  if (!mtp.empty()) world_.allreduce(mtp.data(), static_cast<std::int64_t>(mtp.size()), DType::F32);
  const double step_s = seconds(Clock::now() - t0);

  IterationLog log;
  log.iteration = it;
  log.consumed_samples = it * gbs;
  log.step_s = step_s;
  log.tflops_per_rank = flops_per_iteration_ / step_s / world_.size() / 1e12;
  log.lr = job_.lr.at(it);  // as Megatron logs it: after the scheduler's step, the next iteration's
  // Every stage's ranks hold one replica's worth: the LM loss on the last stage, each stage its
  // own layers' share of the load-balancing loss.
  const double replicas = static_cast<double>(world_.size() / job_.pipeline.stages);
  log.lm_loss = reduced[0] / (static_cast<double>(micro_batches) * replicas);
  for (float sum : mtp) log.mtp_losses.push_back(sum / (static_cast<double>(micro_batches) * replicas));
  // As Megatron's MoE metrics tracker logs them: each loss without its coefficient, the mean over
  // the MoE layers (the schedule's losses already are) and the micro-batches; summed over TP x DP
  // x CP for the global aux loss (whose tokens are all of them), else averaged over DP. The names
  // are training.py's: a load-balancing type holding the loss's type ("aux_loss" is in the string
  // "seq_aux_loss", not in the list ["seq_aux_loss"]), shown at 0 where nothing was recorded; the
  // z-loss wherever moe_z_loss_coeff is set (0 / 0 at a coefficient of 0, as Megatron's, which its
  // log then leaves out).
  if (job_.model.num_moe_layers() > 0) {
    const MoESpec& moe = *job_.model.moe;
    for (AuxLoss k : kAuxLosses) {
      if (!tracks_loss(cfg_.model.moe_router_load_balancing_type, aux_loss_type(k))) continue;
      const double coeff = at(moe.aux_loss_coeff, k);
      const double scale = static_cast<double>(micro_batches) * (k == AuxLoss::global_aux_loss ? 1 : replicas);
      log.moe_losses.emplace_back(aux_loss_log_name(k), coeff > 0 ? reduced[1 + static_cast<std::size_t>(k)] / scale / coeff : 0);
    }
    if (cfg_.model.moe_z_loss_coeff)
      log.moe_losses.emplace_back("z_loss", reduced[1 + kAuxLosses.size()] / (static_cast<double>(micro_batches) * replicas) /
                                                *cfg_.model.moe_z_loss_coeff);
    log.expert_load = reduced[std::size(reduced) - 2] / (replicas * job_.model.num_moe_loss_layers());
    log.ep_rank_load = reduced[std::size(reduced) - 1] / (replicas * job_.model.num_moe_loss_layers());
  }
  log.grad_norm = grad_norms[0];
  if (job_.model.mtp_detached) log.mtp_grad_norm = grad_norms[1];
  const MemoryStats mem = memory_stats();
  log.mem_allocated = mem.allocated_bytes;
  log.mem_max_allocated = mem.max_allocated_bytes;
  return log;
}

// Megatron's training_log lines (the last rank prints the iteration line, rank 0 the harness's
// step-time and memory lines), and the progress bar.
void Trainer::training_log(const IterationLog& log) const {
  const int rank = world_.rank(), it = log.iteration;
  const std::int64_t iters = job_.iterations;
  if (options_.log && rank == world_.size() - 1)
    out_ << fmt::format(" [{}] iteration {:8d}/{:8d} | consumed samples: {:12d} | elapsed time per iteration (ms): {:.1f} | "
                        "throughput per GPU (TFLOP/s/GPU): {:.3f} | learning rate: {:.6E} | global batch size: {:5d} | "
                        "lm loss: {:.6E} |{} loss scale: 1.0 | grad norm: {:.3f} | number of skipped iterations:   0 | "
                        "number of nan iterations: {:3d} |\n",
                        timestamp(), it, iters, log.consumed_samples, log.step_s * 1e3, log.tflops_per_rank, log.lr,
                        job_.global_batch, python_nan(log.lm_loss),
                        moe_losses_text(log),
                        python_nan(log.grad_norm), std::isfinite(log.lm_loss) ? 0 : 1)
         << std::flush;
  if (options_.log && rank == 0)
    out_ << fmt::format("Step Time : {:.2f}s GPU utilization: {:.1f}MODEL_TFLOP/s/GPU\n"
                        "[Rank 0] (after {} iterations) memory (GB) | mem-allocated-gigabytes: {:.5g} | "
                        "mem-max-allocated-gigabytes: {:.5g}\n",
                        log.step_s, log.tflops_per_rank, it, static_cast<double>(log.mem_allocated) / 1e9,
                        static_cast<double>(log.mem_max_allocated) / 1e9)
         << std::flush;
  if (options_.progress_bar && rank == 0) {
    const int width = 30, done = static_cast<int>(width * it / iters);
    std::cerr << fmt::format("\r[{}{}] {}/{}", std::string(static_cast<std::size_t>(done), '#'),
                             std::string(static_cast<std::size_t>(width - done), ' '), it, iters)
              << (it == iters ? "\n" : "") << std::flush;
  }
}

// The steady-state figures, the trace, and the summary lines.
// Every rank's steady-state pipeline timing, averaged per stage (collective).
PipelineStats Trainer::pipeline_stats(const PipelineTiming& timing, int iterations) {
  const int ranks = world_.size(), stages = job_.pipeline.stages;
  std::vector<float> all(static_cast<std::size_t>(2 * ranks), 0.f);
  all[static_cast<std::size_t>(2 * world_.rank())] = static_cast<float>(timing.schedule_s / iterations);
  all[static_cast<std::size_t>(2 * world_.rank() + 1)] = static_cast<float>(timing.wait_s / iterations);
  world_.allreduce(all.data(), static_cast<std::int64_t>(all.size()), DType::F32);
  PipelineStats p{.stages = stages, .chunks = job_.pipeline.chunks, .micro_batches = static_cast<int>(job_.micro_batches),
                  .ideal_bubble = static_cast<double>(stages - 1) / (job_.pipeline.chunks * job_.micro_batches),
                  .schedule_s = std::vector<double>(static_cast<std::size_t>(stages), 0.0),
                  .wait_s = std::vector<double>(static_cast<std::size_t>(stages), 0.0)};
  const double per_stage = static_cast<double>(ranks / stages);
  for (int r = 0; r < ranks; ++r) {
    const auto s = static_cast<std::size_t>(job_.layout.rank_in(GroupKind::pp, r));
    p.schedule_s[s] += all[static_cast<std::size_t>(2 * r)] / per_stage;
    p.wait_s[s] += all[static_cast<std::size_t>(2 * r + 1)] / per_stage;
  }
  return p;
}

void Trainer::summarize(TrainResult& result, trace::Clock::time_point origin, const SteadyState& steady) {
  double total = 0, load = 0, ep_rank_load = 0;
  for (const IterationLog& l : result.iterations)
    if (l.iteration >= result.steady_first && l.iteration <= result.steady_last) {
      total += l.step_s;
      load += l.expert_load;
      ep_rank_load += l.ep_rank_load;
    }
  const int n = result.steady_last - result.steady_first + 1;
  result.mean_step_s = total / n;
  result.expert_load = load / n;
  result.ep_rank_load = ep_rank_load / n;
  result.tflops_per_rank = flops_per_iteration_ / result.mean_step_s / world_.size() / 1e12;
  result.peak_memory_bytes = max_over(world_, memory_stats().max_allocated_bytes);
  result.final_loss = result.iterations.back().lm_loss;
  if (job_.pipeline.stages > 1)
    result.pipeline = pipeline_stats(steady.pipeline, n);
  result.comm_in_flight_s = steady.stream.busy_s + steady.grad_stream.busy_s;
  result.comm_thread_cpu_s = steady.stream.cpu_s + steady.grad_stream.cpu_s;
  result.process_cpu_s = steady.cpu_s;
  result.cores_per_rank = cores_per_rank(world_);
  if (options_.trace_path) {
    result.traced = trace::summarize(steady.begin, steady.end);
    trace::enable(false);
    const std::vector<std::string> events = allgather_text(world_, trace::take_events_json(world_.rank(), origin));
    if (world_.rank() == 0) trace::write(*options_.trace_path, events);
  }
  if (!options_.log || world_.rank() != 0) return;
  out_ << fmt::format(
      "epx run summary ({} ranks, {})\n"
      "  steady-state step time: {:.3f} s (mean of iterations {}..{})\n"
      "  throughput: {:.4f} TFLOP/s per rank ({:.3g} model FLOPs per iteration)\n"
      "  peak memory: {:.4f} GB = {:.4f} GiB (mem-max-allocated, max over ranks)\n"
      "  final lm loss: {:.6f} (iteration {}){}\n{}"
      "  communication streams (rank 0, summed): {:.3f} s in flight over the steady state ({:.3f} s of CPU){}\n{}{}"
      "  CPU time (rank 0, all its threads): {:.3f} s per iteration, {:.0f}% of its {:.3g} core(s) busy on average\n",
      world_.size(), result.layout, result.mean_step_s, result.steady_first, result.steady_last,
      result.tflops_per_rank, flops_per_iteration_, static_cast<double>(result.peak_memory_bytes) / 1e9,
      static_cast<double>(result.peak_memory_bytes) / 1073741824.0,
      python_nan(result.final_loss), job_.iterations,
      std::isfinite(result.final_loss) ? ""
                                       : "; the training diverged (rerun_state_machine.check_for_nan_in_loss is off)",
      result.expert_load > 0
          ? fmt::format("  expert load: the busiest expert routes {:.3f}x the mean tokens{} (mean over the MoE layers and "
                        "iterations {}..{})\n",
                        result.expert_load,
                        job_.layout.ep > 1 ? fmt::format(", the busiest EP rank's experts {:.3f}x", result.ep_rank_load) : "",
                        result.steady_first, result.steady_last)
          : "",
      result.comm_in_flight_s, result.comm_thread_cpu_s,
      result.traced ? fmt::format("; {:.3f} s of communication exposed (with the compute thread's wait on token counts)",
                                  result.traced->exposed_comm_s)
                    : "",
      result.traced && result.traced->token_exchange_s > 0 && job_.layout.ep * job_.layout.etp > 1  // EP 1: local
          ? fmt::format("  token exchanges (dispatch, combine, their backward, the wait on token counts; rank 0): {:.3f} s in flight, "
                        "{:.3f} s exposed ({:.0f}% hidden)\n",
                        result.traced->token_exchange_s, result.traced->token_exchange_exposed_s,
                        100 * (1 - result.traced->token_exchange_exposed_s / result.traced->token_exchange_s))
          : "",
      result.traced && result.traced->dp_reduce_s > 0
          ? fmt::format("  DP gradient reduction (rank 0): {:.3f} s in flight, {:.3f} s exposed ({:.0f}% hidden)\n",
                        result.traced->dp_reduce_s, result.traced->dp_reduce_exposed_s,
                        100 * (1 - result.traced->dp_reduce_exposed_s / result.traced->dp_reduce_s))
          : "",
      result.process_cpu_s / n, 100 * result.cpu_busy(), result.cores_per_rank);
  if (const auto& p = result.pipeline) {
    out_ << fmt::format("  pipeline {}, {} micro-batches: ideal bubble (PP-1)/({}m) = {:.1f}% of the compute\n",
                        job_.pipeline.describe(), p->micro_batches, p->chunks > 1 || job_.pipeline.interleaved ? "VPP x " : "",
                        100 * p->ideal_bubble);
    for (int s = 0; s < p->stages; ++s)
      out_ << fmt::format("    stage {}: {:.3f} s per iteration in the schedule, {:.3f} s of it waiting on the neighbouring "
                          "stages (bubble + exposed p2p: {:.1f}% of the compute)\n",
                          s, p->schedule_s[static_cast<std::size_t>(s)], p->wait_s[static_cast<std::size_t>(s)], 100 * p->bubble(s));
  }
  if (options_.trace_path) out_ << "wrote the trace to " << *options_.trace_path << "\n";
}

TrainResult Trainer::run() {
  const int iters = static_cast<int>(job_.iterations);
  TrainResult result;
  result.layout = job_.layout.describe();
  // A pipeline stage may hold no MoE layer: name the dispatcher of the first rank that has one.
  result.dispatcher = "none";
  const std::vector<MoELayer*> moe = moe_layers();
  for (const std::string& name : allgather_text(world_, moe.empty() ? "" : moe.front()->dispatcher().name()))
    if (!name.empty()) {
      result.dispatcher = name;
      break;
    }
  result.recompute = job_.model.recompute.describe();
  result.schedule = schedule_name();
  result.flops_per_iteration = flops_per_iteration_;
  result.steady_first = std::min(options_.steady_first, iters);
  result.steady_last = options_.steady_last > 0 ? std::min(options_.steady_last, iters) : iters;
  if (result.steady_first > result.steady_last) result.steady_first = 1;
  log_start(result);

  world_.barrier();
  const Clock::time_point origin = Clock::now();
  trace::enable(options_.trace_path.has_value());
  reset_peak_memory();
  SteadyState steady;
  steady.begin = origin;
  for (int it = 1; it <= iters; ++it) {
    if (it == result.steady_first) {
      stream_.reset_stats();
      grad_stream_.reset_stats();
      pipeline_timing_ = {};
      steady.begin = Clock::now();
      steady.cpu_begin_s = cpu_clock_seconds(CLOCK_PROCESS_CPUTIME_ID);
    }
    result.iterations.push_back(train_step(it));
    if (const double loss = result.iterations.back().lm_loss; !std::isfinite(loss) && job_.check_for_nan_in_loss) {
      // Megatron's loss check (pretrain_gpt.py's loss_func, check_for_nan_in_loss): fatal, before
      // the iteration's line. The loss is the world's sum, so every rank stops here.
      const auto last = std::find_if(result.iterations.rbegin() + 1, result.iterations.rend(),
                                     [](const IterationLog& l) { return std::isfinite(l.lm_loss); });
      throw TrainingDiverged(fmt::format(
          "iteration {}: the lm loss is {} ('found {} in local forward loss calculation', which stops a Megatron run "
          "by default: rerun_state_machine.check_for_nan_in_loss){}; the training diverged: lower optimizer.lr, keep "
          "optimizer.adam_eps above 0 (Adam divides by sqrt(v) + eps, 0/0 where a gradient is 0), or clip the "
          "gradients (optimizer.clip_grad); +rerun_state_machine.check_for_nan_in_loss=false runs on, as Bridge's "
          "performance recipes do",
          it, std::isnan(loss) ? "NaN" : "infinite", std::isnan(loss) ? "NaN" : "Inf",
          last == result.iterations.rend() ? std::string()
                                           : fmt::format("; the last finite one was {:.6E} at iteration {}",
                                                         last->lm_loss, last->iteration)));
    }
    if (it == result.steady_last) {
      steady.end = Clock::now();
      steady.cpu_s = cpu_clock_seconds(CLOCK_PROCESS_CPUTIME_ID) - steady.cpu_begin_s;
      steady.stream = stream_.stats();
      steady.grad_stream = grad_stream_.stats();
      steady.pipeline = pipeline_timing_;
    }
    training_log(result.iterations.back());
  }
  reducer_.finish_param_gathers();  // the last step's weights, gathered in the background
  check_shared_embedding();
  summarize(result, origin, steady);
  return result;
}

}  // namespace

double PipelineStats::bubble(int stage) const {
  const double wait = wait_s[static_cast<std::size_t>(stage)], busy = schedule_s[static_cast<std::size_t>(stage)] - wait;
  return busy > 0 ? wait / busy : 0;
}

nlohmann::json TrainResult::to_json() const {
  nlohmann::json its = nlohmann::json::array();
  for (const IterationLog& i : iterations) {
    its.push_back({{"iteration", i.iteration}, {"consumed_samples", i.consumed_samples}, {"step_time_s", i.step_s},
                   {"tflops_per_rank", i.tflops_per_rank}, {"learning_rate", i.lr}, {"lm_loss", i.lm_loss},
                   {"grad_norm", i.grad_norm}, {"mem_allocated_bytes", i.mem_allocated},
                   {"mem_max_allocated_bytes", i.mem_max_allocated}});
    for (const auto& [name, value] : i.moe_losses)
      if (value >= 0) its.back()[name] = value;
    for (std::size_t k = 0; k < i.mtp_losses.size(); ++k) its.back()[fmt::format("mtp_{}_loss", k + 1)] = i.mtp_losses[k];
    if (i.mtp_grad_norm) its.back()["mtp_grad_norm"] = *i.mtp_grad_norm;
    if (i.expert_load > 0) {
      its.back()["expert_load_max_over_mean"] = i.expert_load;
      its.back()["ep_rank_load_max_over_mean"] = i.ep_rank_load;
    }
  }
  nlohmann::json summary{{"steady_state_iterations", {steady_first, steady_last}},
                         {"mean_step_time_s", mean_step_s},
                         {"tflops_per_rank", tflops_per_rank},
                         {"model_flops_per_iteration", flops_per_iteration},
                         {"peak_memory_bytes", peak_memory_bytes},
                         {"final_lm_loss", final_loss},
                         {"expert_load_max_over_mean", expert_load},
                         {"ep_rank_load_max_over_mean", ep_rank_load},
                         {"comm_in_flight_s", comm_in_flight_s},
                         {"comm_thread_cpu_s", comm_thread_cpu_s},
                         {"process_cpu_s", process_cpu_s},
                         {"cores_per_rank", cores_per_rank},
                         {"layout", layout},
                         {"dispatcher", dispatcher},
                         {"schedule", schedule},
                         {"recompute", recompute}};
  if (traced) {
    summary["exposed_comm_s"] = traced->exposed_comm_s;
    summary["traced_comm_s"] = traced->comm_s;
    summary["token_exchange_s"] = traced->token_exchange_s;
    summary["exposed_token_exchange_s"] = traced->token_exchange_exposed_s;
    summary["dp_reduce_s"] = traced->dp_reduce_s;
    summary["exposed_dp_reduce_s"] = traced->dp_reduce_exposed_s;
  }
  if (pipeline) {
    nlohmann::json bubbles = nlohmann::json::array();
    for (int s = 0; s < pipeline->stages; ++s) bubbles.push_back(pipeline->bubble(s));
    summary["pipeline"] = {{"stages", pipeline->stages},
                           {"virtual_stages_per_stage", pipeline->chunks},
                           {"micro_batches", pipeline->micro_batches},
                           {"ideal_bubble", pipeline->ideal_bubble},
                           {"stage_schedule_s", pipeline->schedule_s},
                           {"stage_wait_s", pipeline->wait_s},
                           {"stage_bubble", bubbles}};
  }
  return {{"summary", summary}, {"iterations", its}};
}


TrainResult train(const Config& cfg, Communicator& world, const TrainOptions& options, std::ostream& out) {
  // Everything that can be wrong with the config is found while building the job's specs, on
  // every rank alike, before anything is computed.
  Trainer trainer(cfg, world, options, out);
  return trainer.run();
}

}  // namespace epx
