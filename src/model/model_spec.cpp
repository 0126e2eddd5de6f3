#include "epx/model_spec.hpp"

#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace epx {
namespace {

[[noreturn]] void bad(const std::string& field, const std::string& value, const std::string& why) {
  throw ConfigError(fmt::format("{}={}: {}", field, value, why));
}

std::string opt(const OptInt& v) { return v ? std::to_string(*v) : "None"; }

}  // namespace

std::vector<std::pair<int, int>> RecomputeSpec::checkpoints(int layers) const {
  std::vector<std::pair<int, int>> out;
  if (method == "uniform")
    for (int first = 0; first < layers; first += num_layers) out.emplace_back(first, std::min(layers, first + num_layers));
  if (method == "block")
    for (int i = 0; i < std::min(layers, num_layers); ++i) out.emplace_back(i, i + 1);
  return out;
}

std::string RecomputeSpec::describe() const {
  if (!method.empty()) return fmt::format("full {} x{}", method, num_layers);
  std::vector<std::string> m;
  if (layernorm) m.push_back("layernorm");
  if (core_attn) m.push_back("core_attn");
  if (moe_act) m.push_back("moe_act");
  if (mlp) m.push_back("mlp");
  if (shared_experts) m.push_back("shared_experts");
  return m.empty() ? "none" : fmt::format("selective ({})", fmt::join(m, ", "));
}

int ModelSpec::num_moe_layers() const { return static_cast<int>(std::count(is_moe.begin(), is_moe.end(), true)); }

double ModelSpec::flops_per_token() const {
  const double H = static_cast<double>(hidden), d = static_cast<double>(attention.head_dim);
  const double nh = static_cast<double>(attention.heads), ng = static_cast<double>(attention.groups);
  const double attn = 2 * H * (nh + 2 * ng) * d + 2 * nh * d * H + 0.5 * 4 * nh * d * static_cast<double>(seq_length);
  double forward = 2 * H * static_cast<double>(vocab);
  for (bool m : is_moe) {
    forward += attn;
    if (m)
      forward += 6 * H * static_cast<double>(moe->ffn) * moe->topk + 6 * H * static_cast<double>(moe->shared_ffn) +
                 2 * H * static_cast<double>(moe->num_experts);
    else
      forward += 6 * H * static_cast<double>(ffn);
  }
  return 3 * forward;
}

