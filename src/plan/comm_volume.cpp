// Communication per step by link class. Token exchanges per dispatcher (megatron/core/
// transformer/moe/token_dispatcher.py): alltoall sends one copy per (token, routed expert);
// DeepEP one copy per (token, destination node) over the network, forwarded over NVLink to the
// destination ranks; HybridEP the same per NVLink domain (a GB200 NVL72 rack keeps it all on
// NVLink). Routing is taken as uniform (force-balanced benchmarks), so the expected number of
// distinct destinations comes from the hypergeometric draw of k experts out of E.
#include <algorithm>
#include <cmath>
#include <limits>
#include <set>

#include "epx/plan/plan.hpp"

namespace epx {
namespace {

// P(a token's k experts, drawn without replacement from E, miss a given block of `block`).
double miss(double experts, double block, double k) {
  double p = 1;
  for (int i = 0; i < static_cast<int>(k); ++i) p *= std::max(0.0, (experts - block - i) / (experts - i));
  return p;
}

}  // namespace

CommPlan plan_comm(const Config& c, const LayoutPlan& lp, const GpuInfo& gpu, Dispatcher dispatcher) {
  const ModelConfig& m = c.model;
  const ParallelLayout& l = lp.layout;
  const HardwareRates& hw = gpu.rates;
  const double nvl = std::max(1e-9, hw.nvlink_gb_s * hw.nvlink_efficiency) * 1e9;
  const double net = std::max(1e-9, hw.network_gb_s * hw.network_efficiency) * 1e9;
  // A group inside an NVLink domain (a node, or a GB200 / GB300 rack's segment) talks over
  // NVLink, else over the network.
  const auto leaves_nvlink = [&](GroupKind kind) {
    for (const GroupPlacement& g : lp.groups)
      if (g.kind == kind) return !g.within_nvlink;
    return false;
  };
  const auto link = [&](GroupKind kind) { return leaves_nvlink(kind) ? net : nvl; };
  const auto latency = [&](bool inter) { return (inter ? hw.network_latency_us : hw.nvlink_latency_us) * 1e-6; };
  CommPlan out;

  // Token exchanges: 4 per MoE layer and micro-batch (dispatch and combine, each way).
  const double tokens = static_cast<double>(m.seq_length) * static_cast<double>(c.train.micro_batch_size.value_or(1)) /
                        (l.cp * l.tp);
  const double row = static_cast<double>(m.hidden_size) * element_bytes(m);
  const PipelineStage stage = busiest_moe_stage(m, lp.split);
  const double moe_layers = stage.moe_layers, stage_layers = stage.layers;
  if (moe_layers > 0 && l.ep > 1) {
    const double E = static_cast<double>(*m.num_moe_experts), k = static_cast<double>(m.moe_router_topk), ep = l.ep;
    const double rows = routed_rows_per_token(m);  // alltoall sends the rows padded to capacity too
    // EP ranks that share NVLink: the EP group is EP*ETP consecutive ranks, ETP fastest. NCCL's
    // all-to-all and HybridEP use a whole NVLink domain (an NVL72 rack through multi-node
    // NVLink); DeepEP's NVLink stage is a node, the rest goes over RDMA.
    const int domain = dispatcher == Dispatcher::deepep ? std::min(lp.gpus_per_node, lp.nvlink_domain) : lp.nvlink_domain;
    const double local = std::clamp<double>(std::floor(domain / static_cast<double>(l.etp)), 1, ep);
    const double blocks = ep / local;
    double intra = 0, inter = 0;  // rows per token
    if (dispatcher == Dispatcher::alltoall) {
      intra = rows * (local - 1) / ep;
      inter = rows * (ep - local) / ep;
    } else {
      inter = (blocks - 1) * (1 - miss(E, E / blocks, k));                  // one copy per remote block
      intra = (ep - 1) * (1 - miss(E, E / ep, k));                          // then one per destination rank
    }
    // Expert tensor parallelism: the received rows are all-gathered over ETP on dispatch and
    // reduce-scattered on combine, inside the node (ETP is the fastest-varying expert rank).
    intra += rows * (l.etp - 1.0);
    out.token_intra = 4 * moe_layers * tokens * intra * row;
    out.token_inter = 4 * moe_layers * tokens * inter * row;
    // Each exchange also pays a fixed cost: 5 per MoE layer and micro-batch, the 4 and the
    // token counts exchanged before the dispatch.
    out.token_exchange_s = std::max(out.token_inter / net, out.token_intra / nvl) +
                           5 * moe_layers * latency(leaves_nvlink(GroupKind::ep));
  }

  // Gradient reduction over DP (dense) and EDP (experts) in the weights' dtype (FP32 with
  // ddp.grad_reduce_in_fp32), and with the distributed optimizer the parameter all-gather back:
  // ring volumes 2(d-1)/d of the bytes for an all-reduce, (d-1)/d for a reduce-scatter or an
  // all-gather.
  const bool distributed = c.ddp.use_distributed_optimizer;
  const auto grads = [&](double params, double d) {
    if (d <= 1) return 0.0;
    const double grad = c.ddp.grad_reduce_in_fp32 ? 4 : element_bytes(m);
    return (distributed ? 1 : 2) * (d - 1) / d * params * grad;
  };
  // The weights go back in their compute dtype (epx's runtime too; its FP32 norms and router
  // are a rounding error of the bytes).
  const auto gather = [&](double params, double d) { return distributed && d > 1 ? (d - 1) / d * params * element_bytes(m) : 0.0; };
  const auto reduce = [&](double params, double d) { return grads(params, d) + gather(params, d); };
  const double dp = l.dp * l.cp;
  // The step's two small all-reduces over the world (the grad norm and the logged loss).
  out.step_allreduces_s = (l.world > 1 ? 2 : 0) * latency(leaves_nvlink(GroupKind::dp_cp) || leaves_nvlink(GroupKind::edp) || lp.nodes > 1);
  // The first stage's weights in the order its backward completes them (the embedding last).
  const std::vector<GradGroup> groups = first_stage_grad_groups(c, lp);
  if (c.ddp.reduce_embedding_rows && dp > 1) {
    const double rate = link(GroupKind::dp_cp);
    const double rows = static_cast<double>(m.seq_length) * static_cast<double>(c.train.micro_batch_size.value_or(1)) / l.cp;
    out.embedding_rows_s = (dp - 1) * rows * (static_cast<double>(m.hidden_size) / l.tp * element_bytes(m) + 8) / rate +
                           2 * latency(leaves_nvlink(GroupKind::dp_cp));
  }

  // Megatron's buckets (param_and_grad_buffer.py), per kind (experts in the dense buffer where EP
  // is 1 and ETP is TP), in the order the backward completes the weights: a bucket closes once it
  // holds bucket_size elements (default max(40M, 1M x DP x CP)) at any weight, taken here as fluid
  // within a layer's half; the embedding is one weight, and its bucket is the last. Each model
  // chunk has a DDP of its own, whose buckets end with it; only the first chunk is bucketed, and
  // under VPP a chunk's buckets start together after its last backward (Megatron's
  // align_grad_reduce, its default; schedules.py grad_sync_func). epx's runtime (cpu) closes a
  // bucket after a whole weight group (a layer) and starts each as it completes. Without
  // overlap_grad_reduce, one bucket per kind. The rows split's table is a bucket of its own,
  // complete before the last micro-batch; its rows are reduced after the backward.
  const bool experts_apart = l.ep > 1 || l.etp != l.tp;
  if (c.ddp.overlap_grad_reduce || (distributed && c.ddp.overlap_param_gather)) {
    constexpr double kWhole = std::numeric_limits<double>::infinity();
    const double size = !c.ddp.overlap_grad_reduce ? kWhole
                        : c.ddp.bucket_size        ? static_cast<double>(*c.ddp.bucket_size)
                                                   : std::max(40e6, 1e6 * dp);
    const bool cuda = gpu.cuda(), aligned = cuda && lp.split.chunks > 1;
    const bool rows = c.ddp.reduce_embedding_rows && dp > 1 && micro_batches_per_dp_rank(c, l) >= 2;
    for (const bool expert : {false, true}) {
      const double d = expert ? l.edp : dp;
      const GroupKind kind = expert ? GroupKind::edp : GroupKind::dp_cp;
      if (d <= 1 || (expert && !experts_apart)) continue;
      int needed = -1;  // the bucket the next forward waits for first
      const auto add = [&](double params, double ready, int chunk) {
        needed = static_cast<int>(out.first_stage_buckets.size());
        out.first_stage_buckets.push_back(
            {ready, grads(params, d) / link(kind) + latency(leaves_nvlink(kind)), gather(params, d) / link(kind), chunk});
      };
      double held = 0, ready = 0;
      int chunk = -1;
      for (const GradGroup& g : groups) {
        const double params = expert ? g.expert : g.dense + (experts_apart ? 0 : g.expert);
        if (params <= 0) continue;
        // epx's runtime keeps one bucket across the chunks without overlap_grad_reduce.
        if (g.chunk != chunk && held > 0 && (cuda || size < kWhole)) add(held, ready, chunk), held = 0;
        chunk = g.chunk;
        if (rows && g.embedding) {
          if (held > 0) add(held, ready, chunk), held = 0;
          add(params, CommPlan::kBeforeLastMicroBatch, chunk);
          out.first_stage_buckets.push_back({1, out.embedding_rows_s, 0, chunk});
          continue;
        }
        ready = aligned && g.chunk == 0 ? 1 : g.done;
        const double limit = cuda && g.chunk > 0 ? kWhole : size;
        held += params;
        if (g.embedding || (!cuda && held >= limit)) {
          add(held, ready, chunk), held = 0;
        } else if (held >= limit) {  // the full buckets, sent together; the rest stays open
          const double full = std::floor(held / limit) * limit;
          add(full, ready, chunk);
          held -= full;
        }
      }
      if (held > 0) add(held, ready, chunk);
      if (needed >= 0) out.first_stage_buckets[static_cast<std::size_t>(needed)].first_needed = true;
    }
    std::stable_sort(out.first_stage_buckets.begin(), out.first_stage_buckets.end(),
                     [](const CommPlan::Bucket& a, const CommPlan::Bucket& b) { return a.ready < b.ready; });
  }
  // Each stage's reduction as one bucket (Megatron buckets only the first stage) and its all-gather.
  const double vocabulary = embedding_rows(c);
  for (int k = 0; k < l.pp; ++k) {
    const StageParams stage = stage_params(c, lp, k, vocabulary);
    const double dense = stage.dense + (experts_apart ? 0 : stage.expert), expert = experts_apart ? stage.expert : 0;
    out.stage_reduce_s.push_back(grads(dense, dp) / link(GroupKind::dp_cp) + grads(expert, l.edp) / link(GroupKind::edp) +
                                 (dp > 1) * latency(leaves_nvlink(GroupKind::dp_cp)) +
                                 (expert > 0 && l.edp > 1) * latency(leaves_nvlink(GroupKind::edp)));
    out.stage_gather_s.push_back(gather(dense, dp) / link(GroupKind::dp_cp) + gather(expert, l.edp) / link(GroupKind::edp));
  }

  // TP: sequence-parallel all-gather and reduce-scatter around attention and MLP, forward and
  // backward (8 per layer, (TP-1)/TP of s*b*h each); CP: K and V gathered per layer, each way.
  const double sbh = static_cast<double>(m.seq_length) * static_cast<double>(c.train.micro_batch_size.value_or(1)) * row;
  if (l.tp > 1) out.tp_cp_s += 8 * stage_layers * sbh / l.cp * (l.tp - 1) / l.tp / link(GroupKind::tp);
  if (l.cp > 1) out.tp_cp_s += 4 * stage_layers * sbh / l.tp * (l.cp - 1) / l.cp / link(GroupKind::cp);
  // Megatron's _allreduce_word_embedding_grads: the whole main_grad in its dtype, over the
  // stages that hold the embedding or a copy (get_embedding_ranks: the first, the last where
  // tied, the MTP layers'); a ring all-reduce over k of them sends 2 (k - 1) / k of it.
  std::set<int> holders{0};
  if (m.share_embeddings_and_output_weights) holders.insert(static_cast<int>(l.pp) - 1);
  if (m.mtp_num_layers.value_or(0) > 0) holders.insert(lp.split.stage_of(lp.split.mtp_stage));
  if (const auto k = static_cast<double>(holders.size()); k > 1) {
    const double grad = c.ddp.grad_reduce_in_fp32 ? 4 : element_bytes(m);
    out.embedding_stages_s = 2 * (k - 1) / k * static_cast<double>(padded_vocab_size(m)) * static_cast<double>(m.hidden_size) /
                                 l.tp * grad / link(GroupKind::pp) +
                             latency(leaves_nvlink(GroupKind::pp));
  }
  // PP: one activation forward and one gradient back per micro-batch and model chunk boundary;
  // from a standalone MTP stage on, each carries the MTP depths' hidden states too (the stage
  // that sends the most).
  if (l.pp > 1) {
    const bool standalone_mtp = m.mtp_num_layers.value_or(0) > 0 && lp.split.mtp_stage != lp.split.loss_stage;
    double boundaries = 0;
    for (int p = 0; p < lp.split.stages; ++p) {
      double here = 0;
      for (int v = 0; v < lp.split.chunks; ++v)
        here += standalone_mtp && v * lp.split.stages + p >= lp.split.mtp_stage ? 1.0 + static_cast<double>(*m.mtp_num_layers) : 1.0;
      boundaries = std::max(boundaries, here);
    }
    out.pp_s = 2 * boundaries * sbh / (l.tp * l.cp) / link(GroupKind::pp);
  }
  return out;
}

}  // namespace epx
