// Expert-major permutation (Megatron-Core's "permutation 1"): rows grouped by expert, tokens in
// ascending order inside each expert. Because experts are assigned to EP ranks contiguously,
// expert-major is also rank-major, which is what the all-to-all needs.
#include <cstring>
#include <stdexcept>
#include <vector>

#include "epx/base/cpu_clones.hpp"
#include "epx/kernels/kernels.hpp"
#include "float_access.hpp"


namespace epx {
namespace {

// acc += row, and row = acc rounded: the unpermutation's inner loops, compiled per ISA (sums in
// the same order in every variant, so the same results on every CPU).
template <class T>
[[gnu::always_inline]] inline void accumulate(const T* row, std::int64_t h, float* acc) {
  for (std::int64_t j = 0; j < h; ++j) acc[j] += detail::ld(row, j);
}
template <class T>
[[gnu::always_inline]] inline void store(const float* acc, std::int64_t h, T* row) {
  for (std::int64_t j = 0; j < h; ++j) detail::st(row, j, acc[j]);
}
EPX_CPU_CLONES void accumulate_f32(const float* row, std::int64_t h, float* acc) { accumulate(row, h, acc); }
EPX_CPU_CLONES void accumulate_bf16(const std::uint16_t* row, std::int64_t h, float* acc) { accumulate(row, h, acc); }
EPX_CPU_CLONES void store_f32(const float* acc, std::int64_t h, float* row) { store(acc, h, row); }
EPX_CPU_CLONES void store_bf16(const float* acc, std::int64_t h, std::uint16_t* row) { store(acc, h, row); }
void accumulate_row(const float* row, std::int64_t h, float* acc) { accumulate_f32(row, h, acc); }
void accumulate_row(const std::uint16_t* row, std::int64_t h, float* acc) { accumulate_bf16(row, h, acc); }
void store_row(const float* acc, std::int64_t h, float* row) { store_f32(acc, h, row); }
void store_row(const float* acc, std::int64_t h, std::uint16_t* row) { store_bf16(acc, h, row); }

}  // namespace

Permutation make_permutation(const std::uint8_t* routing_map, std::int64_t num_tokens,
                             std::int64_t num_experts) {
  Permutation p;
  p.num_tokens = num_tokens;
  p.tokens_per_expert.assign(static_cast<std::size_t>(num_experts), 0);
  for (std::int64_t t = 0; t < num_tokens; ++t)
    for (std::int64_t e = 0; e < num_experts; ++e)
      if (routing_map[t * num_experts + e]) ++p.tokens_per_expert[static_cast<std::size_t>(e)];
  std::int64_t rows = 0;
  std::vector<std::int64_t> next(static_cast<std::size_t>(num_experts));
  for (std::int64_t e = 0; e < num_experts; ++e) {
    next[static_cast<std::size_t>(e)] = rows;
    rows += p.tokens_per_expert[static_cast<std::size_t>(e)];
  }
  p.row_token.assign(static_cast<std::size_t>(rows), -1);
  p.row_expert.assign(static_cast<std::size_t>(rows), 0);
  for (std::int64_t t = 0; t < num_tokens; ++t)
    for (std::int64_t e = 0; e < num_experts; ++e)
      if (routing_map[t * num_experts + e]) {
        const auto r = static_cast<std::size_t>(next[static_cast<std::size_t>(e)]++);
        p.row_token[r] = t;
        p.row_expert[r] = static_cast<std::int32_t>(e);
      }
  return p;
}

void permute_rows(const Tensor& x, const Permutation& p, Tensor& out) {
  const std::int64_t h = x.dim(1);
  detail::expect_shape("permute_rows", "out", out, {p.rows(), h});
  if (x.dim(0) != p.num_tokens) throw std::invalid_argument("permute_rows: token count mismatch");
  if (x.dtype() != out.dtype()) throw std::invalid_argument("permute_rows: dtype mismatch");
  const std::size_t row_bytes = static_cast<std::size_t>(h) * dtype_size(x.dtype());
  const auto* src = static_cast<const char*>(x.raw());
  auto* dst = static_cast<char*>(out.raw());
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < p.rows(); ++r) {
    const std::int64_t t = p.row_token[static_cast<std::size_t>(r)];
    if (t < 0) std::memset(dst + r * row_bytes, 0, row_bytes);
    else std::memcpy(dst + r * row_bytes, src + t * row_bytes, row_bytes);
  }
}

