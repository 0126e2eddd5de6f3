// The warnings epx check found on a config that plan and advise go on to use: they print no
// report of their own, so the rules that fired are named, for `epx check` to explain.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "epx/check/check.hpp"

namespace epx::cli {

// "" when the check found no warning, else one line naming each warning's rule.
std::string check_warnings_line(const CheckReport& report, const char* command);
// The warnings' rule ids, for --json.
nlohmann::json check_warning_ids(const CheckReport& report);

}  // namespace epx::cli
