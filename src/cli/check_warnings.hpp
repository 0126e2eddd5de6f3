// The warnings epx check found on a config that plan and advise go on to use: they print no
// report of their own, so the rules that fired are named, for `epx check` to explain.
#pragma once

#include <string>
#include <vector>

#include "epx/check/check.hpp"

namespace epx::cli {

// The warnings' rule ids (--json's check_warnings).
std::vector<std::string> check_warning_ids(const CheckReport& report);
// "" when the check found no warning, else one line naming each warning's rule.
std::string check_warnings_line(const CheckReport& report, const char* command);

}  // namespace epx::cli
