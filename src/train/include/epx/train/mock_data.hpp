// Mock pretraining data (Megatron's mock dataset with a NullTokenizer): token streams that are a
// pure function of (seed, sample index), so any rank layout reads the same global batch.
//   random:  uniform tokens; the loss can only fall to log(vocab).
//   pattern: every sample walks one fixed random cycle of `period` distinct tokens from a random
//            start; the next token follows from the current one, so a model that learns drives
//            the loss towards 0 (a check that training really works).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "epx/tensor/tensor.hpp"

namespace epx {

class MockData {
 public:
  enum class Mode { random, pattern };
  static Mode parse_mode(const std::string& name);  // "random" | "pattern", else InputError

  MockData(Mode mode, std::int64_t vocab, std::int64_t seq_length, std::uint64_t seed, std::int64_t period = 64);

  // seq_length + 1 tokens of sample `index`.
  std::vector<std::int64_t> sample(std::int64_t index) const;
  // Inputs and next-token targets [S * B] in Megatron's [S, B] order for samples first .. first+B-1.
  void micro_batch(std::int64_t first, std::int64_t batch, Tensor& tokens, Tensor& targets) const;

 private:
  Mode mode_;
  std::int64_t vocab_, seq_;
  std::uint64_t seed_;
  std::vector<std::int64_t> cycle_;
};

}  // namespace epx
