// Readers of a run's evidence: epx's results JSON and trace, and Megatron's training log lines.
#include "epx/plan/run_evidence.hpp"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <set>
#include <string_view>
#include <utility>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <regex>
#include <sstream>

#include <limits>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <yaml-cpp/yaml.h>

#include "epx/base/error.hpp"
#include "epx/config/schema.hpp"
#include "epx/trace/trace.hpp"

namespace epx {
namespace {

constexpr double kGiB = 1073741824.0;

// An epx run's trace over thousands of iterations on a few ranks, or a Megatron log of a long
// run, stays in the tens of megabytes.
constexpr std::size_t kMaxRunFileBytes = std::size_t{512} << 20;

std::string read_text(const std::string& path, const char* what) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw InputError(fmt::format("{}: is a directory; give the {} itself", path, what));
  const auto too_long = [&] {
    return InputError(fmt::format("{}: more than {} MiB; a {} of a real run is far smaller (is it the right file?)", path,
                                  kMaxRunFileBytes >> 20, what));
  };
  if (std::filesystem::is_regular_file(path, ec) && std::filesystem::file_size(path, ec) > kMaxRunFileBytes && !ec)
    throw too_long();
  std::ifstream in(path, std::ios::binary);
  if (!in || std::filesystem::is_directory(path, ec)) {
    const std::string why = !std::filesystem::exists(path, ec)        ? "no such file"
                            : std::filesystem::is_directory(path, ec) ? "a directory"
                                                                      : std::strerror(errno);
    throw InputError(fmt::format("{}: cannot read the {}: {}", path, what, why));
  }
  // Bounded, so that /dev/zero or a runaway pipe ends in a message rather than all of memory.
  std::string text;
  char chunk[1 << 16];
  while (in.read(chunk, sizeof chunk) || in.gcount() > 0) {
    text.append(chunk, static_cast<std::size_t>(in.gcount()));
    if (text.size() > kMaxRunFileBytes) throw too_long();
  }
  if (in.bad()) throw InputError(fmt::format("{}: cannot read the {}: {}", path, what, std::strerror(errno)));
  return text;
}

// The 1-based line of byte `at` in `text`.
std::size_t line_of(const std::string& text, std::size_t at) {
  return 1 + static_cast<std::size_t>(std::count(text.begin(), text.begin() + static_cast<long>(std::min(at, text.size())), '\n'));
}

// A key given twice in one object is refused: JSON parsers keep one of the two, silently.
nlohmann::json parse_json(const std::string& text, const std::string& path, const char* what) {
  std::vector<std::set<std::string>> keys;  // the open objects' keys, innermost last
  std::optional<std::string> twice;
  const auto once = [&](int, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using Event = nlohmann::json::parse_event_t;
    if (event == Event::object_start) keys.emplace_back();
    if (event == Event::object_end && !keys.empty()) keys.pop_back();
    if (event == Event::key && !keys.empty() && !keys.back().insert(parsed.get<std::string>()).second && !twice)
      twice = parsed.get<std::string>();
    return true;
  };
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text, once);
  } catch (const nlohmann::json::parse_error& e) {
    throw InputError(fmt::format("{}:{}: not a valid {} (JSON): {}", path, line_of(text, e.byte), what, e.what()));
  } catch (const nlohmann::json::out_of_range& e) {
    // A number beyond a double (1e999): the parser names the literal but not its place.
    const std::string message = e.what();
    const auto open = message.find('\''), close = message.rfind('\'');
    const std::string literal = open < close ? message.substr(open + 1, close - open - 1) : "";
    const std::size_t at = literal.empty() ? std::string::npos : text.find(literal);
    throw InputError(fmt::format("{}{}: not a valid {}: the number {} is beyond a double's range (about 1.8e308)", path,
                                 at == std::string::npos ? "" : fmt::format(":{}", line_of(text, at)), what,
                                 literal.empty() ? "(unnamed)" : literal));
  }
  if (twice)
    throw InputError(fmt::format("{}: not a valid {}: the key \"{}\" appears twice in one object (which one counts "
                                 "is unspecified); keep one",
                                 path, what, *twice));
  return j;
}

// Where a value of a results file sits, for a message. The JSON parser keeps no positions, so
// the text is read again as YAML (JSON is YAML, and yaml-cpp marks each node), once and only
// when a message needs a line.
class ResultsFile {
 public:
  ResultsFile(const std::string& text, const std::string& path) : path(path), text_(text) {}
  const std::string& path;

  // "PATH:LINE" of the value at `at` ("summary.mean_step_time_s", "iterations[3].lm_loss"), or
  // of the nearest one holding it where it is missing; PATH alone where the text reads as no YAML.
  std::string place(std::string_view at) const {
    YAML::Node n = yaml();
    if (!n.IsDefined() || n.IsNull()) return path;
    for (std::size_t from = 0; from < at.size();) {
      const std::size_t end = std::min(at.find_first_of(".[", from + 1), at.size());
      const std::string_view part = at.substr(from, end - from);
      from = end;
      const bool index = part.starts_with('[');  // "[3]": strtoull stops at the ']'
      const std::string key(part.substr(part.starts_with('.') || index ? 1 : 0));
      const std::size_t k = index ? std::strtoull(key.c_str(), nullptr, 10) : 0;
      const YAML::Node next = index ? (n.IsSequence() && k < n.size() ? std::as_const(n)[k] : YAML::Node(YAML::NodeType::Undefined))
                                    : (n.IsMap() ? std::as_const(n)[key] : YAML::Node(YAML::NodeType::Undefined));
      if (!next.IsDefined()) break;  // missing (a const lookup's invalid node, too)
      n.reset(next);
    }
    return fmt::format("{}:{}", path, n.Mark().line + 1);
  }
  // The text as YAML; null where it reads as none (or is too large to read again for a message).
  const YAML::Node& yaml() const {
    if (!yaml_) {
      yaml_ = YAML::Node();
      try {
        if (text_.size() <= kMaxReread) yaml_ = YAML::Load(text_);
      } catch (const YAML::Exception&) {  // e.g. nested past yaml-cpp's depth: no line, then
      }
    }
    return *yaml_;
  }
  // A results-file error at `at`.
  InputError bad(std::string_view at, const std::string& why) const {
    return InputError(fmt::format("{}: {}; is this the JSON `epx run --results` writes?", place(at), why));
  }