void unpermute_rows(const Tensor& y, const Permutation& p, Tensor& out) {
  const std::int64_t h = y.dim(1);
  detail::expect_shape("unpermute_rows", "out", out, {p.num_tokens, h});
  if (y.dim(0) != p.rows()) throw std::invalid_argument("unpermute_rows: row count mismatch");
  // Per token, the list of its rows in order, so each output row is one thread's ordered sum.
  std::vector<std::int64_t> start(static_cast<std::size_t>(p.num_tokens) + 1, 0);
  for (auto t : p.row_token)
    if (t >= 0) ++start[static_cast<std::size_t>(t) + 1];
  for (std::size_t t = 0; t < static_cast<std::size_t>(p.num_tokens); ++t) start[t + 1] += start[t];
  std::vector<std::int64_t> rows_of(static_cast<std::size_t>(start.back()));
  {
    std::vector<std::int64_t> fill(start.begin(), start.end() - 1);
    for (std::int64_t r = 0; r < p.rows(); ++r) {
      const std::int64_t t = p.row_token[static_cast<std::size_t>(r)];
      if (t >= 0) rows_of[static_cast<std::size_t>(fill[static_cast<std::size_t>(t)]++)] = r;
    }
  }
  detail::with_dtype("unpermute_rows", [&](auto tag) {
    using T = decltype(tag);
    const T* yp = static_cast<const T*>(y.raw());
    T* op = static_cast<T*>(out.raw());
#pragma omp parallel
    {
      std::vector<float> acc(static_cast<std::size_t>(h));
#pragma omp for schedule(static)
      for (std::int64_t t = 0; t < p.num_tokens; ++t) {
        std::fill(acc.begin(), acc.end(), 0.f);
        for (auto i = start[static_cast<std::size_t>(t)]; i < start[static_cast<std::size_t>(t) + 1]; ++i)
          accumulate_row(yp + rows_of[static_cast<std::size_t>(i)] * h, h, acc.data());
        store_row(acc.data(), h, op + t * h);
      }
    }
  }, y, out);
}

void gather_probs(const float* probs, std::int64_t num_experts, const Permutation& p, float* out) {
  for (std::int64_t r = 0; r < p.rows(); ++r) {
    const std::int64_t t = p.row_token[static_cast<std::size_t>(r)];
    out[r] = t < 0 ? 0.f : probs[t * num_experts + p.row_expert[static_cast<std::size_t>(r)]];
  }
}

void scatter_probs(const float* drow, std::int64_t num_experts, const Permutation& p, float* dprobs) {
  for (std::int64_t r = 0; r < p.rows(); ++r) {
    const std::int64_t t = p.row_token[static_cast<std::size_t>(r)];
    if (t >= 0) dprobs[t * num_experts + p.row_expert[static_cast<std::size_t>(r)]] += drow[r];
  }
}

}  // namespace epx

namespace epx {

std::vector<std::int64_t> transposed_chunk_rows(const std::vector<std::int64_t>& chunk_rows,
                                                std::int64_t a, std::int64_t b) {
  if (static_cast<std::int64_t>(chunk_rows.size()) != a * b)
    throw std::invalid_argument("transpose_chunks: chunk count is not A x B");
  std::vector<std::int64_t> out(chunk_rows.size());
  for (std::int64_t i = 0; i < a; ++i)
    for (std::int64_t j = 0; j < b; ++j)
      out[static_cast<std::size_t>(j * a + i)] = chunk_rows[static_cast<std::size_t>(i * b + j)];
  return out;
}

void transpose_chunks(const void* in, void* out, std::size_t row_bytes,
                      const std::vector<std::int64_t>& chunk_rows, std::int64_t a, std::int64_t b) {
  // Start row of every chunk in the input ([A][B]) and the output ([B][A]) layout.
  const std::vector<std::int64_t> out_rows = transposed_chunk_rows(chunk_rows, a, b);
  std::vector<std::int64_t> in_start(chunk_rows.size()), out_start(chunk_rows.size());
  for (std::size_t c = 0, r = 0; c < chunk_rows.size(); r += static_cast<std::size_t>(chunk_rows[c]), ++c)
    in_start[c] = static_cast<std::int64_t>(r);
  for (std::size_t c = 0, r = 0; c < out_rows.size(); r += static_cast<std::size_t>(out_rows[c]), ++c)
    out_start[c] = static_cast<std::int64_t>(r);
  const auto* src = static_cast<const char*>(in);
  auto* dst = static_cast<char*>(out);
  for (std::int64_t i = 0; i < a; ++i)
    for (std::int64_t j = 0; j < b; ++j) {
      const auto ci = static_cast<std::size_t>(i * b + j), co = static_cast<std::size_t>(j * a + i);
      if (chunk_rows[ci] > 0)
        std::memcpy(dst + static_cast<std::size_t>(out_start[co]) * row_bytes,
                    src + static_cast<std::size_t>(in_start[ci]) * row_bytes,
                    static_cast<std::size_t>(chunk_rows[ci]) * row_bytes);
    }
}

}  // namespace epx
