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

const char* category(Track track) {
  return track == Track::compute ? "compute" : track == Track::wait ? "wait" : "comm";
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

Breakdown summarize(Clock::time_point since, Clock::time_point until) {
  std::vector<Span> spans;
  double to = 0;
  {
    std::lock_guard lock(g_mu);
    for (const Event& e : g_events) {
      if (e.end <= since || e.begin >= until) continue;
      spans.push_back({category(e.track), e.name, us(e.begin, since) * 1e-6, us(e.end, since) * 1e-6});
      to = std::max(to, spans.back().end_s);
    }
  }
  if (until != Clock::time_point::max()) to = us(until, since) * 1e-6;
  return break_down(spans, 0, to);
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
    events.push_back({{"name", e.name}, {"cat", category(e.track)},
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
