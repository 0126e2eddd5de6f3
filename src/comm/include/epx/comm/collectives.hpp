// Small collectives built on Communicator, written once: one value per rank, rows of a tensor,
// and text.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "epx/comm/comm.hpp"
#include "epx/tensor/tensor.hpp"

namespace epx {

// Every rank's `v`, in rank order.
std::vector<std::int64_t> allgather_one(Communicator& c, std::int64_t v);
std::int64_t max_over(Communicator& c, std::int64_t v);
// The FP32 sum over the ranks (an all-reduce of one float).
float sum_over(Communicator& c, float v);
// Every rank's rows (dim 0) concatenated in rank order, as F32; every rank's shape must be the same.
Tensor allgather_rows(Communicator& c, const Tensor& local);
// The node of every rank of `c`: ranks that share memory get the same id, the lowest rank of `c`
// on that node.
std::vector<int> node_of_each_rank(Communicator& c);
// Every rank's text, in rank order.
std::vector<std::string> allgather_text(Communicator& c, const std::string& mine);

}  // namespace epx
