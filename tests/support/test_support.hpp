// Helpers shared by the unit tests.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "epx/base/error.hpp"
#include "epx/config/config.hpp"

namespace epx::test {

inline std::string recipe_path(const std::string& name) {
  return std::string(EPX_RECIPES) + "/" + name + ".yaml";
}

// The message of the error `fn` throws (a ConfigError, or an InputError with
// error_of<InputError>), "(no error)" when it throws none.
template <class Error = ConfigError>
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

inline Config load_with(const std::string& recipe, const std::vector<std::string>& overrides) {
  Config c = load_config_file(recipe_path(recipe));
  for (const auto& o : overrides) apply_override(c, o);
  return c;
}

}  // namespace epx::test
