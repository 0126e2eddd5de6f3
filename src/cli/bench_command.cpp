#include "bench_command.hpp"

#include <algorithm>
#include <chrono>
#include <numeric>
#include <fstream>
#include <iostream>
#include <set>

#include <fmt/format.h>

#include "cluster_env.hpp"
#include "epx/base/error.hpp"
#include "epx/comm/collectives.hpp"
#include "epx/comm/comm_stream.hpp"
#include "epx/comm/process_groups.hpp"
#include "epx/dispatch/dispatcher.hpp"
#include "epx/moe/router.hpp"
#include "epx/tensor/random.hpp"
#include "number_validators.hpp"

namespace epx::cli {
namespace {

// The link rate of the emulated cluster this job runs on (scripts/cluster.sh), in bytes/s; 0 if
// none.
double cluster_link_bytes_per_s() {
  const auto kv = read_cluster_env();
  const auto it = kv.find("link_gbit");
  return it == kv.end() ? 0 : std::stod(it->second) * 1e9 / 8;
}

// Bytes this node's interface has sent (inside an emulated node: its veth), or -1.
std::int64_t node_tx_bytes() {
  std::ifstream in("/sys/class/net/eth0/statistics/tx_bytes");
  std::int64_t n = -1;
  in >> n;
  return n;
}

// "a,b": its words, an empty one too ("2,,4" is a typo to name, not 2,4); "": none.
std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  if (s.empty()) return out;
  std::string cur;
  for (char c : s + ",") {
    if (c != ',') {
      cur += c;
    } else {
      out.push_back(cur);
      cur.clear();
    }
  }
  return out;
}

// A comma-separated list of whole numbers from `least` to `most`, read before any work starts.
// `most_is`: what sets the upper bound, where another option does.
std::vector<std::int64_t> int_list(const char* option, const std::string& text, std::int64_t least, std::int64_t most,
                                   const std::string& most_is = "") {
  std::vector<std::int64_t> out;
  for (const std::string& word : split_list(text)) {
    const std::optional<std::int64_t> v = whole_number(word, least, most);
    if (!v)
      throw ConfigError(fmt::format("{} {}: '{}' is not a whole number from {} to {}{}", option, text, word, least, most,
                                    most_is.empty() ? "" : " (" + most_is + ")"));
    out.push_back(*v);
  }
  if (out.empty()) throw ConfigError(fmt::format("{} '{}': an empty list; give numbers such as 2,4,8", option, text));
  return out;
}

// Each rank holds tokens x hidden BF16 rows, and top-k copies of them in flight.
constexpr std::int64_t kMaxElementsPerRank = std::int64_t{1} << 28;

}  // namespace

void BenchDispatchArgs::add_to(CLI::App& app) {
  app.add_option("--tokens", tokens, "tokens per rank (default 1024)")->check(kPositive);
  app.add_option("--experts", experts, "routed experts, spread over the ranks (default 32)")->check(kPositive);
  app.add_option("--topk", topk, "top-k values (default 2,4,8)");
  app.add_option("--hidden", hidden, "hidden sizes (default 1024,2048,4096)");
  app.add_option("--dispatchers", dispatchers, "alltoall,deepep,hybridep (default all three)");
  app.add_option("--iters", iters, "timed iterations per case (default 3, after 1 warm-up)")->check(kPositive);
  app.add_option("--num-sms", num_sms, "deepep: moe_flex_dispatcher_num_sms (default 20)")->check(kPositive);
  app.add_option("--chunk", chunk, "hybridep: tokens per chunk (default 64)")->check(kPositive);
}