 private:
  static constexpr std::size_t kMaxReread = std::size_t{16} << 20;
  const std::string& text_;
  mutable std::optional<YAML::Node> yaml_;
};

// The top-level object's object or array at `key` in the valid JSON `text`, read as YAML where it
// sits in the file (blank lines and spaces before it), so that its nodes' marks are the file's
// lines and columns; undefined where the key is not found plainly (an escaped name), the value
// is longer than a YAML input may be, or yaml-cpp cannot read it.
YAML::Node top_level_value(const std::string& text, std::string_view key) {
  int depth = 0;
  std::size_t begin = std::string::npos;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char ch = text[i];
    if (ch == '"') {
      const std::size_t open = i;
      for (++i; i < text.size() && text[i] != '"'; ++i) i += text[i] == '\\';
      const std::size_t colon = text.find_first_not_of(" \t\r\n", i + 1);
      if (depth == 1 && begin == std::string::npos && std::string_view(text).substr(open + 1, i - open - 1) == key &&
          colon != std::string::npos && text[colon] == ':')
        begin = text.find_first_not_of(" \t\r\n", colon + 1);
      if (begin != std::string::npos && text[begin] != '{' && text[begin] != '[') break;
    } else if (ch == '{' || ch == '[') {
      ++depth;
    } else if ((ch == '}' || ch == ']') && --depth == 1 && begin != std::string::npos && i >= begin) {
      if (i + 1 - begin > kMaxConfigBytes) break;
      const std::size_t line_start = text.rfind('\n', begin) + 1;  // npos + 1: the first line
      std::string at_its_place(line_of(text, begin) - 1, '\n');
      at_its_place.append(begin - line_start, ' ').append(text, begin, i + 1 - begin);
      try {
        return YAML::Load(at_its_place);
      } catch (const YAML::Exception&) {
        break;
      }
    }
  }
  return YAML::Node(YAML::NodeType::Undefined);
}

// `object` (as "summary" or "iterations[3]") holds `key`.
double number(const nlohmann::json& j, const std::string& object, const char* key, const ResultsFile& file) {
  const auto it = j.find(key);
  const std::string at = object + "." + key;
  if (it == j.end() || !it->is_number()) throw file.bad(at, fmt::format("{} is missing or not a number", at));
  return it->get<double>();
}

// A loss: a number, or null where the run diverged (epx run writes a NaN loss as JSON's null).
double loss(const nlohmann::json& j, const std::string& object, const char* key, const ResultsFile& file) {
  const auto it = j.find(key);
  return it != j.end() && it->is_null() ? std::numeric_limits<double>::quiet_NaN() : number(j, object, key, file);
}

// A time, rate, size or count: never negative, and within what a run measures (larger ones
// would overflow the sums and shares they feed).
double amount(const nlohmann::json& j, const std::string& object, const char* key, const ResultsFile& file) {
  const double v = number(j, object, key, file);
  const std::string at = object + "." + key;
  if (v < 0) throw file.bad(at, fmt::format("{} is {}: a time, rate, size or count is never negative", at, v));
  if (v > 1e15) throw file.bad(at, fmt::format("{} is {}: beyond any run's time, rate, size or count (at most 1e15)", at, v));
  return v;
}

std::string text_or(const nlohmann::json& j, const char* key) {
  const auto it = j.find(key);
  return it != j.end() && it->is_string() ? it->get<std::string>() : "";
}

PipelineEvidence read_pipeline(const nlohmann::json& j, const ResultsFile& file) {
  const std::string at = "summary.pipeline";
  const auto bad = [&](const std::string& where, const std::string& why) { return file.bad(where, at + " " + why); };
  if (!j.is_object()) throw bad(at, "is not an object");
  PipelineEvidence p;
  const double stages = amount(j, at, "stages", file), chunks = amount(j, at, "virtual_stages_per_stage", file),
               micro_batches = amount(j, at, "micro_batches", file);
  if (stages < 1 || stages > 1e6 || chunks < 1 || chunks > 1e6 || micro_batches > 1e9)
    throw bad(at, fmt::format("has {} stages of {} chunks and {} micro-batches", stages, chunks, micro_batches));
  p.stages = static_cast<int>(stages), p.chunks = static_cast<int>(chunks), p.micro_batches = static_cast<int>(micro_batches);
  p.ideal_bubble = amount(j, at, "ideal_bubble", file);
  for (const auto& [key, into] : {std::pair{"stage_schedule_s", &p.schedule_s}, std::pair{"stage_wait_s", &p.wait_s}}) {
    const auto it = j.find(key);
    const std::string list = at + "." + key;
    if (it == j.end() || !it->is_array() || it->size() != static_cast<std::size_t>(p.stages))
      throw bad(list, fmt::format("'{}' is not a list of {} times", key, p.stages));
    for (std::size_t k = 0; k < it->size(); ++k) {
      const nlohmann::json& t = (*it)[k];
      if (!t.is_number() || t.get<double>() < 0)
        throw bad(fmt::format("{}[{}]", list, k), fmt::format("'{}' holds {}, not a time", key, t.dump()));
      into->push_back(t.get<double>());
    }
  }
  for (std::size_t k = 0; k < p.wait_s.size(); ++k)
    if (p.wait_s[k] > p.schedule_s[k] * (1 + 1e-6))
      throw bad(fmt::format("{}.stage_wait_s[{}]", at, k), fmt::format("stage {} waits longer than its schedule runs", k));
  return p;
}

