#include "epx/comm/collectives.hpp"

#include <algorithm>

namespace epx {

std::vector<std::int64_t> allgather_one(Communicator& c, std::int64_t v) {
  std::vector<std::int64_t> all(static_cast<std::size_t>(c.size()));
  c.allgatherv(&v, all.data(), std::vector<std::int64_t>(all.size(), 1), DType::I64);
  return all;
}

std::int64_t max_over(Communicator& c, std::int64_t v) {
  const std::vector<std::int64_t> all = allgather_one(c, v);
  return *std::max_element(all.begin(), all.end());
}

float sum_over(Communicator& c, float v) {
  c.allreduce(&v, 1, DType::F32);
  return v;
}

Tensor allgather_rows(Communicator& c, const Tensor& local) {
  const Tensor f32 = local.to(DType::F32);
  Shape s = f32.shape();
  s[0] *= c.size();
  Tensor out(s, DType::F32);
  const std::vector<std::int64_t> counts(static_cast<std::size_t>(c.size()), f32.numel());
  c.allgatherv(f32.raw(), out.raw(), counts, DType::F32);
  return out;
}

std::vector<int> node_of_each_rank(Communicator& c) {
  const auto node = c.split_shared(c.name() + " node");
  // The lowest rank of `c` on this node names it; node ranks are ordered by their rank in `c`.
  const std::int64_t first = allgather_one(*node, c.rank()).front();
  const std::vector<std::int64_t> all = allgather_one(c, first);
  return {all.begin(), all.end()};
}

std::vector<std::string> allgather_text(Communicator& c, const std::string& mine) {
  // In 8-byte words, padded with spaces.
  std::string padded = mine;
  padded.resize((padded.size() + 7) / 8 * 8, ' ');
  const std::vector<std::int64_t> words = allgather_one(c, static_cast<std::int64_t>(padded.size() / 8));
  std::int64_t total = 0;
  for (auto w : words) total += w;
  std::string all(static_cast<std::size_t>(total * 8), ' ');
  c.allgatherv(padded.data(), all.data(), words, DType::I64);
  std::vector<std::string> out;
  std::size_t at = 0;
  for (auto w : words) {
    out.push_back(all.substr(at, static_cast<std::size_t>(w * 8)));
    at += static_cast<std::size_t>(w * 8);
  }
  return out;
}

}  // namespace epx
