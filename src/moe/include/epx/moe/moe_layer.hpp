// The MoE layer (Megatron-Core's MoELayer): shared expert, router, token dispatcher, grouped
// experts, combine. Forward and backward are split into the phases the schedules launch one by
// one (below); forward() and backward() run them in order. Weights live in the layer;
// everything one micro-batch saves for its backward lives in a Context, so several micro-batches
// can be in flight at once. The Context keeps references to the input and output gradient (as
// autograd does): do not change them in place before backward_wgrad has run.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "epx/comm/comm.hpp"
#include "epx/dispatch/dispatcher.hpp"
#include "epx/moe/experts.hpp"
#include "epx/moe/moe_spec.hpp"
#include "epx/moe/router.hpp"
#include "epx/tensor/safetensors.hpp"

namespace epx {

class ProcessGroups;

// How one MoE layer runs in its job, fixed at construction.
struct MoELayerOptions {
  double aux_loss_scale = 1.0;  // gradient scale of the aux and z losses (1 / micro-batches)
  // A repeated MTP layer's 1 / mtp_num_layers: its aux losses' gradient and value, and its
  // z-loss's value, per call (Megatron's router; the z-loss's gradient keeps its scale).
  double aux_loss_share = 1.0;
  std::uint64_t rank = 0;       // picks the random stream under force load balancing
  Communicator* global_aux_group = nullptr;  // the global aux loss's counts sum over it (Router)
  GroupedMlp::Recompute experts_recompute = GroupedMlp::Recompute::none;  // "moe_act"
  GroupedMlp::Recompute shared_recompute = GroupedMlp::Recompute::none;   // "shared_experts"
};

class MoELayer {
 public:
  MoELayer(const MoESpec& spec, std::unique_ptr<TokenDispatcher> dispatcher, const MoELayerOptions& options = {});

  struct Context {
    Shape input_shape;  // [S, B, H] or [T, H]
    Tensor x;           // [T, H] in the compute dtype
    Routing routing;
    DispatchState dispatch;
    GroupedMlp::Saved experts, shared;
    Tensor shared_output;  // until the combine adds it
    // With the shared-expert gate: each token's sigmoid(x . w), the output before it (until the
    // dgrad), and d(loss)/d(x . w) (until the wgrad).
    std::vector<float> shared_gate, shared_gate_dlogit;
    Tensor shared_ungated;
    Tensor dprobs;         // [T, E] F32, during backward_route
    Tensor dy;             // the output gradient, until the shared expert's dgrad
    Tensor dx_shared;      // the shared expert's input gradient, until backward_route
  };

  // x: [S, B, H] (Megatron's order) or [T, H], in the compute dtype. Returns the output in x's shape.
  Tensor forward(const Tensor& x, Context& ctx, bool training = true);
  // dy in the output's shape. Runs the dgrad phases, then wgrad. Returns dx.
  Tensor backward(Context& ctx, const Tensor& dy);

  // The phases, in the vocabulary of the schedule (TransformerLayer's nodes, after Megatron-Core's
  // MoELayer: route = router_and_preprocess, experts = routed_experts_compute, output =
  // postprocess). A phase named launch_* only starts its exchange on the comm stream and returns;
  // the phase after it waits, so a schedule can compute something else in between.
  // Forward:
  //   forward_route     (shared expert), router, permute; `replay`: a recompute (Router::forward)
  //   launch_dispatch   the token dispatch
  //   forward_experts   (shared expert), regroup, the experts, prepare the combine
  //   launch_combine    the token combine
  //   forward_output    unpermute, + the shared expert's output
  // Backward (dgrad), in reverse:
  //   launch_combine_backward   unpermute^T, then the combine's backward exchange
  //   backward_experts          expert dgrad
  //   launch_dispatch_backward  the dispatch's backward exchange
  //   backward_route            permute^T, router + shared expert dgrad; returns dx
  void forward_route(Context& ctx, const Tensor& x, bool training,
                     const RouterReplay* replay = nullptr);
  void launch_dispatch(Context& ctx);
  void forward_experts(Context& ctx);
  void launch_combine(Context& ctx);
  Tensor forward_output(Context& ctx);
  void launch_combine_backward(Context& ctx, const Tensor& dy);
  void backward_experts(Context& ctx);
  void launch_dispatch_backward(Context& ctx);
  Tensor backward_route(Context& ctx);
  // Weight gradients, accumulated into Param::grad: the routed experts' (the filler of the
  // dispatch-backward with delay_wgrad_compute), and the shared expert's and router's.
  void backward_expert_wgrad(Context& ctx);
  void backward_dense_wgrad(Context& ctx);
  void backward_wgrad(Context& ctx) {
    backward_expert_wgrad(ctx);
    backward_dense_wgrad(ctx);
  }
  // Recompute of the norm before the layer ("layernorm" in recompute_modules): drop every
  // reference the context holds to the input after the forward, and give it back (recomputed)
  // before the backward.
  void release_input(Context& ctx);
  void restore_input(Context& ctx, const Tensor& x);

  // Megatron's initialisation from a seed; the same weights on any rank layout.
  void init_weights(std::uint64_t seed);
  std::vector<Param*> params();
  void zero_grad();
  // This rank's tensors by their file names (README), in the file's shapes: FP32 masters, or their
  // gradients ("grad." + name). An expert split over ETP is zero outside this rank's slice.
  TensorMap weight_tensors() const;
  TensorMap grad_tensors() const;
  // Reads this rank's weights (its experts, its ETP slice) from `tensors` of the whole layer (F32
  // or BF16), or throws InputError naming the tensor and file.
  void load_weights(const TensorMap& tensors, const std::string& file);
  // Every tensor name of the whole layer and its file shape.
  static std::map<std::string, Shape> file_shapes(const MoESpec& spec);
  // Collective over groups.world(): grad_tensors() of the whole layer on every rank, each
  // gradient taken from the ranks that own it (moe_layer_file.cpp).
  TensorMap gather_grad_tensors(ProcessGroups& groups) const;

  // Sums the gradients over the ranks that hold the same weights: router and shared expert over
  // `dense` (every rank of the stage: TP x CP x DP), the experts over `expert_dp` (EDP).
  void reduce_gradients(Communicator& dense, Communicator& expert_dp);

  const MoESpec& spec() const { return spec_; }
  TokenDispatcher& dispatcher() { return *dispatcher_; }

  Router router;
  GroupedMlp experts;
  std::optional<GroupedMlp> shared_experts;
  std::optional<Param> shared_gate;  // mlp.shared_experts.gate_weight [1, H] (moe_shared_expert_gate)

 private:
  void forward_shared(Context& ctx);
  void backward_shared(Context& ctx);
  // Every (file name, param, group) of this rank's weights, and its place in the file tensor.
  struct Entry {
    enum class Split { none, rows, gated_rows, cols };  // how ETP splits it: fc1 by rows (each half's, gated), fc2 by columns
    std::string name;
    const Param* param;
    std::int64_t group;  // -1: the whole tensor
    Split split = Split::none;
    int etp_rank = 0, etp_size = 1;

    Shape full_shape() const;
    template <class Fn> void for_each_run(Fn fn) const;
    Tensor to_file(const Tensor& t) const;  // t: the param's master or grad
  };
  std::vector<Entry> entries() const;
  static std::int64_t expert_ffn_shard(const MoESpec& spec, int etp);

  MoESpec spec_;
  MoELayerOptions options_;
  std::unique_ptr<TokenDispatcher> dispatcher_;
};

}  // namespace epx
