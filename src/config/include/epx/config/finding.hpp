// One result of checking a configuration: what rule, how bad, which fields, why, and the fix.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace epx {

enum class Severity { error, warning, advice };

const char* to_string(Severity s);

struct Finding {
  std::string rule_id;
  Severity severity = Severity::error;
  std::vector<std::pair<std::string, std::string>> values;  // field -> value as YAML text
  std::string message;  // the reason, in Megatron's words where Megatron has them
  std::string fix;      // an override to paste ("model.x=1"), or advice text; may be empty
};

}  // namespace epx
