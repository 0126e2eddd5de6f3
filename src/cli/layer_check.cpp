#include "layer_check.hpp"

#include <algorithm>
#include <vector>

#include "epx/check/check.hpp"

namespace epx::cli {

namespace {

// The rules on what one MoE layer computes: routing, experts, dispatch and precision, and the
// activation's (rules_activation.cpp). Not the attention's, the layer pattern's or training's.
bool is_layer_rule(const std::string& id) {
  static const std::vector<std::string> kActivation = {"model.fused_activation", "model.fused_activation_module",
                                                       "model.te_activation", "model.swiglu_clamp"};
  if (id == "moe.layer_pattern_length") return false;
  return id.starts_with("moe.") || id.starts_with("precision.") ||
         std::find(kActivation.begin(), kActivation.end(), id) != kActivation.end();
}

}  // namespace

std::optional<std::string> layer_check_errors(const Config& loaded, const OptString& flex_backend_flag) {
  CheckReport report = run_check(loaded, flex_backend_flag);
  std::erase_if(report.findings,
                [](const Finding& f) { return f.severity != Severity::error || !is_layer_rule(f.rule_id); });
  if (report.findings.empty()) return std::nullopt;
  report.unchecked.clear();
  report.ignored_note.clear();
  return format_report(report);
}

}  // namespace epx::cli
