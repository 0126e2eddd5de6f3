// Megatron-Core's DistributedDataParallel gradient reduction on epx's ranks: gradients summed
// over DP (dense weights) and EDP (routed experts) in flat buckets on the comm stream, FP32 or,
// for a BF16 model without ddp.grad_reduce_in_fp32, BF16 (half the bytes, as Megatron sends). With
// ddp.overlap_grad_reduce a bucket starts as soon as the last micro-batch's backward has completed
// every weight in it (buckets follow the backward's order: head, layers last to first,
// embedding; GPTModel::grad_groups), so the reductions run under the rest of the backward.
// Without it, the buckets are reduced after the backward: one per kind (dense, expert) in the
// model's parameter order (the reduction epx always did), or with ddp.bucket_size as above. With the distributed optimizer each bucket is
// reduce-scattered instead: this rank keeps the sum of its shard (1/d of the bucket, Megatron's
// contiguous split), Adam steps that shard alone, and gather_params all-gathers the updated
// weights (with ddp.overlap_param_gather, in the background until the next forward needs them)
// as Megatron does, in the weights' compute dtype: a BF16 weight's BF16 copy (half the bytes of
// its FP32 master, which only the owner keeps, in Adam), an FP32 one (norms, the router) as is.
//
// With ddp.reduce_embedding_rows (epx's own) the embedding has a bucket of its own, reduced in
// two parts: the sum of the micro-batches before the last as soon as it is complete (so under the
// last micro-batch, not after it), and the last micro-batch's gradient as what it is, a gradient
// row per token, all-gathered over DP and added in rank order. Megatron reduces the whole table
// after the backward: on a large vocabulary the last bucket to start and the longest. The sum is
// the same up to rounding (the rows are added in FP32, not summed in the buckets' dtype).
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "epx/comm/comm.hpp"
#include "epx/comm/comm_stream.hpp"
#include "epx/tensor/param.hpp"
#include "epx/train/job_spec.hpp"
#include "epx/train/optimizer.hpp"

namespace epx {

class GradReducer {
 public:
  // `groups`: every model chunk's GPTModel::grad_groups(), chunk after chunk, and each group's
  // chunk; `params`: their params() (the order without overlap); `embedding_group`: the group
  // holding the token embedding alone, or -1 where this rank has none; `shared_embedding`: this
  // rank's GPTModel::shared_embedding(), or null.
  GradReducer(const std::vector<std::vector<Param*>>& groups, std::vector<int> group_chunk,
              const std::vector<Param*>& params, Communicator& dp, Communicator& edp, CommStream& stream,
              const GradReduceOptions& options, int embedding_group = -1, Param* shared_embedding = nullptr);
  ~GradReducer();
  GradReducer(const GradReducer&) = delete;
  GradReducer& operator=(const GradReducer&) = delete;

  // An iteration of `micro_batches` micro-batches begins.
  void start(int micro_batches);
  // The model's hook: group `group` of the micro-batch being run backward is complete. On the
  // last micro-batch (with overlap), every bucket this completes is launched.
  void grads_ready(int group);
  // The model's embedding backward, before it scatter-adds `dx` [T, H] into the embedding's
  // gradient at the rows `tokens` [T]: with ddp.reduce_embedding_rows, on the last of two or more
  // micro-batches, takes them instead (all-gathered over DP, added in finish) and returns true.
  bool take_embedding_rows(const Tensor& tokens, const Tensor& dx);
  // Launches the buckets not launched yet, waits for all, and leaves each gradient as its sum
  // over the group times `scale` (distributed: in this rank's shard; zero elsewhere).
  // `final_grads`, if set, gets each bucket's params once their gradients are final, the buckets
  // already reduced first: the caller's work on them (the norm's sums of squares) runs while the
  // last buckets are still in flight.
  void finish(float scale, const std::function<void(const std::vector<Param*>&)>& final_grads = {});
  // After finish: the shared embedding's gradient summed with its copies' over `stages` (the
  // ranks of this pipeline that hold one; Megatron's _allreduce_word_embedding_grads), in FP32.
  // With the distributed optimizer the shared embedding is a bucket of its own on every such
  // stage (as Megatron buckets a shared_embedding param), so all hold the same shard of it: only
  // that is summed.
  void sum_shared_embedding(Communicator& stages);
  // Distributed optimizer: the params' elements in this rank's shards (for Adam), and, after
  // the step, every bucket's weights all-gathered from their owners.
  std::vector<ParamRange> owned_ranges() const;
  // With `overlap` (ddp.overlap_param_gather) the all-gathers are only started here, each bucket
  // on the comm stream, and params_needed(group) completes those holding the group's weights
  // when the next forward first needs them; finish_param_gathers completes the rest.
  void gather_params(bool overlap = false);
  void params_needed(int group);
  void finish_param_gathers();

