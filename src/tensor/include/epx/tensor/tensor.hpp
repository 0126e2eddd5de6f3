// Tensor: a shape, a dtype and 64-byte aligned, reference-counted storage, plus process-wide
// allocation accounting (the analogue of torch.cuda.memory_allocated / max_memory_allocated,
// which Megatron logs as mem-allocated and mem-max-allocated).
#pragma once

#include <bit>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace epx {

// BF16 and FP32 for data; I64 only for integer outputs (token counts) in tensor files.
enum class DType { F32, BF16, I64 };

std::size_t dtype_size(DType d);
std::string_view dtype_name(DType d);  // safetensors spelling: "F32", "BF16", "I64"

// bfloat16 conversions; float -> bf16 rounds to nearest even, as oneDNN and PyTorch do.
inline float bf16_to_float(std::uint16_t b) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
}
// Branch-free (a select), so loops of conversions vectorise; NaNs stay quiet NaNs.
inline std::uint16_t float_to_bf16(float f) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  const std::uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, nan = (u >> 16) | 0x40u;
  return static_cast<std::uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}
inline float round_to_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

using Shape = std::vector<std::int64_t>;
std::string shape_string(const Shape& s);  // "[4, 8]"

class Tensor {
 public:
  Tensor() = default;
  // Zero-filled storage of the given shape.
  Tensor(Shape shape, DType dtype) : Tensor(std::move(shape), dtype, true) {}
  // Storage left as it is, for a buffer that is written whole before it is read (receive
  // buffers, permutation outputs): it skips the memset.
  static Tensor uninitialized(Shape shape, DType dtype);

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  int rank() const { return static_cast<int>(shape_.size()); }
  std::int64_t dim(int i) const { return shape_.at(static_cast<std::size_t>(i < 0 ? rank() + i : i)); }
  std::int64_t numel() const;
  DType dtype() const { return dtype_; }
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * dtype_size(dtype_); }

  void* raw() { return storage_ ? storage_->data : nullptr; }
  const void* raw() const { return storage_ ? storage_->data : nullptr; }
  // Typed access; throws if the dtype does not match (float: F32, uint16_t: BF16, int64_t: I64).
  template <class T> T* data();
  template <class T> const T* data() const;

  // Element i as float, whatever the float dtype.
  float get(std::int64_t i) const;
  void set(std::int64_t i, float v);

  // Same storage, new shape of the same element count.
  Tensor reshape(Shape shape) const;
  Tensor clone() const;
  // A copy of slice `index` of `parts` equal slices along dim 0 (a rank's share of the sequence).
  Tensor chunk(std::int64_t index, std::int64_t parts) const;
  // A copy in another dtype (F32 <-> BF16); a clone when the dtype is already right.
  Tensor to(DType d) const;
  void fill(float v);
  void zero();
  // Copies values from a tensor of the same element count; converts between F32 and BF16.
  void copy_from(const Tensor& src);

 private:
  struct Storage {
    void* data = nullptr;
    std::size_t bytes = 0, capacity = 0;  // requested; held (rounded for reuse)
    Storage(std::size_t n, bool zeroed);
    ~Storage();
    Storage(const Storage&) = delete;
    Storage& operator=(const Storage&) = delete;
  };
  Tensor(Shape shape, DType dtype, bool zeroed);

  std::shared_ptr<Storage> storage_;
  Shape shape_;
  DType dtype_ = DType::F32;
};

// Process-wide accounting of live tensor storage.
struct MemoryStats {
  std::int64_t allocated_bytes = 0;      // live now
  std::int64_t max_allocated_bytes = 0;  // peak since start or the last reset
};
MemoryStats memory_stats();
void reset_peak_memory();

}  // namespace epx