void read_epx_results(const std::string& text, const std::string& path, RunEvidence& run) {
  const nlohmann::json j = parse_json(text, path, "epx results file");
  if (!j.is_object() || !j.contains("summary") || !j.contains("iterations") || !j["iterations"].is_array())
    throw InputError(fmt::format("{}:1: a JSON file without 'summary' and 'iterations': not an `epx run --results` file", path));
  run.kind = "epx results";
  const nlohmann::json& s = j["summary"];
  const ResultsFile file(text, path);
  for (std::size_t k = 0; k < j["iterations"].size(); ++k) {
    const nlohmann::json& it = j["iterations"][k];
    const std::string at = fmt::format("iterations[{}]", k);
    IterationPoint p;
    const double iteration = amount(it, at, "iteration", file);
    if (iteration < 1 || iteration > 1e9 || iteration != std::floor(iteration))
      throw file.bad(at + ".iteration", fmt::format("{}.iteration is {}: an iteration is a whole number from 1", at, iteration));
    if (!run.iterations.empty() && iteration <= run.iterations.back().iteration)
      throw file.bad(at + ".iteration", fmt::format("{}.iteration is {}, after {}: the iterations go up", at, iteration,
                                                    run.iterations.back().iteration));
    p.iteration = static_cast<int>(iteration);
    p.step_s = amount(it, at, "step_time_s", file);
    p.tflops_per_gpu = amount(it, at, "tflops_per_rank", file);
    p.lm_loss = loss(it, at, "lm_loss", file);
    if (!std::isfinite(p.lm_loss) && run.diverged_at == 0) run.diverged_at = p.iteration;
    p.mem_max_allocated_gb = amount(it, at, "mem_max_allocated_bytes", file) / kGiB;
    run.iterations.push_back(p);
  }
  if (const auto steady = s.find("steady_state_iterations"); steady != s.end()) {
    const auto iteration = [](const nlohmann::json& v) {
      return v.is_number_integer() && v.get<std::int64_t>() >= 1 && v.get<std::int64_t>() <= 1000000000;
    };
    if (!steady->is_array() || steady->size() != 2 || !iteration((*steady)[0]) || !iteration((*steady)[1]))
      throw file.bad("summary.steady_state_iterations",
                     fmt::format("summary.steady_state_iterations is {}, not [first, last] iterations", shorten(steady->dump())));
    run.steady_first = (*steady)[0].get<int>();
    run.steady_last = (*steady)[1].get<int>();
  }
  if (run.iterations.empty()) throw file.bad("iterations", "'iterations' is empty");
  if (run.steady_last > 0 && (run.steady_first > run.steady_last || run.steady_first < run.iterations.front().iteration ||
                              run.steady_last > run.iterations.back().iteration))
    throw file.bad("summary.steady_state_iterations",
                   fmt::format("summary.steady_state_iterations [{}, {}] is not a range of its iterations {}..{}",
                               run.steady_first, run.steady_last, run.iterations.front().iteration,
                               run.iterations.back().iteration));
  run.mean_step_s = amount(s, "summary", "mean_step_time_s", file);
  if (!(run.mean_step_s > 0)) throw file.bad("summary.mean_step_time_s", "summary.mean_step_time_s is 0");
  run.tflops_per_gpu = amount(s, "summary", "tflops_per_rank", file);
  run.peak_memory_gb = amount(s, "summary", "peak_memory_bytes", file) / kGiB;
  run.final_loss = loss(s, "summary", "final_lm_loss", file);
  if (s.contains("expert_load_max_over_mean"))  // results before it was measured lack it
    run.expert_load = amount(s, "summary", "expert_load_max_over_mean", file);
  if (s.contains("ep_rank_load_max_over_mean"))
    run.ep_rank_load = amount(s, "summary", "ep_rank_load_max_over_mean", file);
  if (s.contains("process_cpu_s") && s.contains("cores_per_rank") && run.steady_last > 0) {  // since 2026-11-28
    const double cores = amount(s, "summary", "cores_per_rank", file);
    if (cores < 1e-3)  // 1000 ranks on a core
      throw file.bad("summary.cores_per_rank",
                     fmt::format("summary.cores_per_rank is {:g}: a rank has at least a thousandth of a core", cores));
    run.cpu_s_per_iteration = amount(s, "summary", "process_cpu_s", file) / (run.steady_last - run.steady_first + 1);
    run.cores_per_rank = cores;
  }
  run.layout = text_or(s, "layout");
  run.dispatcher = text_or(s, "dispatcher");
  run.schedule = text_or(s, "schedule");
  run.recompute = text_or(s, "recompute");
  if (const auto ranks = j.find("ranks"); ranks != j.end()) {
    if (!ranks->is_number_integer() || ranks->get<std::int64_t>() < 1 || ranks->get<std::int64_t>() > 1000000)
      throw file.bad("ranks", fmt::format("'ranks' is {}, not a rank count from 1", shorten(ranks->dump())));
    run.ranks = ranks->get<int>();
  }
  if (const auto pp = s.find("pipeline"); pp != s.end()) run.pipeline = read_pipeline(*pp, file);
  if (j.contains("config") && !j["config"].is_object())
    throw file.bad("config", "'config' is not a mapping of the config's sections");
  if (j.contains("config")) {
    // From the file's own text (JSON is YAML), so that what cites the config, now or when it is
    // checked later, cites the file's lines; where yaml-cpp cannot read it, from the parsed JSON,
    // whose dump's lines those would be.
    const YAML::Node config = top_level_value(text, "config");
    try {
      run.config = config.IsMap() ? load_config_node(config, path) : load_config_text(j["config"].dump(), path);
    } catch (const ConfigError& e) {
      throw InputError(fmt::format("{}: its 'config' does not load: {}", path, e.what()));
    }
  }
}

