#include "epx/model/model_spec.hpp"

#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace epx {

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
  if (mla_up_proj) m.push_back("mla_up_proj");
  if (moe) m.push_back("moe");
  return m.empty() ? "none" : fmt::format("selective ({})", fmt::join(m, ", "));
}

int ModelSpec::num_moe_layers() const { return static_cast<int>(std::count(is_moe.begin(), is_moe.end(), true)); }

AttentionSpec ModelSpec::attention_of(int layer) const {
  AttentionSpec a = attention;
  if (static_cast<std::size_t>(layer) >= is_window.size() || !is_window[static_cast<std::size_t>(layer)]) a.window = -1;
  a.recompute_up_proj = recompute.mla_up_proj && a.mla;
  return a;
}

double ModelSpec::flops_per_token() const {
  const double H = static_cast<double>(hidden), d = static_cast<double>(attention.head_dim);
  const double nh = static_cast<double>(attention.heads), ng = static_cast<double>(attention.groups);
  const double S = static_cast<double>(seq_length);
  double attn = 2 * H * (nh + 2 * ng) * d + 2 * nh * d * H + 0.5 * 4 * nh * d * S;
  if (const auto& m = attention.mla) {  // Megatron's MLA count, the latents' norms in (the +1s)
    const double q_rank = static_cast<double>(m->q_lora_rank), kv_rank = static_cast<double>(m->kv_lora_rank);
    const double pe = static_cast<double>(m->pe_dim), dv = static_cast<double>(m->v_head_dim);
    const double nope = static_cast<double>(m->qk_head_dim);
    const double q = m->q_lora_rank > 0 ? q_rank * (H + nh * d + 1) : H * nh * d;
    attn = 2 * (q + kv_rank * (H + nh * (nope + dv) + 1) + H * pe + nh * dv * H) + 2 * S * (nh * d / 2 + nh * dv / 2);
  }
  // An MLP's fc1 and fc2: 2 H (fc1_width + F) a token, 6 H F gated.
  const auto mlp = [&](const MlpActivation& a, std::int64_t f) { return 2 * H * static_cast<double>(a.fc1_width(f) + f); };
  // The LM head once per MTP depth too; each MTP layer's norms (3H) and eh_proj (2H x H).
  const double mtp = static_cast<double>(mtp_layers);
  double forward = 2 * H * static_cast<double>(padded_vocab > 0 ? padded_vocab : vocab) * (1 + mtp) +
                   2 * mtp * (3 * H + 2 * H * H);
  for (bool m : is_moe) {
    forward += attn;
    if (m)
      forward += mlp(moe->activation, moe->ffn) * moe->topk + mlp(moe->activation, moe->shared_ffn);
    else
      forward += mlp(activation, ffn);
  }
  return 3 * forward;
}

}  // namespace epx
