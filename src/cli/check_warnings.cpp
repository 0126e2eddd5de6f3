#include "check_warnings.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace epx::cli {

std::vector<std::string> check_warning_ids(const CheckReport& report) {
  std::vector<std::string> ids;
  for (const Finding& f : report.findings)
    if (f.severity == Severity::warning) ids.push_back(f.rule_id);
  return ids;
}

std::string check_warnings_line(const CheckReport& report, const char* command) {
  const std::vector<std::string> ids = check_warning_ids(report);
  if (ids.empty()) return "";
  return fmt::format("epx {}: epx check warns on this config ({}): epx check with the same config, target flags and "
                     "overrides explains {}\n",
                     command, fmt::join(ids, ", "), ids.size() == 1 ? "it" : "them");
}

}  // namespace epx::cli