// Whether `text` is a JSON array (a Chrome trace given as the run).
bool json_array(const std::string& text) {
  const auto first = text.find_first_not_of(" \t\r\n\xEF\xBB\xBF");
  return first != std::string::npos && text[first] == '[' && nlohmann::json::accept(text);
}

// Megatron-LM's training_log lines, as the seeds' harness prints them (epx run prints the same).
void read_megatron_log(const std::string& text, const std::string& path, RunEvidence& run) {
  static const std::regex iteration(R"(iteration\s+(\d+)/\s*(\d+)\s*\|)");
  // Megatron ends each field with " |": a number without it may be cut short.
  static const std::regex elapsed(R"(elapsed time per iteration \(ms\):\s*([0-9.eE+-]+)\s*\|)");
  static const std::regex tflops(R"(throughput per GPU \(TFLOP/s/GPU\):\s*([0-9.eE+-]+)\s*\|)");
  // Megatron prints the loss with {:.6E}: a NaN or infinity is NAN, INF or -INF (before 2020:
  // "lm loss 6.758929E+00", no colon).
  static const std::regex loss(R"(lm loss:?\s*([+-]?(?:[nN][aA][nN]|[iI][nN][fF])|[0-9.eE+-]+)\s*\|)");
  static const std::regex skipped(R"(number of skipped iterations:\s*(\d+))");
  static const std::regex nans(R"(number of nan iterations:\s*(\d+))");
  // Launchers' prefixes, dropped from every line before the rest is read, one after another
  // (srun -l over torchrun --tee gives "0: [default7]:"): "[default3]:" (torchrun --tee), "3: "
  // (srun -l), "[1,3]<stdout>:" (mpirun --tag-output), an RFC 3339 time (kubectl logs --timestamps).
  static const std::regex launcher_prefix(
      R"(^ ?(?:\[[^\]]*\](?:<std(?:out|err)>)?:|\d+:|\d{4}-\d\d-\d\dT[0-9:.]+(?:Z|[+-]\d\d:\d\d) ))");
  // The arguments dump, or Megatron-LM's "using world size: N, data-parallel size: ..." line.
  static const std::regex world_size(R"(^\s*world_size \.+ (\d+)\s*$|using world size:\s*(\d+))");
  // Megatron's Timers.log: "    all-grads-sync ......: (min, max)" or, max only, ": max".
  static const std::regex timer(R"(^\s+([a-z][a-z0-9-]*) \.+: (?:\(([0-9.eE+-]+), )?([0-9.eE+-]+)\)?\s*$)");
  // --timing-log-option all: "times across ranks (ms):", then per timer "  name:" and a line
  // "     rank  3: 12.34" for each rank whose time is above 0.
  static const std::regex all_ranks_timer(R"(^\s+([a-z][a-z0-9-]*):\s*$)");
  static const std::regex rank_time(R"(^\s+rank\s+(\d+): ([0-9.eE+-]+)\s*$)");
  std::string all_ranks_name;  // the timer whose ranks' lines follow
  // Before August 2022 the timers were one line: "time (ms) | forward-compute: 604.56 | ...".
  static const std::regex timers_line(R"(^\s*time \(ms\)((?: \| [a-z][a-z0-9-]*: [0-9.eE+-]+)+)\s*$)");
  static const std::regex timers_line_item(R"(\| ([a-z][a-z0-9-]*): ([0-9.eE+-]+))");
  // Bridge prints its rate on a line of its own, before the iteration's line (after it in
  // older versions; --log-throughput adds it to the iteration's line):
  // "Step Time : 14.26s GPU utilization: 58.2MODEL_TFLOP/s/GPU". Which order the log has is
  // told at its end, where a log cut at its start still shows it: a rate line after the last
  // iteration line is the older order's.
  static const std::regex step_time_line(R"(Step Time : [0-9.eE+-]+s GPU utilization: ([0-9.eE+-]+)(?:MODEL_)?TFLOP/s/GPU)");
  std::vector<std::pair<double, int>> step_rates;  // each rate and the iteration lines read before it
  std::vector<int> serials;                         // each kept iteration line's number among those read
  int iteration_lines = 0;
  // A second arguments dump after iterations: a resumed process, whose next line starts anew.
  bool resumed = false;
  static const std::regex global_batch(R"(global batch size:\s*(\d+))");
  // Bridge's memory line (GB: bytes / 1e9) and Megatron-LM's report_memory (MB: bytes / 2^20).
  static const std::regex memory(R"(\(after (\d+) iterations\) memory \(GB\).*?mem-max-allocated-gigabytes:\s*([0-9.eE+-]+))");
  static const std::regex memory_mb(R"(\(after (\d+) iterations\) memory \(MB\).*?\| max allocated:\s*([0-9.eE+-]+))");
  run.kind = "Megatron log";
  std::map<int, double> memory_after;
  // A last line without its newline is one the run was still writing ("...(ms): 4"): not read.
  std::string_view whole = text;
  if (!whole.empty() && whole.back() != '\n') {
    const auto end = whole.rfind('\n');
    run.cut_off = whole.find_first_not_of(" \t\r", end == std::string_view::npos ? 0 : end + 1) != std::string_view::npos;
    whole = end == std::string_view::npos ? std::string_view() : whole.substr(0, end + 1);
  }
  std::istringstream in{std::string(whole)};
  std::size_t line_no = 0;
  for (std::string line; std::getline(in, line);) {
    ++line_no;
    // libstdc++'s regex recurses per character (a 200 KB line overflowed the stack); Megatron's
    // log lines are a few hundred characters, so a longer one is not one of them.
    if (line.size() > 8192) continue;
    std::smatch m;
    // Each pattern is tried only where its words are on the line: std::regex is slow, and a
    // long run's log has millions of lines.
    const auto has = [&](std::string_view words) { return line.find(words) != std::string::npos; };
    while (std::regex_search(line, m, launcher_prefix, std::regex_constants::match_continuous))
      line.erase(0, static_cast<std::size_t>(m.length(0)));
    // A number of the line: finite and within [least, most], else the line's error names it.
    const auto value = [&](const std::string& text, const std::string& what, double least, double most) {
      char* end = nullptr;
      const double v = std::strtod(text.c_str(), &end);
      if (end != text.c_str() + text.size() || !std::isfinite(v) || v < least || v > most)
        throw InputError(fmt::format("{}:{}: {} is {}: out of range (from {:g} to {:g}) in this line: {}", path, line_no,
                                     what, text, least, most, line.substr(0, 120)));
      return v;
    };
    const auto count = [&](const std::string& text, const std::string& what, double least) {
      return static_cast<int>(value(text, what, least, 1e9));
    };
    if (!run.iterations.empty() && has(".:") && std::regex_search(line, m, timer)) {
      IterationPoint& p = run.iterations.back();
      p.timers_ms[m[1]] = value(m[3], "timer " + m[1].str() + " (ms)", 0, 1e12);
      if (m[2].matched) p.timers_min_ms[m[1]] = value(m[2], "timer " + m[1].str() + " (ms)", 0, 1e12);
      continue;
    }
    if (!run.iterations.empty() && has(":") && std::regex_search(line, m, all_ranks_timer)) {
      all_ranks_name = m[1];
      continue;
    }
    if (!run.iterations.empty() && !all_ranks_name.empty() && has("rank") && std::regex_search(line, m, rank_time)) {
      IterationPoint& p = run.iterations.back();
      const double ms = value(m[2], "timer " + all_ranks_name + " (ms)", 0, 1e12);
      p.timers_by_rank_ms[all_ranks_name][count(m[1], "the rank", 0)] = ms;
      p.timers_ms[all_ranks_name] = std::max(p.timers_ms[all_ranks_name], ms);
      const auto [min, first] = p.timers_min_ms.emplace(all_ranks_name, ms);
      if (!first) min->second = std::min(min->second, ms);
      continue;
    }
    all_ranks_name.clear();
    if (!run.iterations.empty() && has("time (ms)") && std::regex_search(line, m, timers_line)) {
      const std::string items = m[1];
      for (std::sregex_iterator it(items.begin(), items.end(), timers_line_item), end; it != end; ++it)
        run.iterations.back().timers_ms[(*it)[1]] = value((*it)[2], "timer " + (*it)[1].str() + " (ms)", 0, 1e12);
      continue;
    }
    if (has("world") && std::regex_search(line, m, world_size)) {
      run.ranks = count(m[1].matched ? m[1].str() : m[2].str(), "the world size", 1);
      resumed = !run.iterations.empty();
      continue;
    }
    if (has("Step Time") && std::regex_search(line, m, step_time_line)) {
      step_rates.emplace_back(value(m[1], "GPU utilization (TFLOP/s/GPU)", 0, 1e9), iteration_lines);
      continue;
    }
    // Every memory line of the line (ranks' lines written without a newline between them run
    // together), the max over the ranks; an iteration line run on after them is read too.
    for (const bool in_gb : {true, false})
      for (std::sregex_iterator it(line.begin(), has("memory (") ? line.end() : line.begin(), in_gb ? memory : memory_mb), end;
           it != end; ++it) {
        const double gib = value((*it)[2], in_gb ? "max allocated (GB)" : "max allocated (MB)", 0, 1e12) *
                           (in_gb ? 1e9 : 1048576.0) / kGiB;
        double& peak = memory_after[count((*it)[1], "the memory line's iteration", 0)];
        peak = std::max(peak, gib);
      }
    if (!has("elapsed time per iteration")) continue;
    std::smatch iteration_match;
    if (!std::regex_search(line, iteration_match, iteration) || !std::regex_search(line, m, elapsed)) {
      if (run.unread_lines++ == 0) run.first_unread_line = line_no;
      continue;
    }
    const std::string iteration_text = iteration_match[1];
    IterationPoint p;
    p.iteration = count(iteration_text, "the iteration", 1);  // Megatron counts from 1
    if (const int total = count(iteration_match[2], "the iterations' total", 1); p.iteration > total)
      throw InputError(fmt::format("{}:{}: iteration {}/{}: past the run's {} iterations (train_iters); lines of two "
                                   "runs or ranks run together? In this line: {}",
                                   path, line_no, p.iteration, total, total, line.substr(0, 120)));
    // A step takes some time: 0 ms is a broken timer, and would make every rate infinite.
    p.step_s = value(m[1], "elapsed time per iteration (ms)", 1e-6, 1e12) / 1000;
    p.throughput_logged = has("throughput per GPU") && std::regex_search(line, m, tflops);
    if (p.throughput_logged) p.tflops_per_gpu = value(m[1], "throughput per GPU (TFLOP/s/GPU)", 0, 1e9);
    if (has("lm loss") && std::regex_search(line, m, loss)) {
      p.loss_not_finite = m[1].str().find_first_of("nNiI") != std::string::npos;
      p.lm_loss = p.loss_not_finite ? std::numeric_limits<double>::quiet_NaN() : value(m[1], "lm loss", -1e300, 1e300);
    }
    if (has("skipped") && std::regex_search(line, m, skipped)) p.skipped = count(m[1], "number of skipped iterations", 0);
    if (has("global batch") && std::regex_search(line, m, global_batch))
      run.global_batch_size = static_cast<std::int64_t>(value(m[1], "global batch size", 1, 1e15));
    if (has("nan iterations") && std::regex_search(line, m, nans)) p.nans = count(m[1], "number of nan iterations", 0);
    if (!run.iterations.empty() && p.iteration <= run.iterations.back().iteration) {
      run.restarted_at = p.iteration;
      run.went_back = true;
      while (!run.iterations.empty() && run.iterations.back().iteration >= p.iteration)
        run.iterations.pop_back(), serials.pop_back();
    } else if (resumed) {
      run.restarted_at = p.iteration;
      run.went_back = false;
    }
    resumed = false;
    run.iterations.push_back(p);
    serials.push_back(++iteration_lines);
  }
  if (run.iterations.empty())
    throw InputError(
        run.unread_lines > 0
            ? fmt::format("{}:{}: a line with an elapsed time per iteration that does not read as Megatron's 'iteration N/M | "
                          "... elapsed time per iteration (ms): T |' (cut, wrapped or run into by other output?), and no "
                          "line that does: give the log as the run wrote it",
                          path, run.first_unread_line)
        : json_array(text)
            ? fmt::format("{}: a JSON array, not an `epx run --results` file (an object with 'summary' and 'iterations') "
                          "nor a Megatron training log; a trace (`epx run --trace`) goes with --trace, beside its run's "
                          "results file",
                          path)
            : fmt::format("{}: neither an `epx run --results` JSON nor a Megatron training log (no line with 'iteration "
                          "N/M | ... elapsed time per iteration (ms): T |')",
                          path));
  // A rate line goes to the iteration line after it (the current order) or before it (the older).
  // The kept lines' serials rise, so each is found by bisection.
  const bool rate_after_line = !step_rates.empty() && step_rates.back().second == iteration_lines;
  for (const auto& [rate, lines_before] : step_rates) {
    const int serial = rate_after_line ? lines_before : lines_before + 1;
    const auto it = std::lower_bound(serials.begin(), serials.end(), serial);
    if (it == serials.end() || *it != serial) continue;  // a line a restart replaced
    IterationPoint& p = run.iterations[static_cast<std::size_t>(it - serials.begin())];
    if (!p.throughput_logged) p.tflops_per_gpu = rate, p.throughput_logged = true;
  }
  for (IterationPoint& p : run.iterations)
    if (const auto it = memory_after.find(p.iteration); it != memory_after.end()) p.mem_max_allocated_gb = it->second;
  for (const auto& [iteration, gib] : memory_after) run.peak_memory_gb = std::max(run.peak_memory_gb, gib);
  // A line's time (and its skipped / NaN counts) covers the iterations since the line before
  // (log_interval). Megatron also logs the run's first iteration, off the interval, and does
  // not reset its timer or counters there (training.py: should_reset = not is_first_iteration),
  // on the interval too (log_interval 1): the next line covers that iteration again. A first
  // line on a longer interval is taken to be a cut log's, covering one interval. (A line at
  // iteration 1 is on no interval but 1's.)
  const std::vector<IterationPoint>& its = run.iterations;
  const bool first_off_interval =
      (its.size() >= 2 && its[0].iteration == 1 && its[1].iteration > 2) ||
      (its.size() >= 3 && its[1].iteration - its[0].iteration != its[2].iteration - its[1].iteration);
  const bool first_not_reset = first_off_interval || (its.size() >= 2 && its[1].iteration - its[0].iteration == 1);
  const auto first_averaged = [&](std::size_t k) {
    if (k == 1 && first_not_reset) return its[0].iteration;
    if (k > 0) return its[k - 1].iteration + 1;
    return its.size() > 1 && !first_off_interval ? std::max(1, 2 * its[0].iteration - its[1].iteration + 1)
                                                 : its[0].iteration;
  };
  // A restart's first line is its process's first iteration too. The next line repeats a line's
  // counts where Megatron-LM did not reset them (since 2026); Megatron-LM before and Bridge reset
  // every line. The larger of the two counts is right either way where one of them is 0 (the
  // usual case for skipped and NaN iterations).
  const auto restart_line = std::find_if(its.begin(), its.end(), [&](const IterationPoint& p) {
    return run.restarted_at > 0 && p.iteration == run.restarted_at;
  });
  for (std::size_t k = 0; k < its.size(); ++k) {
    const bool repeated = (k == 0 && first_not_reset) || its.begin() + static_cast<long>(k) == restart_line;
    if (repeated && k + 1 < its.size()) {
      run.skipped_iterations += std::max(its[k].skipped, its[k + 1].skipped);
      run.nan_iterations += std::max(its[k].nans, its[k + 1].nans);
      ++k;
    } else {
      run.skipped_iterations += its[k].skipped, run.nan_iterations += its[k].nans;
    }
  }
  // The seeds' steady state: from the run's third iteration (all of it for shorter logs); a line
  // counts when the first iteration it covers is in it. A resumed run starts where its log does.
  run.steady_last = its.back().iteration;
  run.first_iteration = first_averaged(0);
  // After a restart, the resumed process warms up again: its first two iterations are left out too.
  // A log too short for that keeps the first process's steady state before the restart, if any.
  const int warm = std::max(run.first_iteration, run.restarted_at) + 2, last = run.steady_last;
  const bool before_restart = warm > last && run.restarted_at > 0 && run.first_iteration + 2 < run.restarted_at;
  const int steady_from = warm <= last ? warm : before_restart ? run.first_iteration + 2 : its.front().iteration;
  const int steady_to = before_restart ? run.restarted_at - 1 : last;
  double sum = 0, flops = 0;
  int n = 0;
  for (const bool fallback : {false, true}) {  // no line in the steady state: every line
    // (but a first line the next one covers again)
    run.steady_last = fallback ? last : steady_to;
    for (std::size_t k = fallback && first_not_reset && its.size() > 1 ? 1 : 0; k < its.size(); ++k) {
      if (!fallback && (first_averaged(k) < steady_from || its[k].iteration > steady_to)) continue;
      if (n == 0) run.steady_first = fallback ? its.front().iteration : first_averaged(k);
      sum += its[k].step_s, flops += its[k].tflops_per_gpu * its[k].step_s, ++n;
      run.throughput_logged = run.throughput_logged && its[k].throughput_logged;  // over the lines averaged
      for (const auto& [name, ms] : its[k].timers_ms) run.timers_ms[name] += ms;
      for (const auto& [name, ms] : its[k].timers_min_ms) run.timers_min_ms[name] += ms;
      for (const auto& [name, ranks] : its[k].timers_by_rank_ms)
        for (const auto& [rank, ms] : ranks) run.timers_by_rank_ms[name][rank] += ms;
    }
    if (n > 0) break;
  }
  run.mean_step_s = sum / n;
  run.tflops_per_gpu = sum > 0 ? flops / sum : 0;  // weighted by time: the run's FLOPs over its time
  for (auto* timers : {&run.timers_ms, &run.timers_min_ms})
    for (auto& [name, ms] : *timers) ms /= n;  // a timer missing on some lines counts as 0 there
  for (auto& [name, ranks] : run.timers_by_rank_ms)
    for (auto& [rank, ms] : ranks) ms /= n;
  run.final_loss = run.iterations.back().lm_loss;
  // Megatron-LM of 2020 printed a NaN mean loss as NAN (later ones leave it out). A passing one
  // was a skipped fp16 step (the loss scaler); to the log's end it is divergence, within the
  // log_interval up to its first such line.
  for (auto it = run.iterations.rbegin(); it != run.iterations.rend() && it->loss_not_finite; ++it)
    run.diverged_at = it->iteration;
}

