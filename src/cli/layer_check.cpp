#include "layer_check.hpp"

#include <algorithm>

#include "epx/check/check.hpp"

namespace epx::cli {

std::optional<std::string> layer_check_errors(const Config& loaded, const OptString& flex_backend_flag) {
  CheckReport report = run_check(loaded, flex_backend_flag);
  std::erase_if(report.findings, [](const Finding& f) {
    const bool layer_rule = f.rule_id.starts_with("model.") || f.rule_id.starts_with("moe.") ||
                            f.rule_id.starts_with("precision.");
    return f.severity != Severity::error || !layer_rule;
  });
  if (report.findings.empty()) return std::nullopt;
  report.unchecked.clear();
  report.ignored_note.clear();
  return format_report(report);
}

}  // namespace epx::cli
