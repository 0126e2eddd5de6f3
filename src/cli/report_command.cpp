#include "report_command.hpp"

#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "epx/base/env.hpp"
#include "epx/base/error.hpp"
#include "epx/base/output_file.hpp"
#include "epx/check/check.hpp"
#include "report_page.hpp"
#include "run_diagnosis.hpp"

namespace epx::cli {
namespace {

// plotly.js-basic-dist-min as scripts/setup.sh leaves it.
std::filesystem::path plotly_path() {
  return std::filesystem::path(env_path(env::kVendorDir).value_or(EPX_BUILD_VENDOR_DIR)) / "plotly-basic.min.js";
}

std::string plotly_source() {
  const std::filesystem::path file = plotly_path();
  const std::string fix = fmt::format("run scripts/setup.sh (it fetches plotly.js-basic-dist-min from the npm registry), "
                                      "or set {} to its folder",
                                      env::kVendorDir);
  std::error_code ec;
  std::ifstream in(file, std::ios::binary);
  if (!std::filesystem::is_regular_file(file, ec) || !in)
    throw EnvironmentError(fmt::format("{}: the plotting library is not installed; {}", file.string(), fix));
  std::stringstream s;
  s << in.rdbuf();
  // The package's file opens with its banner: "plotly.js (basic - minified) vX".
  if (s.str().substr(0, 256).find("plotly.js") == std::string::npos)
    throw EnvironmentError(fmt::format("{}: not the plotting library (its first lines do not name plotly.js); {}",
                                       file.string(), fix));
  return s.str();
}

// The library's text safe inside a <script> element: no "</" closes it early.
std::string script_safe(std::string text) {
  for (std::size_t at = 0; (at = text.find("</", at)) != std::string::npos; at += 3) text.replace(at, 2, "<\\/");
  return text;
}

// JSON safe inside a <script> element whatever its strings hold: every '<' (only ever inside a
// string) as \u003c, so neither "</script" nor "<!--" can change how the page parses; bytes that
// are not UTF-8 (a path in another encoding) replaced.
std::string json_in_script(const nlohmann::json& j) {
  const std::string text = json_text(j);
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    if (c == '<') out += "\\u003c";
    else out += c;
  }
  return out;
}

void replace_once(std::string& page, const std::string& marker, const std::string& with) {
  const auto at = page.find(marker);
  if (at == std::string::npos) throw std::logic_error("report page template: no " + marker);
  page.replace(at, marker.size(), with);
}

nlohmann::json run_json(const DiagnosedRun& d, const std::string& label) {
  const RunEvidence& r = d.run;
  nlohmann::json j{{"label", label},
                   {"source", r.source},
                   {"kind", r.kind},
                   {"layout", r.layout},
                   {"dispatcher", r.dispatcher},
                   {"schedule", r.schedule},
                   {"recompute", !r.recompute.empty() ? r.recompute
                                 : d.config           ? d.config->model.recompute_granularity.value_or("none")
                                                      : "-"},
                   {"mean_step_s", r.mean_step_s},
                   {"tflops_per_gpu", d.diagnosis.tflops_per_gpu ? nlohmann::json(*d.diagnosis.tflops_per_gpu)
                                                                 : nlohmann::json(nullptr)},
                   {"peak_memory_gb", r.peak_memory_gb > 0 ? nlohmann::json(r.peak_memory_gb) : nlohmann::json(nullptr)},
                   {"capacity_gb", d.gpu ? d.gpu->rates.memory_gb : 0.0},
                   {"final_loss", r.final_loss},
                   {"config", d.config ? dump_yaml(*d.config) : ""},
                   {"diagnosis", diagnosis_json(r, d.diagnosis)},
                   {"iterations", nlohmann::json::array()},
                   {"spans", nlohmann::json::array()}};
  for (const IterationPoint& p : r.iterations)
    j["iterations"].push_back({{"iteration", p.iteration}, {"step_s", p.step_s}, {"lm_loss", p.lm_loss},
                               // null where the log has no memory line for the iteration: a gap, not 0
                               {"mem_max_allocated_gb", p.mem_max_allocated_gb > 0 ? nlohmann::json(p.mem_max_allocated_gb)
                                                                                   : nlohmann::json(nullptr)}});
  for (const TraceSpan& s : r.spans)
    j["spans"].push_back({{"rank", s.rank}, {"thread", s.thread}, {"track", s.track}, {"name", s.name},
                          {"begin", s.begin_s}, {"end", s.end_s}});
  return j;
}

}  // namespace

void ReportArgs::add_to(CLI::App& app) {
  app.add_option("RUN", runs, "RESULTS[:TRACE] of `epx run --results/--trace`, or a Megatron log; several: side by side")
      ->required();
  app.add_option("-o,--output", output, "the HTML file to write")->required();
  add_run_source_options(app, source);
  app.add_option("--hardware", hardware, "a YAML file of hardware entries to add or override (e.g. from --calibrate)")
      ->allow_extra_args(false);  // one value per occurrence: a following override stays one
}

int run_report_command(const ReportArgs& args) {
  std::vector<NamedPath> inputs;  // every RUN as a file, and as RESULTS:TRACE
  for (const std::string& spec : args.runs) {
    inputs.push_back({"RUN", spec});
    if (const auto colon = spec.rfind(':'); colon != std::string::npos)
      inputs.insert(inputs.end(), {{"RUN", spec.substr(0, colon)}, {"RUN's trace", spec.substr(colon + 1)}});
  }
  if (args.source.config) inputs.push_back({"--config", *args.source.config});
  for (const std::string& file : args.hardware) inputs.push_back({"--hardware", file});
  inputs.push_back({"the plotting library", plotly_path().string()});
  check_output_path(args.output, "-o", inputs);
  for (const std::string& file : args.hardware) add_hardware_file(file);
  std::string page = report_page_template();
  const std::string plotly = plotly_source();
  nlohmann::json data{{"generated", EPX_VERSION_TEXT}, {"runs", nlohmann::json::array()}};
  std::map<std::string, int> labels;
  for (const std::string& spec : args.runs) {
    // RESULTS:TRACE, unless the whole argument is a file (a name with a colon).
    const auto colon = spec.rfind(':');
    const bool traced = !std::filesystem::exists(spec) && colon != std::string::npos && colon > 0 && colon + 1 < spec.size();
    if (!std::filesystem::exists(spec) && colon != std::string::npos && !traced)
      throw ConfigError(fmt::format("RUN '{}': RESULTS:TRACE takes the run's results before the colon and its trace after "
                                    "it; give both, or the results alone",
                                    spec));
    const std::string results = traced ? spec.substr(0, colon) : spec;
    const std::optional<std::string> trace = traced ? std::optional(spec.substr(colon + 1)) : std::nullopt;
    const DiagnosedRun d = diagnose_run(results, trace, args.source);
    // Labels name the runs in the plots: the file's stem, numbered when two runs share it.
    std::string label = std::filesystem::path(results).stem().string();
    if (const int seen = labels[label]++; seen > 0) label += fmt::format(" ({})", seen + 1);
    data["runs"].push_back(run_json(d, label));
  }
  replace_once(page, "/*EPX_DATA*/", json_in_script(data));
  replace_once(page, "/*EPX_PLOTLY*/", script_safe(plotly));
  write_file_atomically(args.output, [&](std::ostream& out) { out << page; });
  std::cout << fmt::format("wrote {} ({} run{}, {:.2g} MB)\n", args.output, args.runs.size(), args.runs.size() == 1 ? "" : "s",
                           static_cast<double>(page.size()) / 1e6);
  return kExitOk;
}

}  // namespace epx::cli
