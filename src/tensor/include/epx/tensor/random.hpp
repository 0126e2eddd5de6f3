// Counter-based random numbers: value i of stream (seed, stream) is a pure function of the three,
// so initialisation and the router's random logits are the same on any machine, any thread count
// and any rank layout (a rank draws exactly the slice it owns).
#pragma once

#include <cmath>
#include <cstdint>
#include <string_view>

#include "epx/tensor/tensor.hpp"

namespace epx {

inline std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The stream of a named tensor (FNV-1a, the same with any standard library): the same name draws
// the same values on every rank.
inline std::uint64_t stream_of(std::string_view name) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : name) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

class CounterRng {
 public:
  CounterRng(std::uint64_t seed, std::uint64_t stream)
      : key_(splitmix64(seed ^ splitmix64(stream + 0x632be59bd9b4e019ull))) {}
  // Uniform in (0, 1).
  double uniform(std::uint64_t i) const {
    return (static_cast<double>(splitmix64(key_ ^ splitmix64(i)) >> 11) + 0.5) * 0x1.0p-53;
  }
  // Standard normal (Box-Muller on the pair 2i, 2i+1).
  double normal(std::uint64_t i) const {
    const double u1 = uniform(2 * i), u2 = uniform(2 * i + 1);
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

 private:
  std::uint64_t key_;
};

// A tensor of N(0, std) values from stream (seed, stream), rounded to the dtype.
inline Tensor random_normal(Shape shape, DType dtype, std::uint64_t seed, std::uint64_t stream,
                            double std = 1.0) {
  Tensor t(std::move(shape), dtype);
  const CounterRng rng(seed, stream);
  for (std::int64_t i = 0; i < t.numel(); ++i)
    t.set(i, static_cast<float>(std * rng.normal(static_cast<std::uint64_t>(i))));
  return t;
}

}  // namespace epx
