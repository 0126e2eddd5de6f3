// Python's int() of a string, as the Megatron-Bridge harness's argparse `type=int` and HybridEP's
// environment variables read numbers: decimal only (leading zeros stay decimal), an optional sign,
// `_` between digits, spaces around.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace epx {

// The value as plain decimal text ("-12", leading zeros dropped), or nothing where int() raises.
inline std::optional<std::string> python_int_text(std::string_view s) {
  const char* space = " \t\n\r\f\v";
  const std::size_t first = s.find_first_not_of(space);
  if (first == std::string_view::npos) return std::nullopt;
  s = s.substr(first, s.find_last_not_of(space) - first + 1);
  std::string sign;
  if (s.front() == '+' || s.front() == '-') {
    if (s.front() == '-') sign = "-";
    s.remove_prefix(1);
  }
  const auto is_digit = [&](std::size_t i) { return i < s.size() && s[i] >= '0' && s[i] <= '9'; };
  std::string digits;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (is_digit(i)) digits += s[i];
    else if (!(s[i] == '_' && i > 0 && is_digit(i - 1) && is_digit(i + 1))) return std::nullopt;
  }
  if (digits.empty()) return std::nullopt;
  digits.erase(0, std::min(digits.find_first_not_of('0'), digits.size() - 1));  // 010 is ten
  return digits == "0" ? digits : sign + digits;
}

}  // namespace epx
