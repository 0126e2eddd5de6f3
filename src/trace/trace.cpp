#include "epx/trace/trace.hpp"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <vector>

#include <nlohmann/json.hpp>

#include "epx/base/error.hpp"
#include "epx/base/output_file.hpp"

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


}  // namespace

bool is_token_exchange(const std::string& name) {
  return name == kDispatch || name == kCombine || name == kDispatchBackward || name == kCombineBackward;
}

bool is_dp_reduction(const std::string& name) {
  return name.find("gradient all-reduce") != std::string::npos || name.find("parameter all-gather") != std::string::npos ||
         name.find("gradient rows all-gather") != std::string::npos;
}

void enable(bool on) { g_enabled = on; }
bool enabled() { return g_enabled; }

void record(Track track, std::string name, Clock::time_point begin, Clock::time_point end, int index) {
  if (!g_enabled) return;
  if (index >= 0) name.append(" ").append(std::to_string(index));
  std::lock_guard lock(g_mu);
  g_events.push_back({track, std::move(name), begin, end});
}

Summary summarize(Clock::time_point since, Clock::time_point until) {
  Intervals compute, comm, wait, exchange, dp;
  {
    std::lock_guard lock(g_mu);
    for (const Event& e : g_events) {
      if (e.begin < since || e.begin >= until) continue;
      const bool communication = e.track == Track::comm || e.track == Track::grad_comm;
      (e.track == Track::compute ? compute : communication ? comm : wait).emplace_back(e.begin, e.end);
      if (communication && is_token_exchange(e.name)) exchange.emplace_back(e.begin, e.end);
      if (communication && is_dp_reduction(e.name)) dp.emplace_back(e.begin, e.end);
    }
  }
  const Intervals busy = minus(merged(compute), merged(wait));
  Summary s;
  const auto sec = [](Clock::duration d) { return std::chrono::duration<double>(d).count(); };
  for (const auto& [b, e] : busy) s.compute_s += sec(e - b);
  // Unions: the two streams' tasks may run at the same time.
  const auto add = [&](const Intervals& v, double& total, double& exposed) {
    const Intervals all = merged(v);
    for (const auto& [b, e] : all) total += sec(e - b);
    for (const auto& [b, e] : minus(all, busy)) exposed += sec(e - b);
  };
  add(comm, s.comm_s, s.exposed_comm_s);
  add(exchange, s.token_exchange_s, s.exposed_token_exchange_s);
  const Intervals dp_all = merged(dp);
  for (const auto& [b, e] : dp_all) s.dp_reduce_s += sec(e - b);
  for (const auto& [b, e] : minus(minus(dp_all, busy), merged(exchange))) s.exposed_dp_reduce_s += sec(e - b);
  return s;
}

std::map<std::string, double> seconds_by_name(Track track, Clock::time_point since) {
  std::map<std::string, double> out;
  std::lock_guard lock(g_mu);
  for (const Event& e : g_events)
    if (e.track == track && e.begin >= since) out[e.name] += std::chrono::duration<double>(e.end - e.begin).count();
  return out;
}

std::string take_events_json(int rank, Clock::time_point origin) {
  nlohmann::json events = nlohmann::json::array();
  events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", rank}, {"args", {{"name", "rank " + std::to_string(rank)}}}});
  events.push_back({{"name", "process_sort_index"}, {"ph", "M"}, {"pid", rank}, {"args", {{"sort_index", rank}}}});
  for (int tid : {0, 1, 2})
    events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", rank}, {"tid", tid},
                      {"args", {{"name", tid == 0 ? "compute" : tid == 1 ? "communication" : "gradient reduction"}}}});
  std::lock_guard lock(g_mu);
  for (const Event& e : g_events) {
    const bool communication = e.track == Track::comm || e.track == Track::grad_comm;
    events.push_back({{"name", e.name}, {"cat", e.track == Track::compute ? "compute" : communication ? "comm" : "wait"},
                      {"ph", "X"}, {"pid", rank}, {"tid", e.track == Track::comm ? 1 : e.track == Track::grad_comm ? 2 : 0},
                      {"ts", us(e.begin, origin)}, {"dur", us(e.end, e.begin)}});
  }
  g_events.clear();
  return json_text(events);
}

void write(const std::string& path, const std::vector<std::string>& events_per_rank) {
  nlohmann::json merged = nlohmann::json::array();
  for (const std::string& events : events_per_rank)
    for (auto& e : nlohmann::json::parse(events)) merged.push_back(std::move(e));
  const std::string text = json_text({{"traceEvents", merged}, {"displayTimeUnit", "ms"}});
  write_file_atomically(path, [&](std::ostream& out) { out << text << "\n"; });
}

}  // namespace epx::trace
