// ASCII lower case, for names compared without case (GPU names, booleans, backends, version
// tags). Bytes past ASCII stay as they are, whatever the locale.
#pragma once

#include <string>
#include <string_view>

namespace epx {

inline std::string to_lower(std::string_view text) {
  std::string s(text);
  for (char& c : s)
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  return s;
}

}  // namespace epx
