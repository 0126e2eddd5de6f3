#include "epx/tensor/tensor.hpp"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <stdexcept>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace epx {
namespace {

constexpr std::size_t kAlignment = 64;  // a cache line; what AVX-512 loads and oneDNN like

std::atomic<std::int64_t> g_allocated{0};
std::atomic<std::int64_t> g_max_allocated{0};

void account(std::int64_t delta) {
  const std::int64_t now = g_allocated.fetch_add(delta) + delta;
  std::int64_t peak = g_max_allocated.load();
  while (now > peak && !g_max_allocated.compare_exchange_weak(peak, now)) {
  }
}

// Large blocks are kept for reuse when freed, as PyTorch's caching allocator does: glibc maps
// blocks above 32 MB afresh and unmaps them on free, so each large activation or communication
// buffer page-faulted anew every step, which cost the dispatcher more than its copies
// (bench/RESULTS.md). A request takes the smallest cached block that fits with at most 25%
// to spare; when the cache is full, the smallest blocks are freed to make room.
class BlockCache {
 public:
  static constexpr std::size_t kMinBytes = 1 << 20, kRound = 2 << 20;
  static constexpr std::size_t kMaxCachedBytes = std::size_t{4} << 30;

  // A block of at least `bytes`; `capacity` receives its real size, for put().
  void* get(std::size_t bytes, std::size_t& capacity) {
    if (bytes < kMinBytes) {
      capacity = std::max(kAlignment, (bytes + kAlignment - 1) / kAlignment * kAlignment);
    } else {
      capacity = (bytes + kRound - 1) / kRound * kRound;
      std::lock_guard lock(mu_);
      if (auto it = free_.lower_bound(capacity); it != free_.end() && it->first <= capacity + capacity / 4) {
        void* p = it->second;
        capacity = it->first;
        cached_ -= capacity;
        free_.erase(it);
        return p;
      }
    }
    void* p = std::aligned_alloc(kAlignment, capacity);
    if (p == nullptr) throw std::bad_alloc();
    return p;
  }
  void put(void* p, std::size_t capacity) {
    if (capacity < kMinBytes || capacity > kMaxCachedBytes) return std::free(p);
    std::lock_guard lock(mu_);
    while (cached_ + capacity > kMaxCachedBytes) {
      std::free(free_.begin()->second);
      cached_ -= free_.begin()->first;
      free_.erase(free_.begin());
    }
    free_.emplace(capacity, p);
    cached_ += capacity;
  }

 private:
  std::mutex mu_;
  std::multimap<std::size_t, void*> free_;
  std::size_t cached_ = 0;
};
BlockCache& block_cache() {
  static auto* cache = new BlockCache;  // never destroyed: tensors may outlive static destructors
  return *cache;
}

template <class T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::F32; }
template <> constexpr DType dtype_of<std::uint16_t>() { return DType::BF16; }
template <> constexpr DType dtype_of<std::int64_t>() { return DType::I64; }

}  // namespace

std::size_t dtype_size(DType d) {
  switch (d) {
    case DType::F32: return 4;
    case DType::BF16: return 2;
    case DType::I64: return 8;
  }
  return 0;
}

std::string_view dtype_name(DType d) {
  switch (d) {
    case DType::F32: return "F32";
    case DType::BF16: return "BF16";
    case DType::I64: return "I64";
  }
  return "?";
}

std::string shape_string(const Shape& s) { return fmt::format("[{}]", fmt::join(s, ", ")); }

Tensor::Storage::Storage(std::size_t n, bool zeroed) : bytes(n) {
  data = block_cache().get(n, capacity);
  if (zeroed) std::memset(data, 0, n);
  account(static_cast<std::int64_t>(bytes));
}

Tensor::Storage::~Storage() {
  block_cache().put(data, capacity);
  account(-static_cast<std::int64_t>(bytes));
}

Tensor Tensor::uninitialized(Shape shape, DType dtype) { return Tensor(std::move(shape), dtype, false); }

Tensor::Tensor(Shape shape, DType dtype, bool zeroed) : shape_(std::move(shape)), dtype_(dtype) {
  std::int64_t n = 1;
  for (auto d : shape_)
    if (d < 0 || (d > 0 && __builtin_mul_overflow(n, d, &n)))
      throw std::invalid_argument("invalid shape " + shape_string(shape_));
  if (std::any_of(shape_.begin(), shape_.end(), [](std::int64_t d) { return d == 0; })) n = 0;
  storage_ = std::make_shared<Storage>(static_cast<std::size_t>(n) * dtype_size(dtype), zeroed);
}

