#include "epx/moe_layer.hpp"

#include <cmath>
#include <algorithm>
#include <stdexcept>

#include <fmt/format.h>

#include "epx/config.hpp"
#include "epx/error.hpp"
#include "epx/kernels.hpp"
#include "epx/random.hpp"

namespace epx {
namespace {

// The FP32 elements of matrix `group` (-1: all) of a master or grad tensor, and its shape.
std::pair<float*, Shape> slice(const Tensor& t, std::int64_t group) {
  auto* base = static_cast<float*>(const_cast<void*>(t.raw()));
  if (group < 0) return {base, t.shape()};
  const Shape s{t.dim(1), t.dim(2)};
  return {base + group * s[0] * s[1], s};
}

}  // namespace

// Where this rank's matrix sits in the file tensor of the whole layer. Expert tensor parallelism
// splits fc1 [2F, H] by rows (rank t keeps rows [t*f, (t+1)*f) of gate and the same of up) and
// fc2 [H, F] by columns [t*f, (t+1)*f), as Megatron's column- and row-parallel linears.
Shape MoELayer::Entry::full_shape() const {
  Shape s = slice(param->master, group).second;
  if (split == Split::rows) s[0] *= etp_size;
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
    if (split == Split::rows) {
      const std::int64_t half = rows / 2;  // f rows of gate, then f of up
      row = i < half ? etp_rank * half + i : half * etp_size + etp_rank * half + (i - half);
    }
    if (split == Split::cols) col0 = etp_rank * cols;
    fn(i * cols, row * full_cols + col0, cols);
  }
}

std::int64_t MoELayer::expert_ffn_shard(const MoESpec& spec, int etp) {
  if (spec.ffn % etp != 0)
    throw ConfigError(fmt::format(
        "model.moe_ffn_hidden_size = {} is not divisible by model.expert_tensor_parallel_size = {}: "
        "each ETP rank holds an equal slice of every expert's FFN",
        spec.ffn, etp));
  return spec.ffn / etp;
}

MoELayer::MoELayer(const MoESpec& spec, std::unique_ptr<TokenDispatcher> dispatcher)
    : router(spec),
      experts("mlp.experts", dispatcher->num_local_experts(), spec.hidden,
              expert_ffn_shard(spec, dispatcher->expert_tp_size()), spec.dtype, true),
      spec_(spec),
      dispatcher_(std::move(dispatcher)) {
  if (spec.shared_ffn > 0)
    shared_experts.emplace("mlp.shared_experts", 1, spec.hidden, spec.shared_ffn, spec.dtype, false);
}

std::vector<MoELayer::Entry> MoELayer::entries() const {
  std::vector<Entry> out{{router.weight.name, &router.weight, -1}};
  const std::int64_t first = dispatcher_->first_local_expert();
  const int t = dispatcher_->expert_tp_rank(), etp = dispatcher_->expert_tp_size();
  for (std::int64_t g = 0; g < experts.groups(); ++g) {
    out.push_back({experts.tensor_name(experts.fc1, first + g), &experts.fc1, g, Entry::Split::rows, t, etp});
    out.push_back({experts.tensor_name(experts.fc2, first + g), &experts.fc2, g, Entry::Split::cols, t, etp});
  }
  if (shared_experts)
    for (const Param* p : {&shared_experts->fc1, &shared_experts->fc2})
      out.push_back({shared_experts->tensor_name(*p, 0), p, 0});
  return out;
}

std::map<std::string, Shape> MoELayer::file_shapes(const MoESpec& spec) {
  std::map<std::string, Shape> out{{"mlp.router.weight", {spec.num_experts, spec.hidden}}};
  for (std::int64_t e = 0; e < spec.num_experts; ++e) {
    out[fmt::format("mlp.experts.linear_fc1.weight{}", e)] = {2 * spec.ffn, spec.hidden};
    out[fmt::format("mlp.experts.linear_fc2.weight{}", e)] = {spec.hidden, spec.ffn};
  }
  if (spec.shared_ffn > 0) {
    out["mlp.shared_experts.linear_fc1.weight"] = {2 * spec.shared_ffn, spec.hidden};
    out["mlp.shared_experts.linear_fc2.weight"] = {spec.hidden, spec.shared_ffn};
  }
  return out;
}

