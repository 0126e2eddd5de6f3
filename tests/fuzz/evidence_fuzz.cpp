// A seeded fuzzer for what `epx diagnose` and `epx report` read back: a real run's results JSON,
// its trace and its Megatron-format log, mutated (values of the wrong type or out of range,
// keys and elements dropped or repeated, cut files, stray bytes, numbers in the log's lines
// replaced), each fed to the two commands as separate processes (a report now and then beside
// the run as it was). Every run must end within a time limit with exit 0, 1 or 2 (never 3, "a
// bug in epx", nor a signal); --json must print valid JSON; an exit 2 must name the file at
// fault; a report that fails leaves no page behind.
// Usage: epx_evidence_fuzz EPX RESULTS TRACE LOG [--cases N] [--seed S]
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "fuzz_process.hpp"

namespace {

namespace fs = std::filesystem;
using nlohmann::json;
// A report of a 4-step run takes a fraction of a second; sanitizer builds run ten times slower.
constexpr double kTimeLimitS = 30;

class Mutator {
 public:
  explicit Mutator(unsigned seed) : rng_(seed) {}

  std::size_t below(std::size_t n) { return n == 0 ? 0 : std::uniform_int_distribution<std::size_t>(0, n - 1)(rng_); }
  bool chance(double p) { return std::uniform_real_distribution<double>(0, 1)(rng_) < p; }
  template <class T>
  const T& pick(const std::vector<T>& v) { return v[below(v.size())]; }

  // One to three edits of the document's values, then its text, pretty or on one line, now and
  // then cut or with a stray byte.
  std::string mutate_json(json doc) {
    for (std::size_t k = 1 + below(3); k > 0; --k) edit(doc, 0);
    std::string text = doc.dump(chance(0.5) ? 1 : -1);
    if (chance(0.05)) text.resize(below(text.size()));
    if (chance(0.05) && !text.empty()) text[below(text.size())] = static_cast<char>(below(256));
    return text;
  }

  // One to four edits of the log's lines: a line dropped, repeated or cut, a number in it
  // replaced; now and then the whole log cut, or its last newline dropped.
  std::string mutate_log(const std::string& text) {
    std::vector<std::string> lines;
    std::istringstream in(text);
    for (std::string l; std::getline(in, l);) lines.push_back(l);
    static const std::regex number(R"(-?[0-9]+(\.[0-9]+)?(E[+-][0-9]+)?)");
    static const std::vector<std::string> odd = {"0",   "-1", "nan", "inf", "1e400", "99999999999999999999", "",
                                                 "x",   "0.0", "-0", "2147483648", "1e-320", "NAN", "-INF"};
    for (std::size_t k = 1 + below(4); k > 0 && !lines.empty(); --k) {
      const std::size_t i = below(lines.size());
      std::string& line = lines[i];
      switch (below(5)) {
        case 0: lines.erase(lines.begin() + static_cast<long>(i)); break;
        case 1: lines.insert(lines.begin() + static_cast<long>(i), lines[below(lines.size())]); break;
        case 2: line.resize(below(line.size() + 1)); break;
        default: {  // a number replaced
          std::vector<std::smatch> found;
          for (auto it = std::sregex_iterator(line.begin(), line.end(), number); it != std::sregex_iterator(); ++it)
            found.push_back(*it);
          if (found.empty()) break;
          const std::smatch& m = pick(found);
          line = line.substr(0, static_cast<std::size_t>(m.position())) + pick(odd) +
                 line.substr(static_cast<std::size_t>(m.position() + m.length()));
        }
      }
    }
    if (chance(0.05)) lines.resize(below(lines.size() + 1));
    std::string out;
    for (const std::string& l : lines) out += l + "\n";
    if (chance(0.1) && !out.empty()) out.pop_back();
    return out;
  }

 private:
  json odd_value() {
    static const std::vector<json> values = {nullptr, true, false, -1, 0, 1e308, -1e308, 1e-320, "x", "",
                                             json::array(), json::object(), json::array({1, "a"}),
                                             9223372036854775807LL, -9223372036854775807LL - 1, 3.5, 1e20, -0.0, 1};
    return pick(values);
  }
  // An element or member at random, at most six levels down: dropped, repeated, replaced by an
  // odd value, or edited further down.
  void edit(json& v, int depth) {
    if ((v.is_object() || v.is_array()) && !v.empty()) {
      const std::size_t i = below(v.size());
      const double r = std::uniform_real_distribution<double>(0, 1)(rng_);
      if (v.is_object()) {
        auto it = v.begin();
        std::advance(it, static_cast<long>(i));
        if (r < 0.2) v.erase(it.key());
        else if (r < 0.65 && depth < 6) edit(it.value(), depth + 1);
        else it.value() = odd_value();
      } else {
        if (r < 0.2) v.erase(i);
        else if (r < 0.3) v.push_back(v[i]);
        else if (r < 0.7 && depth < 6) edit(v[i], depth + 1);
        else v[i] = odd_value();
      }
      return;
    }
    v = odd_value();
  }

