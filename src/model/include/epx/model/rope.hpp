// Rotary position embeddings (rotate-half, as Megatron-Core's RotaryEmbedding and
// apply_rotary_pos_emb), plain or YaRN (YarnRotaryEmbedding: GPT-OSS). n inverse frequencies f_i
// rotate the first 2n channels of a head: for i < n and a = pos * f_i,
//   (x_i, x_{i+n}) -> m * (x_i cos a - x_{i+n} sin a, x_{i+n} cos a + x_i sin a),
// the rest pass through. Plain: Megatron's dim r (head_dim, or int(head_dim * rotary_percent)),
// n = ceil(r / 2), f_i = base^(-2i/r), m = 1. YaRN: r = head_dim (MLA: qk_pos_emb_head_dim;
// rotary_percent is not read), f_i blends base^(-2i/r) (extrapolation) into it over the factor
// (interpolation) on a linear ramp between the dims where beta_fast and beta_slow rotations fit the
// original context. m is YaRN's concentration factor wherever yarn_rotary_scaling_factor is set:
// Megatron's attention multiplies cos and sin, for q and k, by it (with Bridge's patch, under plain
// RoPE too); MLA's is its YaRN's (mscale over mscale_all_dim).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace epx {

// Megatron-Core's YarnRotaryEmbedding frequency arguments (Bridge's yarn_* provider fields).
struct YarnSpec {
  double factor = 1, original_max_positions = 4096, beta_fast = 32, beta_slow = 1;
  bool round_to_int = true;  // the correction range's bounds floored and ceiled
};

struct RopeSpec {
  std::int64_t dim = 0;  // Megatron's dim r
  double base = 10000;
  std::optional<YarnSpec> yarn;
  double concentration = 1;  // m (epx/config/yarn.hpp)
};

// The inverse frequencies f_i.
std::vector<double> rope_inv_freq(const RopeSpec& r);

// m cos and m sin of every (position, i) for one sequence length, computed once per shape and
// spec (rope_table) and shared by every layer, forward and backward.
class RopeTable {
 public:
  RopeTable(std::int64_t seq, const RopeSpec& r);
  // One head of d channels at position pos; `inverse` applies the transpose (the backward).
  void rotate(const float* in, float* out, std::int64_t d, std::int64_t pos, bool inverse) const;
  std::int64_t rotated() const { return 2 * half_; }  // channels that rotate

 private:
  std::int64_t half_ = 0;
  std::vector<float> cos_, sin_;  // [seq, half]
};
const RopeTable& rope_table(std::int64_t seq, const RopeSpec& r);

}  // namespace epx