void read_trace(const std::string& path, RunEvidence& run) {
  const std::string text = read_text(path, "trace");
  const nlohmann::json j = parse_json(text, path, "trace");
  const nlohmann::json* events = j.is_array() ? &j : j.contains("traceEvents") ? &j["traceEvents"] : nullptr;
  if (events == nullptr || !events->is_array())
    throw InputError(fmt::format("{}:1: not a Chrome trace (an array of events or {{\"traceEvents\": [...]}})", path));
  std::vector<TraceSpan> all;
  for (std::size_t index = 0; index < events->size(); ++index) {
    const nlohmann::json& e = (*events)[index];
    const auto text = [&](const char* key) {
      const auto it = e.find(key);
      return it != e.end() && it->is_string() ? it->get<std::string>() : std::string();
    };
    // A process or thread id: a whole number from 0 (epx writes each rank as its process).
    const auto id = [&](const char* key) {
      const auto it = e.find(key);
      if (it == e.end()) return 0;
      if (!it->is_number_integer() || it->get<std::int64_t>() < 0 || it->get<std::int64_t>() > 1000000000)
        throw InputError(fmt::format("{}: event {} ('{}') has {} {}: not a rank or thread number", path, index, text("name"),
                                     key, shorten(it->dump())));
      return it->get<int>();
    };
    if (!e.is_object() || text("ph") != "X" || !e.contains("ts") || !e.contains("dur")) continue;
    TraceSpan s;
    s.rank = id("pid");
    s.thread = id("tid");
    s.name = text("name");
    s.track = text("cat");
    if (!e["ts"].is_number() || !e["dur"].is_number() || e["dur"].get<double>() < 0)
      throw InputError(fmt::format("{}: event {} ('{}') has a ts or dur that is not a number, or a negative dur", path,
                                   index, s.name));
    // epx's times count microseconds from the run's start: 1e14 is three years.
    if (std::abs(e["ts"].get<double>()) > 1e14 || e["dur"].get<double>() > 1e14)
      throw InputError(fmt::format("{}: event {} ('{}') has ts {} and dur {} (microseconds from the run's start): "
                                   "past any run, not an `epx run --trace` time",
                                   path, index, s.name, shorten(e["ts"].dump()), shorten(e["dur"].dump())));
    s.begin_s = e["ts"].get<double>() * 1e-6;
    s.end_s = s.begin_s + e["dur"].get<double>() * 1e-6;
    all.push_back(s);
  }
  // Iterations end with rank 0's optimizer step; the steady state is steady_first..steady_last.
  std::vector<double> ends;
  for (const TraceSpan& s : all)
    if (s.rank == 0 && s.name == "optimizer step") ends.push_back(s.end_s);
  std::sort(ends.begin(), ends.end());
  if (ends.empty()) throw InputError(fmt::format("{}: no 'optimizer step' events on rank 0: not an `epx run --trace` file", path));
  // The trace of another run would be read as this one's: its ranks and iterations must match.
  if (run.kind == "epx results") {
    std::set<int> ranks;
    for (const TraceSpan& s : all) ranks.insert(s.rank);
    if (run.ranks > 0 && static_cast<int>(ranks.size()) != run.ranks)
      throw InputError(fmt::format("{}: a trace of {} rank(s), but {} ran on {}: not the same run's trace", path,
                                   ranks.size(), run.source, run.ranks));
    if (!run.iterations.empty() && ends.size() != run.iterations.size())
      throw InputError(fmt::format("{}: a trace of {} iteration(s), but {} holds {}: not the same run's trace", path,
                                   ends.size(), run.source, run.iterations.size()));
  }
  const int last = std::min<int>(run.steady_last > 0 ? run.steady_last : static_cast<int>(ends.size()), static_cast<int>(ends.size()));
  const int first = std::clamp(run.steady_first > 0 ? run.steady_first : 1, 1, last);
  double start = 0;
  if (first >= 2) start = ends[static_cast<std::size_t>(first - 2)];
  else for (const TraceSpan& s : all) start = std::min(start, s.begin_s);
  const double end = ends[static_cast<std::size_t>(last - 1)];
  const int iterations = last - first + 1;
  const double step = (end - start) / iterations;
  // The same run's trace times the same steps (within 1-2% here); another run of as many ranks
  // and iterations does not. Iterations 2..last: where the first begins is the trace's own start.
  if (run.kind == "epx results" && last >= 2 && run.iterations.size() == ends.size()) {
    double logged = 0;
    for (int i = 2; i <= last; ++i) logged += run.iterations[static_cast<std::size_t>(i - 1)].step_s;
    const double traced = ends[static_cast<std::size_t>(last - 1)] - ends[0];
    if (logged > 0 && (traced > 1.15 * logged || traced < logged / 1.15))
      throw InputError(fmt::format("{}: its steps 2..{} take {:.3g} s each, but {} says {:.3g} s: not the same run's "
                                   "trace",
                                   path, last, traced / (last - 1), run.source, logged / (last - 1)));
  }

  std::vector<trace::Span> rank0;
  for (const TraceSpan& s : all)
    if (s.rank == 0) rank0.push_back({s.track, s.name, s.begin_s, s.end_s});
  TraceBreakdown b;
  static_cast<trace::Breakdown&>(b) = trace::break_down(rank0, start, end);
  b.iterations = iterations;
  b.step_s = step;
  for (double* v : {&b.compute_s, &b.wait_s, &b.idle_s, &b.comm_s, &b.exposed_comm_s, &b.token_exchange_s,
                    &b.token_exchange_exposed_s, &b.dp_reduce_s, &b.dp_reduce_exposed_s, &b.other_comm_s,
                    &b.other_comm_exposed_s, &b.pipeline_wait_s, &b.pipeline_wait_exposed_s})
    *v /= b.iterations;
  b.exposed_s = b.exposed_comm_s + b.pipeline_wait_exposed_s;
  run.trace = b;

  // The report's timeline: the last steady iteration, every rank, from its start.
  const double from = last >= 2 ? ends[static_cast<std::size_t>(last - 2)] : start, to = end;
  for (TraceSpan s : all) {
    if (s.end_s <= from || s.begin_s >= to) continue;
    s.begin_s = std::max(s.begin_s, from) - from;
    s.end_s = std::min(s.end_s, to) - from;
    run.spans.push_back(s);
  }
}

}  // namespace

RunEvidence read_run(const std::string& run_path, const std::optional<std::string>& trace_path) {
  RunEvidence run;
  run.source = run_path;
  const std::string text = read_text(run_path, "run file");
  const std::size_t bom = text.starts_with("\xEF\xBB\xBF") ? 3 : 0;  // a UTF-8 byte-order mark (the JSON parser skips it)
  const auto first = text.find_first_not_of(" \t\r\n", bom);
  if (first == std::string::npos)
    throw InputError(fmt::format("{}: the file is empty: give an `epx run --results` JSON or a Megatron training log",
                                 run_path));
  if (text[first] == '{') read_epx_results(text, run_path, run);  // '[' starts launchers' prefixes too
  else read_megatron_log(text, run_path, run);
  // A trace is `epx run --trace`'s, of the run whose results it goes with; a Megatron run has none.
  if (trace_path && run.kind != "epx results")
    throw InputError(fmt::format("{}: a trace goes with the `epx run --results` file of the same run, and {} is a "
                                 "Megatron log (its timers are read from the log); drop the trace",
                                 *trace_path, run_path));
  if (trace_path) read_trace(*trace_path, run);
  return run;
}

}  // namespace epx
