// The numerical kernels under every layer: GEMM and grouped GEMM (oneDNN), gated linear units, softmax,
// sigmoid and top-k, blocked causal attention, RMSNorm, cross-entropy, and the expert-major
// permutation. Each has its backward; ops with weights expose dgrad and wgrad as separate calls
// so that wgrad can run now or be queued (delayed wgrad). Activations are F32 or BF16; the math
// inside is FP32.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "epx/kernels/mlp_activation.hpp"
#include "epx/tensor/tensor.hpp"

namespace epx {

// ---------------------------------------------------------------- GEMM (src/kernels/gemm.cpp)

// A row-major matrix in memory: `rows` x `cols` elements of `dtype` at `data`.
struct MatRef {
  const void* data = nullptr;
  DType dtype = DType::F32;
  std::int64_t rows = 0, cols = 0;
};
struct MatMut {
  void* data = nullptr;
  DType dtype = DType::F32;
  std::int64_t rows = 0, cols = 0;
};
// Rows [row0, row0 + n) of a 2-D tensor (or of a 3-D tensor's matrix `index` with row0 = 0).
MatRef mat(const Tensor& t, std::int64_t row0 = -1, std::int64_t n = -1);
MatMut mat_mut(Tensor& t, std::int64_t row0 = -1, std::int64_t n = -1);
MatRef expert_mat(const Tensor& stacked, std::int64_t index);  // stacked [G, R, C] -> [R, C]
MatMut expert_mat_mut(Tensor& stacked, std::int64_t index);

enum class Trans { N, T };

// C = op(A) * op(B)   (or C += ... with accumulate), FP32 accumulation. A and B share a dtype
// (F32 or BF16); C is F32 or BF16. Shapes are checked and a mismatch throws.
void gemm(MatRef a, Trans ta, MatRef b, Trans tb, MatMut c, bool accumulate = false);

// One GEMM per group with the same transposes: the expert FFNs over variable token counts. A group
// with zero rows in its M or K dimension is skipped (or its C zeroed when not accumulating).
struct GemmProblem {
  MatRef a, b;
  MatMut c;
};
void grouped_gemm(std::span<const GemmProblem> problems, Trans ta, Trans tb, bool accumulate = false);

// The CPU instruction set oneDNN dispatches to ("avx512_core_amx", "avx512_core_bf16", ...) and
// the implementation it picks for a BF16 GEMM ("brg:avx512_core_amx"; "bf16 widened to f32, ..."
// on a CPU where oneDNN has no BF16 matmul, e.g. AVX2 only), both found at run time.
std::string gemm_isa();
std::string gemm_impl(DType dtype);

// The MLPs' activation, gated or not: epx/kernels/mlp_activation.hpp (src/kernels/mlp_activation.cpp).

// ----------------------------------- softmax, sigmoid, top-k (src/kernels/softmax_topk.cpp)

// Row-wise over [rows, cols] FP32 buffers.
void softmax_rows(const float* x, float* y, std::int64_t rows, std::int64_t cols);
// dx = y * (dy - sum(dy * y)) per row.
void softmax_backward_rows(const float* y, const float* dy, float* dx, std::int64_t rows,
                           std::int64_t cols);
void sigmoid(const float* x, float* y, std::int64_t n);
// The k largest entries of each row, largest first; ties go to the lower column index, so the
// selection is deterministic. idx is [rows, k].
void topk_rows(const float* x, std::int64_t rows, std::int64_t cols, int k, std::int32_t* idx);
// log(sum(exp(x))) per row.
void logsumexp_rows(const float* x, float* out, std::int64_t rows, std::int64_t cols);

// ------------------------------------- causal attention (src/kernels/causal_attention.cpp)

// Which keys a query row sees, and what else its softmax counts.
struct CausalAttentionMask {
  // A sliding window (TE's window_size (window, 0)): query i sees keys [i - window, i]; -1: [0, i].
  std::int64_t window = -1;
  // A sink (Megatron's softmax_offset: 0 for off-by-one, learned per head for learnable): one more
  // logit, not scaled, in every row's softmax, with no value. Null: none (vanilla).
  const float* sink = nullptr;
};

// One head's causal softmax(q k^T * scale) v in query blocks of `block` rows, never S x S (each
// block's scores are a [block, keys it sees] strip). q, k [seq, d] and v [seq, d_v] row-major
// (d_v = d but for MLA's value heads), F32 or BF16 (std::uint16_t; BF16 GEMMs with FP32
// accumulation, as flash attention); out [seq, d_v] F32; lse [seq] gets each row's log-sum-exp of
// the scaled scores (and the sink), which the backward needs.
void causal_attention_forward(const float* q, const float* k, const float* v, std::int64_t seq, std::int64_t d,
                              std::int64_t d_v, float scale, float* out, float* lse,
                              const CausalAttentionMask& mask = {}, std::int64_t block = 128);
void causal_attention_forward(const std::uint16_t* q, const std::uint16_t* k, const std::uint16_t* v, std::int64_t seq,
                              std::int64_t d, std::int64_t d_v, float scale, float* out, float* lse,
                              const CausalAttentionMask& mask = {}, std::int64_t block = 128);
// From dout [seq, d_v] (the dtype of q, k, v) and delta [seq] = rowsum(dout * out): dq [seq, d]
// F32 is written, dk [seq, d] and dv [seq, d_v] F32 are accumulated into (query heads that share a
// key/value group add up).
void causal_attention_backward(const float* q, const float* k, const float* v, const float* lse, const float* delta,
                               const float* dout, std::int64_t seq, std::int64_t d, std::int64_t d_v, float scale,
                               float* dq, float* dk, float* dv, const CausalAttentionMask& mask = {},
                               std::int64_t block = 128);
void causal_attention_backward(const std::uint16_t* q, const std::uint16_t* k, const std::uint16_t* v, const float* lse,
                               const float* delta, const std::uint16_t* dout, std::int64_t seq, std::int64_t d,
                               std::int64_t d_v, float scale, float* dq, float* dk, float* dv,
                               const CausalAttentionMask& mask = {}, std::int64_t block = 128);
// The gradient of one head's sink logit from its rows' lse and delta: the sink has no value, so
// d loss / d sink = -sum_i P_sink,i delta_i with P_sink,i = exp(sink - lse_i).
double attention_sink_grad(const float* lse, const float* delta, std::int64_t seq, float sink);
// Calls f(std::uint16_t{}) for BF16 operands, f(float{}) otherwise: which overload above to call.
template <class F>
void with_operand_type(DType dtype, F&& f) {
  if (dtype == DType::BF16) f(std::uint16_t{});
  else f(float{});
}

// ------------------------------------------------ elementwise (src/kernels/elementwise.cpp)

// out = a + b (+ c), summed in FP32 and rounded once to out's dtype; out may be a, b or c. The
// residual adds, and the MoE layer's routed + shared sums.
void add(const Tensor& a, const Tensor& b, Tensor& out);
void add(const Tensor& a, const Tensor& b, const Tensor& c, Tensor& out);
// out = a + b_f32 (+ c): a, c and out share the activation dtype, b is F32; summed in FP32 in
// that order and rounded once (the MoE layer's input gradient from its paths).
void add_f32(const Tensor& a, const Tensor& b_f32, const Tensor* c, Tensor& out);

// Linear biases over row groups (the experts' token groups; one group for a dense linear): rows
// [off[g], off[g + 1]) of y [M, N] F32 += bias[g] (bias [G, N] F32, G = off.size() - 1), times
// scale[r] where a scale is given (the routing probabilities of the experts' fc2). And its
// gradient: out[g][j] += the sum over group g's rows of d[r, j] (F32 or BF16; times scale[r] where
// given), in row order in FP64, so the same bits on any thread count. One parallel pass each.
void add_bias_rows(Tensor& y, const std::vector<std::int64_t>& off, const float* bias, const float* scale);
void add_row_sums(const Tensor& d, const std::vector<std::int64_t>& off, const float* scale, float* out);

// ------------------------------------------ sum of squares (src/kernels/sum_of_squares.cpp)

// sum(x[i]^2) in FP64, in a fixed order (the same bits on every CPU): the gradient norm.
double sum_of_squares(const float* x, std::int64_t n);

// ------------------------------------------------------- RMSNorm (src/kernels/rmsnorm.cpp)

// y = x * rstd * gamma, rstd = 1 / sqrt(mean(x^2) + eps); x, y [T, H]; gamma [H] F32; rstd [T].
void rmsnorm_forward(const Tensor& x, const Tensor& gamma, float eps, Tensor& y, Tensor& rstd);
void rmsnorm_dgrad(const Tensor& x, const Tensor& gamma, const Tensor& rstd, const Tensor& dy,
                   Tensor& dx);
// dgamma += sum_t dy * x * rstd (dgamma F32).
void rmsnorm_wgrad(const Tensor& x, const Tensor& rstd, const Tensor& dy, Tensor& dgamma);

// ------------------------------------------- cross-entropy (src/kernels/cross_entropy.cpp)

// Mean over tokens of -log softmax(logits)[target]; logits [T, V]; targets [T] (I64).
// lse [T] F32 is saved for the backward.
double cross_entropy_forward(const Tensor& logits, const Tensor& targets, Tensor& lse);
// dlogits = (softmax(logits) - onehot(target)) * dloss / T.
void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse,
                            float dloss, Tensor& dlogits);

