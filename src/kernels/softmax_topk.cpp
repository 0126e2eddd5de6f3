// Row-wise softmax, sigmoid, log-sum-exp and a deterministic top-k, all on FP32 buffers: the
// router's math is FP32 whatever the activation dtype.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

#include "epx/kernels/kernels.hpp"

namespace epx {

void softmax_rows(const float* x, float* y, std::int64_t rows, std::int64_t cols) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * cols;
    float* yr = y + r * cols;
    const float mx = *std::max_element(xr, xr + cols);
    double sum = 0;
    for (std::int64_t c = 0; c < cols; ++c) sum += yr[c] = std::exp(xr[c] - mx);
    const float inv = static_cast<float>(1.0 / sum);
    for (std::int64_t c = 0; c < cols; ++c) yr[c] *= inv;
  }
}

void softmax_backward_rows(const float* y, const float* dy, float* dx, std::int64_t rows,
                           std::int64_t cols) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* yr = y + r * cols;
    const float* dyr = dy + r * cols;
    double dot = 0;
    for (std::int64_t c = 0; c < cols; ++c) dot += static_cast<double>(yr[c]) * dyr[c];
    for (std::int64_t c = 0; c < cols; ++c)
      dx[r * cols + c] = yr[c] * (dyr[c] - static_cast<float>(dot));
  }
}

void sigmoid(const float* x, float* y, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) y[i] = 1.f / (1.f + std::exp(-x[i]));
}

void logsumexp_rows(const float* x, float* out, std::int64_t rows, std::int64_t cols) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * cols;
    const float mx = *std::max_element(xr, xr + cols);
    double sum = 0;
    for (std::int64_t c = 0; c < cols; ++c) sum += std::exp(static_cast<double>(xr[c] - mx));
    out[r] = mx + static_cast<float>(std::log(sum));
  }
}

void topk_rows(const float* x, std::int64_t rows, std::int64_t cols, int k, std::int32_t* idx) {
  if (k < 1 || k > cols) throw std::invalid_argument("topk: k must be in [1, cols]");
  std::vector<std::int32_t> order(static_cast<std::size_t>(cols));
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * cols;
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [xr](std::int32_t a, std::int32_t b) {
                        return xr[a] > xr[b] || (xr[a] == xr[b] && a < b);
                      });
    std::copy(order.begin(), order.begin() + k, idx + r * k);
  }
}

}  // namespace epx
