// A trainable weight as in Megatron's mixed precision: an FP32 master copy, the copy the kernels
// read (BF16 under bf16, else the master itself) and an FP32 gradient that wgrad accumulates
// into (Megatron's main_grad).
#pragma once

#include <string>

#include "epx/tensor/tensor.hpp"

namespace epx {

struct Param {
  std::string name;
  Tensor master;   // F32
  Tensor compute;  // F32 (same storage as master) or BF16
  Tensor grad;     // F32, accumulated by wgrad, zeroed by the caller
  // A routed expert's weight: split over EP (and ETP), its gradient summed over EDP; every other
  // weight is replicated over the stage's TP x CP x DP ranks.
  bool expert = false;
  // A linear layer's bias: no weight decay (Megatron's `*.bias` rule; the experts' stacked [G, N]
  // biases are TE's per-group 1-D bias<g>).
  bool bias = false;

  Param() = default;
  Param(std::string n, Shape shape, DType compute_dtype)
      : name(std::move(n)), master(shape, DType::F32), grad(shape, DType::F32) {
    compute = compute_dtype == DType::F32 ? master : Tensor(shape, compute_dtype);
  }
  // After the master changed (init, load, optimizer step): refresh the compute copy.
  void refresh() {
    if (compute.raw() != master.raw()) compute.copy_from(master);
  }
  // The compute copy's elements [begin, end) from `from`, those elements' FP32 master (the
  // param's own, or the distributed optimizer's shard of it).
  void refresh(std::int64_t begin, std::int64_t end, const float* from) {
    if (compute.raw() == master.raw()) return;                      // FP32: the master is the copy
    std::uint16_t* c = compute.data<std::uint16_t>() + begin;  // the one other compute dtype
    for (std::int64_t i = 0; i < end - begin; ++i) c[i] = float_to_bf16(from[i]);
  }
};

}  // namespace epx