int run_bench_dispatch(const BenchDispatchArgs& args, MpiSession& mpi) {
  Communicator& world = mpi.world();
  const int n = world.size();
  if (args.experts > (1 << 16))
    throw ConfigError(fmt::format("--experts {}: at most {} (a routing map of tokens x experts per rank)", args.experts,
                                  1 << 16));
  if (args.experts % n != 0)
    throw ConfigError(fmt::format("--experts {} is not divisible by the {} ranks (EP = all ranks)", args.experts, n));
  ProcessGroups groups(world, ParallelLayout::make(n, 1, 1, 1, n, 1));
  CommStream stream;
  const std::vector<int> node_of = node_of_each_rank(world);
  const int nodes = static_cast<int>(std::set<int>(node_of.begin(), node_of.end()).size());
  const double link = nodes > 1 ? cluster_link_bytes_per_s() : 0;
  const bool node_leader = std::find(node_of.begin(), node_of.end(), node_of[world.rank()]) - node_of.begin() == world.rank();
  const bool root = world.rank() == 0;
  const std::int64_t local = args.experts / n;
  // Every list is read before the table starts.
  const std::vector<std::int64_t> topks = int_list("--topk", args.topk, 1, args.experts, fmt::format("--experts {}", args.experts)),
                                  hiddens = int_list("--hidden", args.hidden, 1, 1 << 16);
  for (const std::int64_t topk : topks)
    for (const std::int64_t hidden : hiddens)
      if (args.tokens > kMaxElementsPerRank / (hidden * topk))
        throw ConfigError(fmt::format("--tokens {} x --hidden {} x --topk {}: more than {} elements per rank in flight; "
                                      "give fewer tokens or a smaller hidden size",
                                      args.tokens, hidden, topk, kMaxElementsPerRank));
  const std::vector<std::string> names = split_list(args.dispatchers);
  if (names.empty()) throw ConfigError("--dispatchers '': an empty list; give alltoall, deepep, hybridep or some of them");
  for (const std::string& name : names)
    if (name != "alltoall" && name != "deepep" && name != "hybridep")
      throw ConfigError(fmt::format("--dispatchers: unknown '{}' (alltoall, deepep, hybridep)", name));

  if (root)
    std::cout << fmt::format(
        "epx bench dispatch: {} ranks on {} node(s), EP {}, {} experts, {} tokens per rank, BF16, "
        "dispatch + combine (no expert compute), median of {} after 1 warm-up{}\n"
        "MB are per iteration, all ranks together; ideal = one copy per (token, remote node) each way; "
        "link = inter-node MB per node per second / link rate\n\n",
        n, nodes, n, args.experts, args.tokens, args.iters,
        link > 0 ? fmt::format(", link {:.0f} MB/s each way", link / 1e6) : "");
  const std::string header = fmt::format("{:>5} {:>6} {:<14} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7} {:>6} {:>8}\n", "top-k",
                                         "hidden", "dispatcher", "time ms", "intra MB", "inter MB", "meta MB",
                                         "ideal MB", "wire MB", "link%", "speedup");
  if (root) std::cout << header << std::string(header.size() - 1, '-') << "\n";

  for (const std::int64_t k : topks)
    for (const std::int64_t hidden : hiddens) {
      const int topk = static_cast<int>(k);
      const Routing routing = random_topk_routing(args.tokens, args.experts, topk, 1000 + static_cast<std::uint64_t>(world.rank()));
      const Tensor x = random_normal({args.tokens, hidden}, DType::BF16, 5, static_cast<std::uint64_t>(world.rank()));
      // The ideal inter-node payload: each token once per remote node it has experts on, each way.
      std::int64_t ideal = 0;
      for (std::int64_t t = 0; t < args.tokens; ++t) {
        std::set<int> remote;
        for (std::int64_t e = 0; e < args.experts; ++e)
          if (routing.routing_map[static_cast<std::size_t>(t * args.experts + e)] && node_of[e / local] != node_of[world.rank()])
            remote.insert(node_of[e / local]);
        ideal += 2 * static_cast<std::int64_t>(remote.size()) * hidden * 2;
      }
      double alltoall_ms = 0;
      for (const std::string& name : names) {
        std::unique_ptr<TokenDispatcher> d;
        if (name == "alltoall") d = make_alltoall_dispatcher(args.experts, groups, stream);
        else if (name == "deepep" || name == "hybridep")
          d = make_flex_dispatcher(args.experts, groups, stream,
                                   {.backend = name == "deepep" ? FlexBackend::deepep : FlexBackend::hybridep,
                                    .num_sms = args.num_sms, .tokens_per_chunk = args.chunk});
        std::vector<double> times;
        TrafficBytes before{};
        std::int64_t tx_before = 0;
        for (int it = 0; it <= args.iters; ++it) {
          if (it == 1) {
            before = d->traffic();
            tx_before = node_leader ? node_tx_bytes() : 0;
          }
          world.barrier();
          const auto t0 = std::chrono::steady_clock::now();
          DispatchState s;
          d->dispatch_preprocess(s, x, {routing.routing_map, routing.probs});
          d->token_dispatch(s);
          d->dispatch_postprocess(s);
          d->combine_preprocess(s, std::move(s.hidden));  // identity experts
          d->token_combine(s);
          const Tensor y = d->combine_postprocess(s);
          const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
          const auto all = allgather_one(world, static_cast<std::int64_t>(ms * 1000));
          if (it > 0) times.push_back(static_cast<double>(*std::max_element(all.begin(), all.end())) / 1000);
        }
        std::sort(times.begin(), times.end());
        const double ms = times[times.size() / 2];
        const TrafficBytes after = d->traffic();
        const auto sum = [&](std::int64_t v) {
          const auto all = allgather_one(world, v);
          return static_cast<double>(std::accumulate(all.begin(), all.end(), std::int64_t{0})) / args.iters / 1e6;
        };
        const double intra = sum(after.intra - before.intra), inter = sum(after.inter - before.inter),
                     meta = sum(after.inter_metadata - before.inter_metadata), ideal_mb = sum(ideal * args.iters);
        const std::int64_t tx = node_leader && tx_before >= 0 ? node_tx_bytes() - tx_before : 0;
        const double wire = nodes > 1 ? sum(tx) : 0;
        if (name == "alltoall") alltoall_ms = ms;
        if (root)
          std::cout << fmt::format("{:>5} {:>6} {:<14} {:>9.1f} {:>9.2f} {:>9.2f} {:>9.3f} {:>9.2f} {:>7.2f} {:>6} {:>8}\n", topk,
                                   hidden, d->name(), ms, intra, inter, meta, ideal_mb, wire,
                                   link > 0 ? fmt::format("{:.0f}", 100 * inter / nodes / (ms / 1e3) / (link / 1e6)) : "-",
                                   alltoall_ms > 0 ? fmt::format("{:.2f}x", alltoall_ms / ms) : "-");
      }
    }
  return 0;
}

}  // namespace epx::cli
