// Memory per GPU on the most-loaded rank (each pipeline stage planned, the largest kept), after Megatron-LM's
// megatron/training/theoretical_memory_usage.py (weights and optimizer by parameter counts;
// activations by the "sequence parallel + selective recompute" per-layer formula, with the
// active expert width for MoE layers, as Megatron-Bridge's estimate does), plus what both leave
// out: the routed inputs the experts keep for their wgrad, dispatcher buffers, and a runtime
// term for the allocator's transient peak.
#include <algorithm>
#include <cmath>

#include "epx/base/to_lower.hpp"
#include "epx/check/check.hpp"
#include "epx/plan/plan.hpp"

namespace epx {
namespace {

// Per-layer parameter counts. `duplicated`: attention weights every TP rank holds whole (MLA's
// down-projections, TELinear with parallel_mode "duplicated" in multi_latent_attention.py).
struct LayerParams {
  double attention = 0, duplicated = 0, dense_mlp = 0, router = 0, experts = 0, shared = 0;
};

// What attention keeps for its backward, in elements per token: `heads`, split over TP by
// heads, are Q, K, V and the core attention's output (Megatron's formula counts 4h, MHA's);
// `latent` are MLA's compressed q and kv and their norms' inputs, from its duplicated
// down-projections: split over TP by sequence parallelism alone, as the norms are; `rope`, its
// shared rotary key, gathered whole on every TP rank. `mla_up_proj` recompute drops Q, K and V,
// and the normalised latents: Megatron's checkpoint keeps the down projections' outputs and reruns
// the norms (fused into the up projections' TE layernorm-linear) with them.
struct AttentionSaved {
  double heads = 0, latent = 0, rope = 0;
};
AttentionSaved attention_saved(const ModelConfig& m, bool up_proj_recomputed) {
  const double n = static_cast<double>(m.num_attention_heads);
  if (m.multi_latent_attention) {
    const double qk = n * static_cast<double>(m.qk_head_dim + m.qk_pos_emb_head_dim), v = n * static_cast<double>(m.v_head_dim);
    const double r = static_cast<double>(m.q_lora_rank.value_or(0) + m.kv_lora_rank);
    return {up_proj_recomputed ? v : 2 * qk + 2 * v, up_proj_recomputed ? r : 2 * r,
            static_cast<double>(m.qk_pos_emb_head_dim)};
  }
  const double d = static_cast<double>(m.kv_channels.value_or(m.hidden_size / std::max<Int>(1, m.num_attention_heads)));
  const double q = d * n, kv = d * static_cast<double>(m.num_query_groups.value_or(m.num_attention_heads));
  return {2 * q + 2 * kv, 0};
}

LayerParams layer_params(const ModelConfig& m) {
  const double h = static_cast<double>(m.hidden_size), gated = m.gated_linear_unit ? 3 : 2;
  LayerParams p;
  p.attention = attention_macs(m).linear;  // each projection weight is used once per token
  if (m.multi_latent_attention) {
    p.duplicated = h * static_cast<double>(m.q_lora_rank.value_or(0) + m.kv_lora_rank + m.qk_pos_emb_head_dim);
    p.attention -= p.duplicated;
  }
  p.dense_mlp = gated * h * static_cast<double>(m.ffn_hidden_size.value_or(0));
  if (m.num_moe_experts) {
    const double e = static_cast<double>(*m.num_moe_experts);
    p.router = e * h;
    // The shared expert's gate [1, H], replicated over TP as the router is.
    if (m.moe_shared_expert_gate && m.moe_shared_expert_intermediate_size.value_or(0) > 0) p.router += h;
    p.experts = e * gated * h * static_cast<double>(m.moe_ffn_hidden_size.value_or(m.ffn_hidden_size.value_or(0)));
    p.shared = gated * h * static_cast<double>(m.moe_shared_expert_intermediate_size.value_or(0));
  }
  return p;
}

}  // namespace

const char* to_string(Dispatcher d) {
  return d == Dispatcher::alltoall ? "alltoall" : d == Dispatcher::deepep ? "deepep" : "hybridep";
}

PipelineStage pipeline_stage(const ModelConfig& m, const PipelineSplit& split, int stage) {
  PipelineStage st;
  st.layers = 0;
  for (const auto& [first, end] : split.ranges_on(stage)) {
    st.layers += end - first;
    st.moe_layers += moe_layers_in(m, first, end);
    st.window_layers += window_layers_in(m, first, end);
  }
  // Megatron builds the embedding and the loss on the first chunk of the first stage and the last
  // of the last (pre_process / post_process), wherever a layout's E and L sit.
  st.first = stage == 0;
  st.last = stage == split.stages - 1;
  if (split.stage_of(split.mtp_stage) == stage) {
    // MTP layers sit after the last layer and count as MoE layers when it is one (as FLOPs do).
    st.mtp_layers = static_cast<double>(m.mtp_num_layers.value_or(0));
    st.moe_layers += mtp_moe_layers(m);
  }
  return st;
}

PipelineStage busiest_moe_stage(const ModelConfig& m, const PipelineSplit& split) {
  PipelineStage best = pipeline_stage(m, split, 0);
  for (int p = 1; p < split.stages; ++p) {
    const PipelineStage st = pipeline_stage(m, split, p);
    if (st.moe_layers > best.moe_layers) best = st;
  }
  return best;
}

// The embedding's rows: Bridge's setup pads the vocabulary only where it takes it from the
// tokenizer (tokenizer.use_tokenizer_vocab_size, as from-scratch recipes set it), and keeps a
// preset vocab_size as it is, as epx's configs have; its FLOPs formula pads it either way
// (flops.cpp).
double embedding_rows(const Config& c) {
  const YAML::Node from_tokenizer = c.extra_sections.child_map("tokenizer")["use_tokenizer_vocab_size"];
  const Int padded_vocab = padded_vocab_size(c.model);  // refuses a config without a vocabulary
  const bool padded = from_tokenizer.IsScalar() && to_lower(from_tokenizer.Scalar()) == "true";
  return static_cast<double>(padded ? padded_vocab : *c.model.vocab_size);
}

StageParams stage_params(const Config& c, const LayoutPlan& lp, int stage, double V) {
  const ModelConfig& m = c.model;
  const ParallelLayout& l = lp.layout;
  const double h = static_cast<double>(m.hidden_size), tp = l.tp;
  const PipelineStage st = pipeline_stage(m, lp.split, stage);
  const double moe_layers = st.moe_layers, mtp = st.mtp_layers;
  const LayerParams lay = layer_params(m);
  StageParams out;
  // TP-sharded blocks, the replicated router, experts over ETP x EP; the embedding on the first
  // stage, the output layer (or the tied embedding's copy) on the last, MTP's projection there
  // too. The MTP's stage keeps an embedding of its own (Megatron's mtp_process), and allocates
  // its output layer even when tied (the copy that it then leaves unused).
  // mtp_use_repeated_layer builds one MTP layer for every depth (its activations stay per depth).
  const double mtp_weights = m.mtp_use_repeated_layer ? std::min(mtp, 1.0) : mtp;
  const double moe_weights = moe_layers - (mtp > 0 && mtp_moe_layers(m) > 0 ? mtp - mtp_weights : 0);
  out.dense = ((st.layers + mtp_weights) * lay.attention + (st.layers + mtp_weights - moe_weights) * lay.dense_mlp +
               moe_weights * lay.shared + mtp_weights * 2 * h * h) / tp +
              (st.layers + mtp_weights) * lay.duplicated + moe_weights * lay.router;
  if (st.first) out.embedding = V * h / tp;
  out.mtp_embedding = st.mtp_layers > 0 && !st.first ? V * h / tp : 0;
  out.output = st.last && (!st.first || !m.share_embeddings_and_output_weights) ? V * h / tp : 0;
  out.dense += out.embedding + out.mtp_embedding + out.output;
  out.expert = moe_weights * lay.experts / (l.etp * l.ep);
  return out;
}

MemoryPlan plan_stage_memory(const Config& c, const LayoutPlan& lp, Dispatcher dispatcher, bool ep_overlap, int stage) {
  const ModelConfig& m = c.model;
  const ParallelLayout& l = lp.layout;
  const double h = static_cast<double>(m.hidden_size), V = embedding_rows(c);
  const double tp = l.tp, pp = l.pp, vpp = lp.split.chunks;
  const PipelineStage st = pipeline_stage(m, lp.split, stage);
  const double moe_layers = st.moe_layers, mtp = st.mtp_layers;
  const double dense_layers = st.layers + mtp - moe_layers;

  MemoryPlan out;
  const StageParams params = stage_params(c, lp, stage, V);
  out.dense_params = params.dense;
  out.expert_params = params.expert;
  out.embedding_params = params.embedding;

  // Bytes per parameter: the compute copy (BF16, or FP32 without bf16), the main grad, and the
  // FP32 master + Adam m and v, sharded over DP (dense) and EDP (experts) by the distributed
  // optimizer. Megatron's DDP keeps the main grads in the parameters' dtype unless
  // ddp.grad_reduce_in_fp32 (param_and_grad_buffer.py); epx's runtime always in FP32.
  const double weight_bytes = element_bytes(m);
  const double all_params = out.dense_params + out.expert_params;
  // Megatron builds any optimizer but adam and sgd on its emerging-optimizer path, which shards
  // the state only layer-wise (a dist_ name, or use_layer_wise_distributed_optimizer in a dump).
  const OptimizerConfig& o = c.optimizer;
  const std::string name = o.optimizer.starts_with("dist_") ? o.optimizer.substr(5) : o.optimizer;
  const YAML::Node layer_wise = c.extra_fields.child_map("optimizer")["use_layer_wise_distributed_optimizer"];
  const bool sharded = name == "adam" || name == "sgd"
                           ? c.ddp.use_distributed_optimizer
                           : o.optimizer.starts_with("dist_") || (layer_wise.IsScalar() && to_lower(layer_wise.Scalar()) == "true");
  out.optimizer_params = sharded ? out.dense_params / (l.dp * l.cp) + out.expert_params / l.edp : all_params;
  out.weights = weight_bytes * all_params;
  const bool fp32_grads = c.ddp.grad_reduce_in_fp32 || !target_gpu(c).cuda();
  out.gradients = (fp32_grads ? 4 : weight_bytes) * all_params;
  // Megatron's mixed-precision optimizers step on `main_grad.float()`: a copy of the shard's
  // BF16 grads, alive at the step (distrib_optimizer.py, optimizer.py).
  if (!fp32_grads && weight_bytes < 4) out.step_grads = 4 * out.optimizer_params;
  // The FP32 master and the optimizer's state: Adam's m and v; one momentum for SGD and Lion; for
  // Muon the matrices' momentum, with Adam for what Megatron excludes from Muon (the embedding and
  // the output layer; the norms are not counted).
  out.optimizer = 12 * out.optimizer_params;
  if (name == "sgd" || name == "lion") out.optimizer = 8 * out.optimizer_params;
  if (name == "muon" || name == "adaptive_muon") {
    const double adam_params = (params.embedding + params.mtp_embedding + params.output) / (sharded ? l.dp * l.cp : 1);
    out.optimizer = 12 * adam_params + 8 * (out.optimizer_params - adam_params);
  }
  if (o.use_precision_aware_optimizer) {
    // TE's FusedAdam keeps Adam's m and v in their dtypes. Megatron's distributed optimizer
    // hands it the grads in place and the masters as TE's (an FP32 master of a BF16 weight as its
    // 16 remainder bits) only where `use_precision_aware_optimizer_no_fp8_or_ds_fp8`: masters
    // not FP32, or the FP8 recipe none or delayed. The recipe is Bridge's mixed-precision
    // setting, copied onto the model and the optimizer alike (tensorwise even for bf16_mixed);
    // elsewhere the FP32 masters and the step's FP32 grad copy stay.
    const auto bytes = [](const std::string& dtype) { return dtype == "fp32" ? 4.0 : dtype == "fp8" ? 1.0 : 2.0; };
    const bool in_place = o.main_params_dtype != "fp32" || !m.fp8_recipe || *m.fp8_recipe == "delayed";
    // OptimizerConfig's post-init turns the remainders off below TE 2.1 (an unknown TE: a recent one).
    const std::string& te = c.target.te_version.value_or("");
    const bool remainders = o.store_param_remainders && (te.empty() || te == "none" || version_at_least(te, "2.1.0"));
    const double master = in_place && o.main_params_dtype == "fp32" && remainders && m.bf16 ? 2 : bytes(o.main_params_dtype);
    out.optimizer = (master + bytes(o.exp_avg_dtype) + bytes(o.exp_avg_sq_dtype)) * out.optimizer_params;
    if (in_place) out.step_grads = 0;
  }

  // Activations of one micro-batch per layer (bytes), sequence parallel over TP, split over CP:
  // Megatron's s*b*h*(18 + 4*F/h) with F the active MLP width (F_moe*k + F_shared for MoE layers)
  // and attention's own widths (below), plus the routed rows each expert keeps for its wgrad
  // (k*s*b*h BF16, ETP/TP of them per rank).
  const double s = static_cast<double>(m.seq_length) / l.cp, b = static_cast<double>(c.train.micro_batch_size.value_or(1));
  const double k = routed_rows_per_token(m);  // top-k, or the rows padded to capacity
  const double f_dense = static_cast<double>(m.ffn_hidden_size.value_or(0));
  const double f_moe = static_cast<double>(m.moe_ffn_hidden_size.value_or(m.ffn_hidden_size.value_or(0))) * k +
                       static_cast<double>(m.moe_shared_expert_intermediate_size.value_or(0));
  const bool full = m.recompute_granularity && *m.recompute_granularity == "full";
  const auto has = [&](const char* module) { return recomputes_module(m, module); };
  // Megatron's 18 s*b*h (BF16 bytes) are 10 for the norms, the GEMMs' inputs and the dropout
  // masks, and 8 for Q, K, V and the attention output at MHA's widths: those 8 come from the
  // model's own widths (GQA's narrower K and V, MLA's wider heads and its latents).
  // Without sequence parallelism (TP > 1) the 10 stay whole on every TP rank: Megatron's
  // compute_activation_memory_without_sp, s*b*h*(10 + 24/TP) at F = 4h.
  const AttentionSaved saved = attention_saved(m, has("mla_up_proj"));
  const bool sp = tp == 1 || m.sequence_parallel;
  const auto layer_bytes = [&](double f, bool moe) {
    double norms = 10 * s * b * h + 2 * s * b * saved.latent, mlp = 4 * s * b * f,
           routed = moe ? 2 * k * s * b * h * l.etp : 0;
    const double heads = 2 * s * b * saved.heads, rope = 2 * s * b * saved.rope;
    if (has("layernorm")) norms -= 4 * s * b * h;              // both norms' outputs recomputed
    if (moe && has("moe_act")) mlp /= 2;                       // the activation, from fc1's output
    if (!moe && has("mlp")) mlp = 0;                           // the whole MLP recomputed
    if (moe && has("moe")) mlp = routed = 0;                   // the whole MoE layer recomputed
    return (heads + mlp + routed) / tp + (sp ? norms / tp : norms) + rope;
  };
  const double per_layer_dense = layer_bytes(f_dense, false), per_layer_moe = layer_bytes(f_moe, true);
  const double stage_layers = st.layers + mtp;
  const double avg_layer = (dense_layers * per_layer_dense + moe_layers * per_layer_moe) / std::max(1.0, stage_layers);
  const double input_split = sp ? tp : 1;  // a layer's input, split by SP
  double one_micro_batch = dense_layers * per_layer_dense + moe_layers * per_layer_moe, rebuilt = 0;
  if (full) {  // each micro-batch's checkpoint inputs and whole layers; one group rebuilt at a time
    const FullRecompute r = full_recompute(m, st.layers, mtp, lp.split.chunks);
    one_micro_batch = r.kept_inputs * 2 * s * b * h / input_split + (stage_layers - r.recomputed) * avg_layer;
    rebuilt = r.rebuilt * avg_layer;
  }
  // Micro-batches in flight on stage p: 1F1B keeps PP - p (the first stage PP); interleaving
  // adds (PP-1)/(PP*VPP) of that (Megatron's first-stage factor), also at VPP = 1, which
  // Megatron-Core runs interleaved (a warm-up of 2 (PP - p - 1)); the merged EP-overlap schedule
  // holds a second micro-batch's layer while the first one's backward frees its layers.
  const double m_per_rank = std::max(1.0, micro_batches_per_dp_rank(c, l));
  const double warmup = std::min(pp - stage, m_per_rank);
  out.in_flight = l.pp == 1 ? 1 : lp.split.interleaved ? warmup * (1 + (pp - 1) / (pp * vpp)) : warmup;
  // Groups of N > PP micro-batches per chunk (microbatch_group_size_per_vp_stage) warm up
  // (VPP - 1) (N - PP) more forwards, each a chunk's share of a micro-batch.
  const double group = static_cast<double>(m.microbatch_group_size_per_vp_stage.value_or(l.pp));
  if (lp.split.interleaved && group > pp) out.in_flight += (vpp - 1) * (group - pp) / vpp;
  out.activations = one_micro_batch * out.in_flight + rebuilt + (ep_overlap ? avg_layer : 0);
  // Logits and the cross-entropy's FP32 copies on the last stage, once more for each MTP depth
  // (process_mtp_loss runs there, wherever the layout puts the MTP layers).
  if (st.last) out.logits = 4 * s * b * h * (1 + V / h) / tp * (1 + static_cast<double>(m.mtp_num_layers.value_or(0)));

  // Dispatcher buffers: alltoall allocates the receive buffers of one exchange (k copies of
  // each token, with 10% routing imbalance, there and back); DeepEP and HybridEP keep
  // preallocated buffers sized for the largest exchange (the same rows, one copy per
  // destination rank) plus their registered workspace (1 GiB NVLink + 1 GiB RDMA for DeepEP,
  // 0.5 GiB for HybridEP's fused buffers). Under EP overlap two exchanges are in flight at once
  // (one micro-batch's forward, another's backward), each with its rows.
  if (m.num_moe_experts && l.ep > 1) {
    const double rows = s * b * k * l.etp / tp * (ep_overlap ? 2 : 1);
    const bool gpu = target_gpu(c).cuda();  // epx's own runtime registers no workspace
    out.dispatcher_buffers = dispatcher == Dispatcher::alltoall ? 2 * 1.1 * rows * h * weight_bytes
                             : dispatcher == Dispatcher::deepep ? 2 * rows * h * weight_bytes + (gpu ? 2 * 1073741824.0 : 0)
                                                                : 2 * rows * h * weight_bytes + (gpu ? 536870912.0 : 0);
  }
  // The allocator's transient peak beyond what is held (optimizer-step temporaries, gradient
  // buckets, fragmentation): 5% of the rest, calibrated on the Qwen3-30B-A3B runs
  // (bench/RESULTS.md, "epx plan").
  out.other = 0.05 * (out.held() + out.transient());
  return out;
}

FullRecompute full_recompute(const ModelConfig& m, double layers, double mtp, int chunks) {
  const double per_chunk = layers / std::max(1, chunks), n = std::max<double>(1, static_cast<double>(m.recompute_num_layers.value_or(1)));
  if (m.recompute_method == std::optional<std::string>("block")) {  // over 0 layers: none
    const double r = std::clamp<double>(static_cast<double>(m.recompute_num_layers.value_or(1)), 0, per_chunk);
    return {r * chunks, r * chunks, r > 0 ? 1.0 : 0.0};
  }
  return {layers + mtp, std::ceil(per_chunk / n) * chunks + 2 * mtp, std::max(std::min(n, per_chunk), mtp > 0 ? 1.0 : 0.0)};
}

bool recomputes_module(const ModelConfig& m, std::string_view module) {
  if (m.recompute_granularity != std::optional<std::string>("selective")) return false;
  if (!m.recompute_modules) return module == "core_attn";
  return std::find(m.recompute_modules->begin(), m.recompute_modules->end(), module) != m.recompute_modules->end();
}

std::vector<GradGroup> first_stage_grad_groups(const Config& c, const LayoutPlan& lp) {
  const ModelConfig& m = c.model;
  const ParallelLayout& l = lp.layout;
  const PipelineSplit& split = lp.split;
  const LayerParams lay = layer_params(m);
  const double tp = l.tp, h = static_cast<double>(m.hidden_size), V = embedding_rows(c);
  const int mtp = split.stage_of(split.mtp_stage) == 0 ? static_cast<int>(m.mtp_num_layers.value_or(0)) : 0;
  const int mtp_chunk = split.mtp_stage / split.stages;
  const auto ranges = split.ranges_on(0);
  double layers = mtp;
  for (const auto& [first, end] : ranges) layers += end - first;
  // On a GPU (Megatron's DDP) a layer's MLP weights complete half way through its backward (the
  // share taken here), its attention's at the end; epx's runtime reports a whole layer, and the
  // head with the MTP layers as one group (GPTModel::grad_groups). Under VPP the layers of the
  // chunks after the first are spread over the same backward, where they ran earlier in the
  // cooldown: their buckets are timed late, not early.
  const bool halves = target_gpu(c).cuda();
  std::vector<GradGroup> out;
  const double output = split.stages == 1 && !m.share_embeddings_and_output_weights ? V * h / tp : 0;
  if (output > 0 || (!halves && mtp > 0)) out.push_back({output, 0, 0, mtp > 0 ? mtp_chunk : split.chunks - 1, false});
  double done = 0;
  const auto layer = [&](bool moe, double extra, bool weights, int chunk) {
    const double share = 1 / std::max(1.0, layers), w = weights ? 1 : 0;
    const double mlp = w * ((moe ? lay.shared : lay.dense_mlp) / tp + (moe ? lay.router : 0)), experts = w * (moe ? lay.experts / (l.etp * l.ep) : 0);
    const double attention = w * ((lay.attention + extra) / tp + lay.duplicated);
    if (!halves) {
      done += share;
      GradGroup& g = extra > 0 ? out.front() : out.emplace_back(GradGroup{0, 0, 0, chunk, false});
      g.dense += mlp + attention, g.expert += experts, g.done = done;
      return;
    }
    out.push_back({mlp, experts, (done += share / 2), chunk, false});
    out.push_back({attention, 0, (done += share / 2), chunk, false});
  };
  // The MTP layers run after the decoder's, so their backward comes first; a repeated MTP layer
  // (mtp_use_repeated_layer) holds its weights once.
  for (int d = 0; d < mtp; ++d) layer(mtp_moe_layers(m) > 0, 2 * h * h, d == 0 || !m.mtp_use_repeated_layer, mtp_chunk);
  for (int v = static_cast<int>(ranges.size()) - 1; v >= 0; --v)
    for (int i = ranges[static_cast<std::size_t>(v)].second - 1; i >= ranges[static_cast<std::size_t>(v)].first; --i)
      layer(moe_layers_in(m, i, i + 1) > 0, 0, true, v);
  out.push_back({V * h / tp, 0, 1, 0, true});
  return out;
}

MemoryPlan plan_memory(const Config& c, const LayoutPlan& lp, Dispatcher dispatcher, bool ep_overlap) {
  MemoryPlan most = plan_stage_memory(c, lp, dispatcher, ep_overlap, 0);
  for (int stage = 1; stage < lp.layout.pp; ++stage) {
    MemoryPlan m = plan_stage_memory(c, lp, dispatcher, ep_overlap, stage);
    if (m.peak() > most.peak()) most = m;
  }
  return most;
}

}  // namespace epx