std::int64_t Tensor::numel() const {
  if (!storage_) return 0;
  std::int64_t n = 1;
  for (auto d : shape_) n *= d;
  return n;
}

template <class T> T* Tensor::data() {
  if (dtype_ != dtype_of<T>())
    throw std::logic_error(fmt::format("tensor is {}, accessed as {}", dtype_name(dtype_),
                                       dtype_name(dtype_of<T>())));
  return static_cast<T*>(raw());
}
template <class T> const T* Tensor::data() const { return const_cast<Tensor*>(this)->data<T>(); }
template float* Tensor::data<float>();
template std::uint16_t* Tensor::data<std::uint16_t>();
template std::int64_t* Tensor::data<std::int64_t>();
template const float* Tensor::data<float>() const;
template const std::uint16_t* Tensor::data<std::uint16_t>() const;
template const std::int64_t* Tensor::data<std::int64_t>() const;

float Tensor::get(std::int64_t i) const {
  switch (dtype_) {
    case DType::F32: return static_cast<const float*>(raw())[i];
    case DType::BF16: return bf16_to_float(static_cast<const std::uint16_t*>(raw())[i]);
    case DType::I64: return static_cast<float>(static_cast<const std::int64_t*>(raw())[i]);
  }
  return 0.f;
}

void Tensor::set(std::int64_t i, float v) {
  switch (dtype_) {
    case DType::F32: static_cast<float*>(raw())[i] = v; break;
    case DType::BF16: static_cast<std::uint16_t*>(raw())[i] = float_to_bf16(v); break;
    case DType::I64: static_cast<std::int64_t*>(raw())[i] = static_cast<std::int64_t>(v); break;
  }
}

Tensor Tensor::reshape(Shape shape) const {
  Tensor t = *this;
  t.shape_ = std::move(shape);
  if (t.numel() != numel())
    throw std::invalid_argument(fmt::format("cannot reshape {} to {}", shape_string(shape_),
                                            shape_string(t.shape_)));
  return t;
}

Tensor Tensor::clone() const {
  Tensor t = uninitialized(shape_, dtype_);
  std::memcpy(t.raw(), raw(), nbytes());
  return t;
}

Tensor Tensor::chunk(std::int64_t index, std::int64_t parts) const {
  if (rank() == 0 || parts < 1 || dim(0) % parts != 0 || index < 0 || index >= parts)
    throw std::invalid_argument(fmt::format("chunk {} of {} along dim 0 of {}", index, parts, shape_string(shape_)));
  Shape s = shape_;
  s[0] /= parts;
  Tensor t = uninitialized(s, dtype_);
  std::memcpy(t.raw(), static_cast<const char*>(raw()) + t.nbytes() * static_cast<std::size_t>(index), t.nbytes());
  return t;
}

Tensor Tensor::to(DType d) const {
  if (d == dtype_) return clone();
  Tensor t = uninitialized(shape_, d);
  t.copy_from(*this);
  return t;
}

void Tensor::fill(float v) {
  for (std::int64_t i = 0, n = numel(); i < n; ++i) set(i, v);
}

void Tensor::zero() { std::memset(raw(), 0, nbytes()); }

void Tensor::copy_from(const Tensor& src) {
  if (src.numel() != numel())
    throw std::invalid_argument(fmt::format("copy of {} into {}", shape_string(src.shape_),
                                            shape_string(shape_)));
  if (src.dtype_ == dtype_) {
    std::memcpy(raw(), src.raw(), nbytes());
    return;
  }
  const std::int64_t n = numel();
  if (src.dtype_ == DType::F32 && dtype_ == DType::BF16) {
    const float* s = src.data<float>();
    std::uint16_t* d = data<std::uint16_t>();
    for (std::int64_t i = 0; i < n; ++i) d[i] = float_to_bf16(s[i]);
  } else if (src.dtype_ == DType::BF16 && dtype_ == DType::F32) {
    const std::uint16_t* s = src.data<std::uint16_t>();
    float* d = data<float>();
    for (std::int64_t i = 0; i < n; ++i) d[i] = bf16_to_float(s[i]);
  } else {
    for (std::int64_t i = 0; i < n; ++i) set(i, src.get(i));
  }
}

MemoryStats memory_stats() { return {g_allocated.load(), g_max_allocated.load()}; }

void reset_peak_memory() { g_max_allocated.store(g_allocated.load()); }

}  // namespace epx
