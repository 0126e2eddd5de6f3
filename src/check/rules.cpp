// The rule table, one file per area (rules_*.cpp, in this order): layout, the model (MoE, FP8,
// recompute), the MLP activation, the attention's window, Megatron-Bridge's EP-overlap asserts in its order (with
// Megatron-Core's extra ones after), the optimizer and epx's gradient reduction, delay_wgrad, what
// finalize raises, flex backends and HybridEP topology, what Megatron raises at build or first
// step, the seeds' pitfalls and advice, then CUDA graphs. Messages quote Megatron where Megatron
// has a message.

#include "rule_helpers.hpp"

namespace epx {
namespace {

std::vector<Rule> build_rules() {
  using namespace rule_helpers;
  RuleTable table;
  add_layout_rules(table);
  add_model_rules(table);
  add_activation_rules(table);
  add_attention_rules(table);
  add_ep_overlap_rules(table);
  add_optimizer_rules(table);
  add_delay_wgrad_rules(table);
  add_finalize_rules(table);
  add_flex_rules(table);
  add_first_step_rules(table);
  add_advice_rules(table);
  add_cuda_graph_rules(table);
  return table.rules;
}

}  // namespace

const std::vector<Rule>& rules() {
  static const std::vector<Rule> table = build_rules();
  return table;
}

const Rule* find_rule(std::string_view id) {
  for (const auto& r : rules())
    if (r.id == id) return &r;
  return nullptr;
}

}  // namespace epx
