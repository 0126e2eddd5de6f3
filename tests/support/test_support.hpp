// Helpers shared by the unit tests.
#pragma once

#include <string>
#include <vector>

#include "epx/config/config.hpp"

namespace epx::test {

inline std::string recipe_path(const std::string& name) {
  return std::string(EPX_RECIPES) + "/" + name + ".yaml";
}

inline Config load_with(const std::string& recipe, const std::vector<std::string>& overrides) {
  Config c = load_config_file(recipe_path(recipe));
  for (const auto& o : overrides) apply_override(c, o);
  return c;
}

}  // namespace epx::test
