// The MoE layer's weight-file layout (README: tensor layout): every tensor of the whole layer by
// name, and where this rank's experts and ETP slice sit in it. Initialisation draws each element
// by its index in the file tensor, so any rank layout holds the same weights as one rank.
#include <algorithm>
#include <cmath>
#include <set>

#include <fmt/format.h>

#include "epx/base/error.hpp"
#include "epx/comm/process_groups.hpp"
#include "epx/moe/moe_layer.hpp"
#include "epx/tensor/random.hpp"

namespace epx {
namespace {

// The FP32 elements of group `group`'s matrix (or bias row) of a stacked [G, ...] master or grad
// tensor (-1: all of it), and its shape.
std::pair<float*, Shape> slice(const Tensor& t, std::int64_t group) {
  auto* base = static_cast<float*>(const_cast<void*>(t.raw()));
  if (group < 0) return {base, t.shape()};
  const Shape s(t.shape().begin() + 1, t.shape().end());
  return {base + group * (t.numel() / t.dim(0)), s};
}

// The config field that decides whether a layer file holds tensor `name`, where one does.
const char* field_giving(const std::string& name) {
  if (name.find(".bias") != std::string::npos) return "model.add_bias_linear";
  if (name == "mlp.shared_experts.gate_weight") return "model.moe_shared_expert_gate";
  if (name.starts_with("mlp.shared_experts.")) return "model.moe_shared_expert_intermediate_size";
  return nullptr;
}

}  // namespace

// Where this rank's matrix sits in the file tensor of the whole layer. Expert tensor parallelism
// splits fc1 [2F, H] by rows (rank t keeps rows [t*f, (t+1)*f) of gate and the same of up; fc1
// [F, H] of an ungated unit rows [t*f, (t+1)*f)) and fc2 [H, F] by columns [t*f, (t+1)*f), as
// Megatron's column- and row-parallel linears.
Shape MoELayer::Entry::full_shape() const {
  Shape s = slice(param->master, group).second;
  if (split == Split::rows || split == Split::gated_rows) s[0] *= etp_size;
  if (split == Split::cols) s[1] *= etp_size;
  return s;
}

// Calls fn(local offset, full offset, n) for each contiguous run of the local matrix.
template <class Fn>
void MoELayer::Entry::for_each_run(Fn fn) const {
  const Shape local = slice(param->master, group).second;
  const std::int64_t rows = local[0], cols = local.size() > 1 ? local[1] : 1;
  const Shape full = full_shape();
  const std::int64_t full_cols = full.size() > 1 ? full[1] : 1;
  for (std::int64_t i = 0; i < rows; ++i) {
    std::int64_t row = i, col0 = 0;
    if (split == Split::rows) row = etp_rank * rows + i;
    if (split == Split::gated_rows) {
      const std::int64_t half = rows / 2;  // f rows of gate, then f of up
      row = i < half ? etp_rank * half + i : half * etp_size + etp_rank * half + (i - half);
    }
    if (split == Split::cols) col0 = etp_rank * cols;
    fn(i * cols, row * full_cols + col0, cols);
  }
}

std::vector<MoELayer::Entry> MoELayer::entries() const {
  std::vector<Entry> out{{router.weight.name, &router.weight, -1}};
  if (spec_.bias) out.push_back({router.bias.name, &router.bias, -1});
  const std::int64_t first = dispatcher_->first_local_expert();
  const int t = dispatcher_->expert_tp_rank(), etp = dispatcher_->expert_tp_size();
  const auto fc1_split = spec_.activation.gated ? Entry::Split::gated_rows : Entry::Split::rows;
  for (std::int64_t g = 0; g < experts.groups(); ++g) {
    out.push_back({experts.tensor_name(experts.fc1, first + g), &experts.fc1, g, fc1_split, t, etp});
    out.push_back({experts.tensor_name(experts.fc2, first + g), &experts.fc2, g, Entry::Split::cols, t, etp});
    if (experts.has_bias())  // biases only at ETP 1 (moe.bias_needs_etp1): not split
      for (const Param* p : {&experts.fc1_bias, &experts.fc2_bias}) out.push_back({experts.tensor_name(*p, first + g), p, g});
  }
  if (shared_experts)
    for (const Param* p : {&shared_experts->fc1, &shared_experts->fc2})
      out.push_back({shared_experts->tensor_name(*p, 0), p, 0});
  if (shared_gate) out.push_back({shared_gate->name, &*shared_gate, -1});
  return out;
}

std::map<std::string, Shape> MoELayer::file_shapes(const MoESpec& spec) {
  std::map<std::string, Shape> out{{"mlp.router.weight", {spec.num_experts, spec.hidden}}};
  if (spec.bias) out["mlp.router.bias"] = {spec.num_experts};
  for (std::int64_t e = 0; e < spec.num_experts; ++e) {
    out[fmt::format("mlp.experts.linear_fc1.weight{}", e)] = {spec.activation.fc1_width(spec.ffn), spec.hidden};
    out[fmt::format("mlp.experts.linear_fc2.weight{}", e)] = {spec.hidden, spec.ffn};
    if (spec.bias) {
      out[fmt::format("mlp.experts.linear_fc1.bias{}", e)] = {spec.activation.fc1_width(spec.ffn)};
      out[fmt::format("mlp.experts.linear_fc2.bias{}", e)] = {spec.hidden};
    }
  }
  if (spec.shared_ffn > 0) {
    out["mlp.shared_experts.linear_fc1.weight"] = {spec.activation.fc1_width(spec.shared_ffn), spec.hidden};
    out["mlp.shared_experts.linear_fc2.weight"] = {spec.hidden, spec.shared_ffn};
    if (spec.shared_expert_gate) out["mlp.shared_experts.gate_weight"] = {1, spec.hidden};
  }
  return out;
}

void MoELayer::init_weights(std::uint64_t seed) {
  // Megatron: N(0, init_method_std), and N(0, std / sqrt(2 * num_layers)) for the output
  // projections (fc2), which feed the residual stream.
  for (const Entry& e : entries()) {
    if (e.param->bias && e.param != &router.bias) {  // Megatron zeroes the linears' biases, draws the router's
      e.for_each_run([&](std::int64_t local, std::int64_t, std::int64_t n) {
        std::fill_n(slice(e.param->master, e.group).first + local, n, 0.f);
      });
      continue;
    }
    const bool output_layer = e.param->name.find("linear_fc2") != std::string::npos;
    const double std = spec_.init_std / (output_layer ? std::sqrt(2.0 * spec_.num_layers) : 1.0);
    const CounterRng rng(seed, stream_of(e.name));
    float* data = slice(e.param->master, e.group).first;
    // Drawn by the element's index in the file tensor: the same weights on any ETP layout.
    e.for_each_run([&](std::int64_t local, std::int64_t full, std::int64_t n) {
      for (std::int64_t i = 0; i < n; ++i)
        data[local + i] = static_cast<float>(std * rng.normal(static_cast<std::uint64_t>(full + i)));
    });
  }
  router.expert_bias.zero();
  router.qb_beta.zero();
  for (Param* p : params()) p->refresh();
}

Tensor MoELayer::Entry::to_file(const Tensor& t) const {
  Tensor out(full_shape(), DType::F32);
  const float* src = slice(t, group).first;
  auto* dst = out.data<float>();
  for_each_run([&](std::int64_t local, std::int64_t full, std::int64_t n) {
    std::copy_n(src + local, n, dst + full);
  });
  return out;
}

TensorMap MoELayer::weight_tensors() const {
  TensorMap out;
  for (const Entry& e : entries()) out.emplace(e.name, e.to_file(e.param->master));
  if (spec_.expert_bias) out.emplace("mlp.router.expert_bias", router.expert_bias.clone());
  if (spec_.quantile_balancing) out.emplace("mlp.router.qb_beta", router.qb_beta.clone());
  return out;
}

TensorMap MoELayer::grad_tensors() const {
  TensorMap out;
  for (const Entry& e : entries()) out.emplace("grad." + e.name, e.to_file(e.param->grad));
  return out;
}

void MoELayer::load_weights(const TensorMap& tensors, const std::string& file) {
  // A tensor the layer has no place for: the file was written for another config (an expert
  // bias, a shared expert), whose weights would be dropped in silence.
  std::set<std::string> known;  // the whole layer's, whatever this rank holds
  for (const auto& [name, shape] : file_shapes(spec_)) known.insert(name);
  if (spec_.expert_bias) known.insert("mlp.router.expert_bias");
  if (spec_.quantile_balancing) known.insert("mlp.router.qb_beta");
  for (const auto& [name, t] : tensors)
    if (!known.count(name)) {
      const char* field = field_giving(name);
      throw InputError(fmt::format("{}: tensor '{}' is not a weight of this layer ({} of them, e.g. '{}'); the file "
                                   "was written for another config, or set the config it was written with{}",
                                   file, name, known.size(), *known.begin(),
                                   field ? fmt::format(" ({} gives it)", field) : ""));
    }
  for (const Entry& e : entries()) {
    // fc1 twice or half this config's width: written with the other gated_linear_unit.
    const auto it = tensors.find(e.name);
    const Shape want = e.full_shape();
    if (const char* field = field_giving(e.name); it == tensors.end() && field)
      throw InputError(fmt::format("{}: tensor '{}' is missing, which this config's {} gives the layer: the file was "
                                   "written with another {}; set the config it was written with",
                                   file, e.name, field, field));
    if (e.name.find("linear_fc1.weight") != std::string::npos && it != tensors.end() && it->second.rank() == 2 &&
        it->second.dim(1) == want[1] && it->second.dim(0) == (spec_.activation.gated ? want[0] / 2 : want[0] * 2))
      throw InputError(fmt::format("{}: tensor '{}' has shape {}, this config's fc1 is {}: the file was written with "
                                   "model.gated_linear_unit={} (fc1 is [2F, H] gated, [F, H] not); set the config it "
                                   "was written with",
                                   file, e.name, shape_string(it->second.shape()), shape_string(want),
                                   !spec_.activation.gated));
    const Tensor f32 = expect_tensor(tensors, e.name, want, file).to(DType::F32);
    const float* src = f32.data<float>();
    float* dst = slice(e.param->master, e.group).first;
    e.for_each_run([&](std::int64_t local, std::int64_t full, std::int64_t n) {
      std::copy_n(src + full, n, dst + local);
    });
  }
  if (spec_.expert_bias)
    router.expert_bias.copy_from(
        expect_tensor(tensors, "mlp.router.expert_bias", {spec_.num_experts}, file).to(DType::F32));
  if (spec_.quantile_balancing)  // a buffer Megatron keeps in the state dict, as the expert bias
    router.qb_beta.copy_from(expect_tensor(tensors, "mlp.router.qb_beta", {spec_.num_experts}, file).to(DType::F32));
  for (Param* p : params()) p->refresh();
}

TensorMap MoELayer::gather_grad_tensors(ProcessGroups& groups) const {
  // Each gradient from one owner: world rank 0 for the weights every rank holds, EDP rank 0 for
  // each expert slice; zeros elsewhere, summed over the world.
  Communicator& world = groups.world();
  const bool expert_owner = groups.get(GroupKind::edp).rank() == 0;
  const TensorMap mine = grad_tensors();
  std::map<std::string, bool> is_expert;
  for (const Entry& e : entries()) is_expert["grad." + e.name] = e.param->expert;
  TensorMap out;
  for (const auto& [name, shape] : file_shapes(spec_)) {
    const std::string key = "grad." + name;
    const auto it = mine.find(key);
    const bool owner = it != mine.end() && (is_expert[key] ? expert_owner : world.rank() == 0);
    Tensor g = owner ? it->second.clone() : Tensor(shape, DType::F32);
    world.allreduce(g.raw(), g.numel(), DType::F32);
    out.emplace(key, g);
  }
  return out;
}

}  // namespace epx
