#include "epx/plan/flops.hpp"

#include <algorithm>

#include <fmt/format.h>

namespace epx {
namespace {

[[noreturn]] void missing(const std::string& field) {
  throw ConfigError(fmt::format("{}=None: the FLOPs count needs it; set {}", field, field));
}

}  // namespace

AttentionMacs attention_macs(const ModelConfig& m) {
  const double h = static_cast<double>(m.hidden_size), n = static_cast<double>(m.num_attention_heads);
  const double s = static_cast<double>(m.seq_length);
  if (m.multi_latent_attention) {
    const double d_qk = static_cast<double>(m.qk_head_dim), d_rope = static_cast<double>(m.qk_pos_emb_head_dim);
    const double d_v = static_cast<double>(m.v_head_dim), r_kv = static_cast<double>(m.kv_lora_rank);
    const double q_term = m.q_lora_rank ? static_cast<double>(*m.q_lora_rank) * (h + n * (d_qk + d_rope) + 1)
                                        : h * n * (d_qk + d_rope);
    return {q_term + r_kv * (h + n * (d_qk + d_v) + 1) + h * d_rope + n * d_v * h,
            s * (n * (d_qk + d_rope) / 2 + n * d_v / 2)};
  }
  const double d = static_cast<double>(m.kv_channels.value_or(m.hidden_size / std::max<Int>(1, m.num_attention_heads)));
  const double q = d * n, kv = d * static_cast<double>(m.num_query_groups.value_or(m.num_attention_heads));
  return {h * (q + 2 * kv) + q * h, s * q};
}

double moe_layers_in(const ModelConfig& m, Int first, Int last) {
  if (!m.num_moe_experts || *m.num_moe_experts < 1) return 0;
  double n = 0;
  for (Int i = std::max<Int>(0, first); i < last; ++i) n += m.moe_layer_freq.is_moe(i);
  return n;
}

double mtp_moe_layers(const ModelConfig& m) {
  return moe_layers_in(m, m.num_layers - 1, m.num_layers) > 0 ? static_cast<double>(m.mtp_num_layers.value_or(0)) : 0;
}

double window_layers_in(const ModelConfig& m, Int first, Int last) {
  if (!sliding_window(m)) return 0;
  double n = 0;
  for (Int i = std::max<Int>(0, first); i < last; ++i) n += !m.window_attn_skip_freq || m.window_attn_skip_freq->is_window(i);
  return n;
}

double window_core_share(const ModelConfig& m) {
  const OptInt window = sliding_window(m);
  if (!window) return 1;
  const double w = static_cast<double>(*window) + 1, s = static_cast<double>(m.seq_length);
  return std::min(1.0, (w - w * (w - 1) / (2 * s)) / (s / 2));
}

double blocked_window_core_share(const ModelConfig& m, Int block) {
  const OptInt window = sliding_window(m);
  if (!window) return 1;
  double full = 0, windowed = 0;
  for (Int r0 = 0; r0 < m.seq_length; r0 += block) {
    const double rows = static_cast<double>(std::min(block, m.seq_length - r0));
    full += rows * (static_cast<double>(r0) + rows);
    windowed += rows * (static_cast<double>(r0 - std::max<Int>(0, r0 - *window)) + rows);
  }
  return windowed / full;
}

Int padded_vocab_size(const ModelConfig& m) {
  if (!m.vocab_size) missing("model.vocab_size");
  return padded_vocab(*m.vocab_size, m);
}

ModelFlops model_flops(const Config& c) {
  const ModelConfig& m = c.model;
  return layer_flops(c, static_cast<double>(m.num_layers), moe_layers_in(m, 0, m.num_layers) + mtp_moe_layers(m),
                     static_cast<double>(m.mtp_num_layers.value_or(0)), true);
}

ModelFlops layer_flops(const Config& c, double decoder_layers, double moe_layers, double mtp, bool loss) {
  const ModelConfig& m = c.model;
  if (m.num_layers < 1 || m.hidden_size < 1 || m.num_attention_heads < 1)
    throw ConfigError(fmt::format("model.num_layers={}, model.hidden_size={}, model.num_attention_heads={}: "
                                  "the FLOPs count needs a model shape; set all three",
                                  m.num_layers, m.hidden_size, m.num_attention_heads));
  const double h = static_cast<double>(m.hidden_size);
  const double gated = m.gated_linear_unit ? 1.5 : 1.0;
  const double layers = decoder_layers + mtp;
  const double dense_layers = layers - moe_layers;

  // Sums over layers of the FFN width a token passes through: dense and shared, and routed.
  double mlp_width = 0, routed_width = 0, shared_width = 0;
  if (dense_layers > 0) {
    if (!m.ffn_hidden_size) missing("model.ffn_hidden_size");
    mlp_width += dense_layers * static_cast<double>(*m.ffn_hidden_size);
  }
  if (moe_layers > 0) {
    const OptInt& moe_ffn = m.moe_ffn_hidden_size ? m.moe_ffn_hidden_size : m.ffn_hidden_size;
    if (!moe_ffn) missing("model.moe_ffn_hidden_size");
    routed_width = moe_layers * static_cast<double>(*moe_ffn) * static_cast<double>(m.moe_router_topk);
    shared_width = moe_layers * static_cast<double>(m.moe_shared_expert_intermediate_size.value_or(0));
    mlp_width += shared_width;
  }
  const AttentionMacs a = attention_macs(m);
  ModelFlops f;
  f.mlp = 12 * h * mlp_width * gated;  // 3 passes x 2 GEMMs (up, down) x 2 FLOPs
  f.shared_experts = 12 * h * shared_width * gated;
  f.routed_experts = 12 * h * routed_width * gated;
  f.attention = 6 * (a.linear + a.core) * layers;
  f.attention_core = 6 * a.core * layers;
  f.mtp = 6 * mtp * (3 * h + 2 * h * h);
  // The output layer's logits: the loss's and each MTP layer's own, all where the loss is
  // (Megatron's GPTModel computes the MTP losses in its postprocess, on the loss stage).
  f.logits = loss ? 6 * h * static_cast<double>(padded_vocab_size(m)) * static_cast<double>(m.mtp_num_layers.value_or(0) + 1)
                  : 0;
  return f;
}

}  // namespace epx
