#include "epx/base/env.hpp"

#include <cmath>
#include <cstdlib>

#include <fmt/format.h>

#include "epx/base/error.hpp"

namespace epx {

double read_env(const EnvKnob& knob, const std::map<std::string, std::string>* recipe_env) {
  std::string text;
  if (const char* v = std::getenv(knob.name); v != nullptr && *v != '\0') {
    text = v;
  } else if (recipe_env != nullptr && recipe_env->count(knob.name) != 0) {
    text = recipe_env->at(knob.name);
  } else {
    return knob.fallback;
  }
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  const bool ok = !text.empty() && *end == '\0' && std::isfinite(value) && value >= knob.min &&
                  value <= knob.max && (!knob.whole || value == std::floor(value));
  if (!ok) {
    // Whole numbers as they are typed (2147483647, not 2.14748e+09).
    const auto number = [](double v) { return v == std::floor(v) && std::fabs(v) < 1e15 ? fmt::format("{:.0f}", v) : fmt::format("{:g}", v); };
    const bool has_default = knob.fallback >= knob.min && knob.fallback <= knob.max;  // else unset means "not set"
    throw ConfigError(fmt::format("{}='{}': expected {} from {} to {} ({}; {}); set {}={} or unset it", knob.name, text,
                                  knob.whole ? "a whole number" : "a number", number(knob.min), number(knob.max),
                                  knob.what, has_default ? "default " + number(knob.fallback) : "not set by default",
                                  knob.name, number(has_default ? knob.fallback : knob.min)));
  }
  return value;
}

std::optional<std::string> env_path(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

}  // namespace epx
