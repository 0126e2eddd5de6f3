#include "epx/trace.hpp"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <vector>

#include <nlohmann/json.hpp>

#include "epx/comm.hpp"
#include "epx/error.hpp"
#include "epx/output_file.hpp"

namespace epx::trace {
namespace {

struct Event {
  Track track;
  std::string name;
  Clock::time_point begin, end;
};

std::atomic<bool> g_enabled{false};
std::mutex g_mu;
std::vector<Event> g_events;

double us(Clock::time_point t, Clock::time_point origin) {
  return std::chrono::duration<double, std::micro>(t - origin).count();
}

using Intervals = std::vector<std::pair<Clock::time_point, Clock::time_point>>;

Intervals merged(Intervals v) {
  std::sort(v.begin(), v.end());
  Intervals out;
  for (const auto& c : v)
    if (!out.empty() && c.first <= out.back().second) out.back().second = std::max(out.back().second, c.second);
    else out.push_back(c);
  return out;
}

// a \ b, both merged.
Intervals minus(const Intervals& a, const Intervals& b) {
  Intervals out;
  for (auto [begin, end] : a) {
    for (const auto& [bb, be] : b) {
      if (be <= begin || bb >= end) continue;
      if (bb > begin) out.emplace_back(begin, bb);
      begin = std::max(begin, be);
    }
    if (begin < end) out.emplace_back(begin, end);
  }
  return out;
}

// The dispatchers' token exchanges (their comm-stream task names).
bool is_token_exchange(const std::string& name) {
  return name == "dispatch" || name == "combine" || name == "dispatch backward" || name == "combine backward";
}

}  // namespace

void enable(bool on) { g_enabled = on; }
bool enabled() { return g_enabled; }

void record(Track track, std::string name, Clock::time_point begin, Clock::time_point end, int index) {
  if (!g_enabled) return;
  if (index >= 0) name.append(" ").append(std::to_string(index));
  std::lock_guard lock(g_mu);
  g_events.push_back({track, std::move(name), begin, end});
}

Summary summarize(Clock::time_point since) {
  Intervals compute, comm, wait, exchange;
  {
    std::lock_guard lock(g_mu);
    for (const Event& e : g_events) {
      if (e.begin < since) continue;
      (e.track == Track::compute ? compute : e.track == Track::comm ? comm : wait).emplace_back(e.begin, e.end);
      if (e.track == Track::comm && is_token_exchange(e.name)) exchange.emplace_back(e.begin, e.end);
    }
  }
  const Intervals busy = minus(merged(compute), merged(wait));
  Summary s;
  const auto sec = [](Clock::duration d) { return std::chrono::duration<double>(d).count(); };
  for (const auto& [b, e] : busy) s.compute_s += sec(e - b);
  const auto add = [&](const Intervals& v, double& total, double& exposed) {
    for (const auto& [b, e] : v) {
      total += sec(e - b);
      for (const auto& [xb, xe] : minus({{b, e}}, busy)) exposed += sec(xe - xb);
    }
  };
  add(comm, s.comm_s, s.exposed_comm_s);
  add(exchange, s.token_exchange_s, s.exposed_token_exchange_s);
  return s;
}

void write(Communicator& world, const std::string& path, Clock::time_point origin) {
  nlohmann::json events = nlohmann::json::array();
  const int rank = world.rank();
  events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", rank}, {"args", {{"name", "rank " + std::to_string(rank)}}}});
  events.push_back({{"name", "process_sort_index"}, {"ph", "M"}, {"pid", rank}, {"args", {{"sort_index", rank}}}});
  for (int tid : {0, 1})
    events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", rank}, {"tid", tid},
                      {"args", {{"name", tid == 0 ? "compute" : "communication"}}}});
  {
    std::lock_guard lock(g_mu);
    for (const Event& e : g_events)
      events.push_back({{"name", e.name}, {"cat", e.track == Track::compute ? "compute" : e.track == Track::comm ? "comm" : "wait"},
                        {"ph", "X"}, {"pid", rank}, {"tid", e.track == Track::comm ? 1 : 0}, {"ts", us(e.begin, origin)},
                        {"dur", us(e.end, e.begin)}});
    g_events.clear();
  }
  // Gather every rank's events (as text, in 8-byte words) on every rank; rank 0 writes them.
  std::string mine = json_text(events);
  mine.resize((mine.size() + 7) / 8 * 8, ' ');
  std::vector<std::int64_t> words(static_cast<std::size_t>(world.size()));
  words[static_cast<std::size_t>(rank)] = static_cast<std::int64_t>(mine.size() / 8);
  world.allreduce(words.data(), static_cast<std::int64_t>(words.size()), DType::I64);
  std::int64_t total = 0;
  for (auto w : words) total += w;
  std::string all(static_cast<std::size_t>(total * 8), ' ');
  world.allgatherv(mine.data(), all.data(), words, DType::I64);
  if (rank != 0) return;
  nlohmann::json merged = nlohmann::json::array();
  std::size_t at = 0;
  for (auto w : words) {
    for (auto& e : nlohmann::json::parse(all.substr(at, static_cast<std::size_t>(w * 8)))) merged.push_back(std::move(e));
    at += static_cast<std::size_t>(w * 8);
  }
  const std::string text = json_text({{"traceEvents", merged}, {"displayTimeUnit", "ms"}});
  write_file_atomically(path, [&](std::ostream& out) { out << text << "\n"; });
}

}  // namespace epx::trace
