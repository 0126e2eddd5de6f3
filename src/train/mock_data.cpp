#include "epx/train/mock_data.hpp"

#include <algorithm>
#include <numeric>

#include "epx/base/error.hpp"
#include "epx/tensor/random.hpp"

namespace epx {

MockData::Mode MockData::parse_mode(const std::string& name) {
  if (name == "random") return Mode::random;
  if (name == "pattern") return Mode::pattern;
  throw InputError("--mock-data " + name + ": expected random (uniform tokens) or pattern (a learnable cycle)");
}

MockData::MockData(Mode mode, std::int64_t vocab, std::int64_t seq_length, std::uint64_t seed, std::int64_t period)
    : mode_(mode), vocab_(vocab), seq_(seq_length), seed_(seed) {
  // The cycle: the first `period` tokens of a seeded shuffle of the vocabulary.
  std::vector<std::int64_t> all(static_cast<std::size_t>(vocab));
  std::iota(all.begin(), all.end(), 0);
  const CounterRng rng(seed, stream_of("mock_data.cycle"));
  for (std::int64_t i = vocab - 1; i > 0; --i)
    std::swap(all[static_cast<std::size_t>(i)],
              all[static_cast<std::size_t>(static_cast<std::int64_t>(rng.uniform(static_cast<std::uint64_t>(i)) * static_cast<double>(i + 1)))]);
  cycle_.assign(all.begin(), all.begin() + std::min(period, vocab));
}

std::vector<std::int64_t> MockData::sample(std::int64_t index) const {
  const CounterRng rng(seed_, stream_of("mock_data.sample") + static_cast<std::uint64_t>(index));
  std::vector<std::int64_t> out(static_cast<std::size_t>(seq_ + 1));
  const auto n = static_cast<std::int64_t>(cycle_.size());
  const auto start = static_cast<std::int64_t>(rng.uniform(0) * static_cast<double>(n));
  for (std::int64_t j = 0; j <= seq_; ++j)
    out[static_cast<std::size_t>(j)] =
        mode_ == Mode::pattern
            ? cycle_[static_cast<std::size_t>((start + j) % n)]
            : std::min(vocab_ - 1, static_cast<std::int64_t>(rng.uniform(static_cast<std::uint64_t>(j + 1)) * static_cast<double>(vocab_)));
  return out;
}

void MockData::micro_batch(std::int64_t first, std::int64_t batch, Tensor& tokens, Tensor& targets) const {
  tokens = Tensor({seq_ * batch}, DType::I64);
  targets = Tensor({seq_ * batch}, DType::I64);
  auto* tok = tokens.data<std::int64_t>();
  auto* tgt = targets.data<std::int64_t>();
  for (std::int64_t b = 0; b < batch; ++b) {
    const auto s = sample(first + b);
    for (std::int64_t j = 0; j < seq_; ++j) {
      tok[j * batch + b] = s[static_cast<std::size_t>(j)];
      tgt[j * batch + b] = s[static_cast<std::size_t>(j + 1)];
    }
  }
}

}  // namespace epx