// ------------------------------------------- permutation (src/kernels/permute.cpp)

// Where each (token, expert) pair goes in the expert-major layout: expert 0's tokens, then expert
// 1's, ...; inside an expert, tokens in ascending order (Megatron's permute). A row of -1 is a
// padding row (zeros in, ignored out).
struct Permutation {
  std::int64_t num_tokens = 0;
  std::vector<std::int64_t> row_token;   // [rows] source token, or -1
  std::vector<std::int32_t> row_expert;  // [rows] expert of the row
  std::vector<std::int64_t> tokens_per_expert;
  std::int64_t rows() const { return static_cast<std::int64_t>(row_token.size()); }
};
// From a routing map [T, E] (uint8, row-major).
Permutation make_permutation(const std::uint8_t* routing_map, std::int64_t num_tokens,
                             std::int64_t num_experts);
// out [rows, H] = x[row_token] (zeros for padding rows).
void permute_rows(const Tensor& x, const Permutation& p, Tensor& out);
// out [T, H] = sum over a token's rows (FP32 accumulation, rows in order: deterministic).
// The backward of permute_rows, and permute_rows is its backward.
void unpermute_rows(const Tensor& y, const Permutation& p, Tensor& out);
// probs [T, E] -> per row; and its backward, scattering into dprobs [T, E].
void gather_probs(const float* probs, std::int64_t num_experts, const Permutation& p, float* out);
void scatter_probs(const float* drow, std::int64_t num_experts, const Permutation& p, float* dprobs);

// Megatron's sort_chunks_by_idxs for "permutation 2": rows arrive as chunks laid out [A][B]
// (chunk (a, b) holds chunk_rows[a * B + b] rows of row_bytes each); out gets them as [B][A].
// The inverse is the same call with A and B swapped and chunk_rows transposed.
void transpose_chunks(const void* in, void* out, std::size_t row_bytes,
                      const std::vector<std::int64_t>& chunk_rows, std::int64_t a, std::int64_t b);
// chunk_rows of an [A][B] layout, listed in [B][A] order.
std::vector<std::int64_t> transposed_chunk_rows(const std::vector<std::int64_t>& chunk_rows,
                                                std::int64_t a, std::int64_t b);

}  // namespace epx