ModelSpec model_spec_from_config(const Config& c) {
  const ModelConfig& m = c.model;
  ModelSpec s;
  if (m.num_layers < 1) bad("model.num_layers", std::to_string(m.num_layers), "must be at least 1");
  if (m.hidden_size < 1) bad("model.hidden_size", std::to_string(m.hidden_size), "must be positive");
  if (!m.vocab_size || *m.vocab_size < 2)
    bad("model.vocab_size", opt(m.vocab_size), "the mock data and the LM head need a vocabulary; set model.vocab_size (e.g. 4096)");
  if (m.normalization != "RMSNorm")
    bad("model.normalization", m.normalization, "epx's layers use RMSNorm; set model.normalization=RMSNorm");
  if (!m.gated_linear_unit)
    bad("model.gated_linear_unit", "false", "epx's MLPs are SwiGLU; set model.gated_linear_unit=true");
  if (m.add_bias_linear) bad("model.add_bias_linear", "true", "epx's linear layers have no bias; set model.add_bias_linear=false");
  if (m.add_qkv_bias) bad("model.add_qkv_bias", "true", "epx's attention has no QKV bias; set model.add_qkv_bias=false");
  if (m.multi_latent_attention)
    bad("model.multi_latent_attention", "true", "multi-latent attention is not implemented; set model.multi_latent_attention=false (GQA)");
  if (m.mtp_num_layers && *m.mtp_num_layers > 0)
    bad("model.mtp_num_layers", std::to_string(*m.mtp_num_layers), "multi-token prediction is not implemented; set model.mtp_num_layers=null");
  if (m.position_embedding_type != "rope" && m.position_embedding_type != "none")
    bad("model.position_embedding_type", m.position_embedding_type, "epx implements rope and none; set model.position_embedding_type=rope");
  if (m.fp16) bad("model.fp16", "true", "epx computes in BF16 or FP32; set model.bf16=true instead");

  s.vocab = *m.vocab_size;
  s.hidden = m.hidden_size;
  s.num_layers = static_cast<int>(m.num_layers);
  s.dtype = m.bf16 ? DType::BF16 : DType::F32;
  s.eps = static_cast<float>(m.layernorm_epsilon);
  s.init_std = m.init_method_std;
  s.seed = static_cast<std::uint64_t>(c.rng.seed);
  s.tie_embeddings = m.share_embeddings_and_output_weights;
  s.seq_length = m.seq_length;
  s.micro_batch = c.train.micro_batch_size.value_or(1);
  if (s.seq_length < 1) bad("model.seq_length", std::to_string(s.seq_length), "must be positive");
  if (s.micro_batch < 1) bad("train.micro_batch_size", std::to_string(s.micro_batch), "must be positive");

  AttentionSpec& a = s.attention;
  a.hidden = s.hidden;
  a.heads = m.num_attention_heads;
  if (a.heads < 1) bad("model.num_attention_heads", std::to_string(a.heads), "must be positive");
  a.groups = m.num_query_groups.value_or(a.heads);
  if (a.groups < 1 || a.heads % a.groups != 0)
    bad("model.num_query_groups", std::to_string(a.groups),
        fmt::format("must divide num_attention_heads ({})", a.heads));
  a.head_dim = m.kv_channels.value_or(s.hidden / a.heads);
  if (a.head_dim < 1) bad("model.kv_channels", opt(m.kv_channels), "must be positive");
  a.rope = m.position_embedding_type == "rope";
  if (a.rope && a.head_dim % 2 != 0)
    bad("model.kv_channels", std::to_string(a.head_dim), "rotary embeddings need an even head dimension");
  a.rope_base = m.rotary_base;
  a.qk_norm = m.qk_layernorm;
  a.eps = s.eps;
  a.dtype = s.dtype;

  // moe_layer_freq: layer i is MoE when i % every == 0, or as the explicit pattern says.
  const bool any_experts = m.num_moe_experts && *m.num_moe_experts > 0;
  if (!m.moe_layer_freq.pattern.empty() &&
      static_cast<int>(m.moe_layer_freq.pattern.size()) != s.num_layers)
    bad("model.moe_layer_freq", fmt::format("[{}]", fmt::join(m.moe_layer_freq.pattern, ", ")),
        fmt::format("the pattern has {} entries for {} layers; give one 0/1 per layer", m.moe_layer_freq.pattern.size(), s.num_layers));
  if (m.moe_layer_freq.pattern.empty() && m.moe_layer_freq.every < 1)
    bad("model.moe_layer_freq", std::to_string(m.moe_layer_freq.every), "must be at least 1");
  for (int i = 0; i < s.num_layers; ++i)
    s.is_moe.push_back(any_experts && (m.moe_layer_freq.pattern.empty() ? i % m.moe_layer_freq.every == 0
                                                                        : m.moe_layer_freq.pattern[static_cast<std::size_t>(i)] != 0));
  if (s.num_moe_layers() > 0) {
    s.moe = moe_spec_from_config(c);
  }
  if (s.num_moe_layers() < s.num_layers) {
    if (!m.ffn_hidden_size || *m.ffn_hidden_size < 1)
      bad("model.ffn_hidden_size", opt(m.ffn_hidden_size), "the dense MLP layers need a width; set model.ffn_hidden_size");
    s.ffn = *m.ffn_hidden_size;
  }

  // Recompute.
  RecomputeSpec& r = s.recompute;
  if (m.recompute_granularity == "selective") {
    for (const std::string& mod : m.recompute_modules.value_or(StringList{"core_attn"})) {
      if (mod == "layernorm") r.layernorm = true;
      else if (mod == "core_attn") r.core_attn = true;
      else if (mod == "moe_act") r.moe_act = true;
      else if (mod == "mlp") r.mlp = true;
      else if (mod == "shared_experts") r.shared_experts = true;
      else
        bad("model.recompute_modules", mod,
            "epx recomputes layernorm, core_attn, moe_act, mlp and shared_experts (moe and "
            "mla_up_proj are not implemented); remove it from the list");
    }
  } else if (m.recompute_granularity == "full") {
    if (!m.recompute_method || (*m.recompute_method != "uniform" && *m.recompute_method != "block"))
      bad("model.recompute_method", m.recompute_method.value_or("None"),
          "full recompute needs a method; set model.recompute_method=uniform or block");
    if (!m.recompute_num_layers || *m.recompute_num_layers < 1)
      bad("model.recompute_num_layers", opt(m.recompute_num_layers),
          "full recompute needs the number of layers per checkpoint (uniform) or recomputed (block); set it to 1 or more");
    r.method = *m.recompute_method;
    r.num_layers = static_cast<int>(*m.recompute_num_layers);
  } else if (m.recompute_granularity) {
    bad("model.recompute_granularity", *m.recompute_granularity, "must be full, selective or None");
  }
  return s;
}

}  // namespace epx