  struct Bucket {
    std::vector<Param*> params;
    Communicator* comm = nullptr;
    bool expert = false;  // reduced over EDP, else DP
    int first_group = 0, last_group = 0;  // the bucket is complete when these groups all are
    std::int64_t size = 0;                   // elements
    std::vector<std::int64_t> shard_counts;  // per rank of comm (distributed)
    std::int64_t shard_begin = 0, shard_end = 0;  // this rank's: shard_of(comm->rank())
    // Rank r's shard of the flat bucket, [first, end): Megatron's contiguous split.
    std::pair<std::int64_t, std::int64_t> shard_of(std::int64_t r) const {
      const auto d = static_cast<std::int64_t>(shard_counts.size());
      const std::int64_t first = std::min(size, r * ((size + d - 1) / d));
      return {first, first + shard_counts[static_cast<std::size_t>(r)]};
    }
    Tensor flat, shard;  // the reduce dtype, from the accounted allocator; held from launch to finish
    CommEvent done;
    int launch_order = -1;  // this iteration's (-1: not launched): the stream runs them in this order
    bool launched() const { return launch_order >= 0; }
    std::vector<std::int64_t> gather_units;  // per rank of comm: its shard's weights in 2-byte units
    Tensor mine, gathered;  // the parameter all-gather's buffers (2-byte units), while it is in flight
    CommEvent gather_done;
    bool gathering = false;
  };

 private:
  // A bucket over a group of one rank is not copied: its gradients are read where they are, in
  // finish (nothing writes a weight's gradient after its group completed on the last micro-batch).
  void launch(Bucket& b);
  void copy_out(Bucket& b, float scale);  // the reduced bucket into its params' gradients, times scale
  void finish_gather(Bucket& b);
  // The completions that make `group` complete this iteration (the embedding's with the rows
  // split: every micro-batch's but the last).
  int needed(int group) const { return rows_split() && group == embedding_group_ ? micro_batches_ - 1 : micro_batches_; }
  bool rows_split() const { return embedding_bucket_ >= 0 && micro_batches_ > 1; }
  void add_embedding_rows(float scale);

  CommStream& stream_;
  const bool overlap_, distributed_;
  const DType reduce_dtype_;
  const std::vector<int> group_chunk_;
  std::vector<Bucket> buckets_;
  std::vector<int> completions_;  // per group, this iteration
  int micro_batches_ = 1;
  int launches_ = 0;  // this iteration's, so far
  // ddp.reduce_embedding_rows: the embedding's group and bucket (-1: off), and the last
  // micro-batch's rows: every DP rank's token ids and gradient rows, while they are in flight.
  int embedding_group_ = -1, embedding_bucket_ = -1;
  Param* shared_embedding_ = nullptr;
  int shared_bucket_ = -1;
  Tensor rows_ids_, rows_grad_, all_ids_, all_grad_;
  CommEvent rows_done_;
};

}  // namespace epx
