// Validators for numeric options: CLI11's PositiveNumber refuses 0 as "not in range 0.000000 to
// 1.797...e308"; these say what to give instead.
#pragma once

#include <charconv>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "epx/base/env.hpp"
#include "epx/base/python_int.hpp"

namespace epx::cli {

inline CLI::Validator above(double least, bool inclusive, const char* name) {
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        double v = 0;
        if (!CLI::detail::lexical_cast(text, v) || !std::isfinite(v) || (inclusive ? v < least : v <= least))
          return "must be a number " + std::string(inclusive ? "at least " : "above ") + CLI::detail::to_string(least) +
                 ", got " + text;
        return {};
      },
      name);
}

// `text` as a whole number from `least` to `most`, else nothing: for what the option validators
// do not see (the words of a list option, the cluster's state file).
inline std::optional<std::int64_t> whole_number(std::string_view text, std::int64_t least, std::int64_t most) {
  std::int64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || v < least || v > most) return std::nullopt;
  return v;
}

// The harness's integer flags are argparse's `type=int`, Python's int(): decimal, leading zeros
// kept decimal, a sign, `_` between digits, spaces around. CLI11 alone reads 010 as octal 8, 0x10
// as 16 and clamps 10^20 to 2^63 - 1; this hands it the plain decimal digits, or refuses.
inline const CLI::Validator kPythonInt(
    [](std::string& text) -> std::string {
      const std::optional<std::string> value = python_int_text(text);
      if (!value) return "expected an integer (as Python's int() reads it), got '" + text + "'";
      if (value->size() > 19) return "'" + text + "' is out of range (more than 18 digits)";
      text = *value;
      return {};
    },
    "");  // no name: the help shows the option's type alone

inline const CLI::Validator kPositive = above(0, false, "POSITIVE");
inline const CLI::Validator kNonNegative = above(0, true, "NONNEGATIVE");

// --collective-timeout: the range EPX_COLLECTIVE_TIMEOUT has (1e10 s overflowed the start-up
// watchdog's deadline and aborted the job at once).
inline const CLI::Validator kCollectiveTimeout(
    [](std::string& text) -> std::string {
      double v = 0;
      const EnvKnob& k = env::kCollectiveTimeout;
      if (!CLI::detail::lexical_cast(text, v) || !std::isfinite(v) || v < k.min || v > k.max)
        return fmt::format("must be seconds from {:g} to {:g}, got {}", k.min, k.max, text);
      return {};
    },
    "SECONDS");

}  // namespace epx::cli