void MoELayer::reduce_gradients(Communicator& dense, Communicator& expert_dp) {
  for (Param* p : params()) {
    const bool expert = p == &experts.fc1 || p == &experts.fc2;
    (expert ? expert_dp : dense).allreduce(p->grad.raw(), p->grad.numel(), DType::F32);
  }
}

std::vector<Param*> MoELayer::params() {
  std::vector<Param*> out{&router.weight, &experts.fc1, &experts.fc2};
  if (shared_experts) {
    out.push_back(&shared_experts->fc1);
    out.push_back(&shared_experts->fc2);
  }
  return out;
}

void MoELayer::zero_grad() {
  for (Param* p : params()) p->grad.zero();
}

void MoELayer::init_weights(std::uint64_t seed) {
  // Megatron: N(0, init_method_std), and N(0, std / sqrt(2 * num_layers)) for the output
  // projections (fc2), which feed the residual stream.
  for (const Entry& e : entries()) {
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
  return out;
}

TensorMap MoELayer::grad_tensors() const {
  TensorMap out;
  for (const Entry& e : entries()) out.emplace("grad." + e.name, e.to_file(e.param->grad));
  return out;
}

void MoELayer::load_weights(const TensorMap& tensors, const std::string& file) {
  for (const Entry& e : entries()) {
    const Tensor f32 = expect_tensor(tensors, e.name, e.full_shape(), file).to(DType::F32);
    const float* src = f32.data<float>();
    float* dst = slice(e.param->master, e.group).first;
    e.for_each_run([&](std::int64_t local, std::int64_t full, std::int64_t n) {
      std::copy_n(src + full, n, dst + local);
    });
  }
  if (spec_.expert_bias)
    router.expert_bias.copy_from(
        expect_tensor(tensors, "mlp.router.expert_bias", {spec_.num_experts}, file).to(DType::F32));
  for (Param* p : params()) p->refresh();
}

// ------------------------------------------------------------------------------- forward

void MoELayer::forward_route(Context& ctx, const Tensor& x, bool training,
                             std::optional<std::uint64_t> replay_draw) {
  if (x.dtype() != spec_.dtype)
    throw InputError(fmt::format("MoE layer input is {}, the layer computes in {} (model.bf16)",
                                 dtype_name(x.dtype()), dtype_name(spec_.dtype)));
  if ((x.rank() != 2 && x.rank() != 3) || x.dim(-1) != spec_.hidden)
    throw InputError(fmt::format("MoE layer input has shape {}; expected [S, B, {}] or [T, {}]",
                                 shape_string(x.shape()), spec_.hidden, spec_.hidden));
  ctx.input_shape = x.shape();
  const std::int64_t seq = x.dim(0);  // S of [S, B, H]; T of [T, H] (one sequence)
  ctx.x = x.reshape({x.numel() / spec_.hidden, spec_.hidden});
  // Megatron computes the shared expert first, on the main stream, when it is not overlapped.
  if (shared_experts && !spec_.shared_expert_overlap) forward_shared(ctx);
  ctx.routing = router.forward(ctx.x, seq, training, aux_loss_scale, rank, replay_draw);
  dispatcher_->dispatch_preprocess(ctx.dispatch, ctx.x, ctx.routing);
}

void MoELayer::forward_shared(Context& ctx) {
  ctx.shared_output = shared_experts->forward(ctx.x, {ctx.x.dim(0)}, {}, ctx.shared);
}

void MoELayer::forward_dispatch(Context& ctx) { dispatcher_->token_dispatch(ctx.dispatch); }

void MoELayer::forward_experts(Context& ctx) {
  if (shared_experts && spec_.shared_expert_overlap) forward_shared(ctx);  // while the dispatch flies
  DispatchState& d = ctx.dispatch;
  dispatcher_->dispatch_postprocess(d);
  Tensor y = experts.forward(d.hidden, d.tokens_per_local_expert, std::move(d.probs), ctx.experts);
  d.hidden = Tensor();
  dispatcher_->combine_preprocess(d, std::move(y));
}

void MoELayer::forward_combine(Context& ctx) { dispatcher_->token_combine(ctx.dispatch); }

Tensor MoELayer::forward_output(Context& ctx) {
  Tensor out = dispatcher_->combine_postprocess(ctx.dispatch);
  if (shared_experts) {
    // Routed + shared summed in FP32, rounded once to the layer's dtype.
    add(out, ctx.shared_output, out);
    ctx.shared_output = Tensor();
  }
  return out.reshape(ctx.input_shape);
}

Tensor MoELayer::forward(const Tensor& x, Context& ctx, bool training) {
  forward_route(ctx, x, training);
  forward_dispatch(ctx);
  forward_experts(ctx);
  forward_combine(ctx);
  return forward_output(ctx);
}

void MoELayer::release_input(Context& ctx) {
  ctx.x = Tensor();
  ctx.shared.x = Tensor();
}

void MoELayer::restore_input(Context& ctx, const Tensor& x) {
  ctx.x = x.reshape({x.numel() / spec_.hidden, spec_.hidden});
  if (shared_experts) ctx.shared.x = ctx.x;
}

// ------------------------------------------------------------------------------ backward

void MoELayer::backward_combine(Context& ctx, const Tensor& dy) {
  if (dy.shape() != ctx.input_shape)
    throw InputError(fmt::format("output gradient has shape {}; the output is {}",
                                 shape_string(dy.shape()), shape_string(ctx.input_shape)));
  const Tensor g = (dy.dtype() == spec_.dtype ? dy : dy.to(spec_.dtype)).reshape(ctx.x.shape());
  dispatcher_->combine_postprocess_backward(ctx.dispatch, g);
  dispatcher_->token_combine_backward(ctx.dispatch);
  if (shared_experts) {
    ctx.dy = g;
    if (spec_.shared_expert_overlap) backward_shared(ctx);  // while the combine-backward flies
  }
}

void MoELayer::backward_shared(Context& ctx) {
  ctx.dx_shared = shared_experts->backward_dgrad(ctx.shared, ctx.dy, nullptr);
  ctx.dy = Tensor();
}

void MoELayer::backward_experts(Context& ctx) {
  DispatchState& d = ctx.dispatch;
  dispatcher_->combine_preprocess_backward(d);
  std::vector<float> dprobs;
  Tensor dx = experts.backward_dgrad(ctx.experts, d.grad, &dprobs);
  d.grad = Tensor();
  dispatcher_->dispatch_postprocess_backward(d, std::move(dx), std::move(dprobs));
}

void MoELayer::backward_dispatch(Context& ctx) { dispatcher_->token_dispatch_backward(ctx.dispatch); }

Tensor MoELayer::backward_route(Context& ctx) {
  ctx.dprobs = Tensor({ctx.x.dim(0), spec_.num_experts}, DType::F32);
  Tensor dx = dispatcher_->dispatch_preprocess_backward(ctx.dispatch, ctx.dprobs);
  // Not overlapped, Megatron's autograd reaches the shared expert after the routed path.
  if (shared_experts && !spec_.shared_expert_overlap) backward_shared(ctx);
  const Tensor dx_router = router.backward_dgrad(ctx.routing, ctx.dprobs, DType::F32);
  // dx = dispatch path + router path (+ shared expert), summed in FP32, rounded once.
  for (std::int64_t i = 0, n = dx.numel(); i < n; ++i) {
    float v = dx.get(i) + dx_router.get(i);
    if (shared_experts) v += ctx.dx_shared.get(i);
    dx.set(i, v);
  }
  ctx.dx_shared = Tensor();
  ctx.dprobs = Tensor();
  return dx.reshape(ctx.input_shape);
}

void MoELayer::backward_expert_wgrad(Context& ctx) { experts.backward_wgrad(ctx.experts); }

void MoELayer::backward_dense_wgrad(Context& ctx) {
  if (shared_experts) shared_experts->backward_wgrad(ctx.shared);
  router.backward_wgrad(ctx.routing);
}

Tensor MoELayer::backward(Context& ctx, const Tensor& dy) {
  backward_combine(ctx, dy);
  backward_experts(ctx);
  backward_dispatch(ctx);
  Tensor dx = backward_route(ctx);
  backward_wgrad(ctx);
  return dx;
}

}  // namespace epx
