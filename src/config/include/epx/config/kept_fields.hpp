// Reading the fields a config keeps without a typed member (Config::extra_fields): a Bridge dump's
// model flags that only some of epx's parts model.
#pragma once

#include <string>

#include <yaml-cpp/yaml.h>

#include "epx/config/config.hpp"

namespace epx {

// Whether `section.name` is kept and set to a YAML true (true, True, yes); false when absent,
// None or anything else.
inline bool kept_flag(const Config& c, const std::string& section, const std::string& name) {
  const YAML::Node n = c.extra_fields.child_map(section)[name];
  bool v = false;
  return n.IsDefined() && n.IsScalar() && YAML::convert<bool>::decode(n, v) && v;
}

}  // namespace epx