  std::mt19937 rng_;
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::cerr << "usage: epx_evidence_fuzz EPX RESULTS TRACE LOG [--cases N] [--seed S]\n";
    return 2;
  }
  const std::string epx = argv[1];
  const json results = json::parse(fuzz::read_file(argv[2])), trace = json::parse(fuzz::read_file(argv[3]));
  const std::string log = fuzz::read_file(argv[4]);
  const std::string seed_run = std::string(argv[2]) + ":" + argv[3];
  int cases = 300;
  unsigned seed = 20261128;
  for (int i = 5; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--cases") cases = std::atoi(argv[i + 1]);
    if (a == "--seed") seed = static_cast<unsigned>(std::strtoul(argv[i + 1], nullptr, 10));
  }
  fuzz::fail_on_sanitizer_reports();
  const fs::path dir = fs::temp_directory_path() / ("epx_evidence_fuzz_" + std::to_string(getpid()));
  fs::create_directories(dir);
  const std::string results_file = (dir / "results.json").string(), trace_file = (dir / "trace.json").string(),
                    log_file = (dir / "run.log").string(), page = (dir / "report.html").string();

  Mutator m(seed);
  int passed = 0, failed = 0;
  for (int i = 0; i < cases; ++i) {
    // Which input is mutated: the results, the trace, both, or the log (read alone, with a config).
    const std::size_t kind = m.below(4);
    const bool from_log = kind == 3;
    if (from_log) {
      std::ofstream(log_file, std::ios::binary | std::ios::trunc) << m.mutate_log(log);
    } else {
      std::ofstream(results_file, std::ios::binary | std::ios::trunc) << (kind != 1 ? m.mutate_json(results) : results.dump(1));
      std::ofstream(trace_file, std::ios::binary | std::ios::trunc) << (kind != 0 ? m.mutate_json(trace) : trace.dump());
    }
    const std::string run = from_log ? log_file : results_file;
    const bool report = m.chance(0.35), json_out = !report && m.chance(0.5);
    std::vector<std::string> args = {epx};
    if (report) {
      fs::remove(page);
      args.insert(args.end(), {"report", from_log ? run : run + ":" + trace_file, "-o", page});
      if (m.chance(0.3)) args.insert(args.end() - 2, seed_run);  // side by side with the run as it was
    } else {
      args.insert(args.end(), {"diagnose", run});
      if (!from_log) args.insert(args.end(), {"--trace", trace_file});
      if (json_out) args.push_back("--json");
    }
    if (from_log) args.insert(args.end(), {"--config", "qwen3_30b_a3b_proxy", "-g", "cpu"});

    const fuzz::Outcome r = fuzz::run(args, dir, kTimeLimitS);
    std::string problem;
    if (r.timed_out) {
      problem = "did not finish within the time limit";
    } else if (r.code < 0 || r.code > 2) {
      problem = "exit " + std::to_string(r.code) + " (want 0, 1 or 2)";
    } else if (json_out && r.code <= 1 && !json::accept(r.out)) {
      problem = "--json printed invalid JSON";
    } else if (r.code == 2 && r.err.find(run) == std::string::npos && r.err.find(trace_file) == std::string::npos) {
      problem = "exit 2 without naming the file at fault";
    } else if (report && (r.code == 0) != fs::exists(page)) {
      problem = r.code == 0 ? "exit 0 without the page" : "a failed report left a page behind";
    }
    if (problem.empty()) {
      ++passed;
      continue;
    }
    ++failed;
    const fs::path kept = dir / ("failure_" + std::to_string(i));
    fs::create_directories(kept);
    for (const std::string& f : {results_file, trace_file, log_file})
      if (fs::exists(f)) fs::copy_file(f, kept / fs::path(f).filename(), fs::copy_options::overwrite_existing);
    std::cout << "case " << i << ": " << problem << "\n  command:";
    for (std::size_t a = 1; a < args.size(); ++a) std::cout << " '" << args[a] << "'";
    std::cout << "\n  inputs kept in " << kept.string() << "\n  stderr: " << r.err.substr(0, 400) << "\n";
  }
  if (failed == 0) fs::remove_all(dir);
  std::cout << "seed " << seed << ", " << cases << " cases\n" << passed << " passed, " << failed << " failed\n";
  return failed == 0 ? 0 : 1;
}
