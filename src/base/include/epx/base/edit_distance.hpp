// Levenshtein distance, for the "did you mean" hints of keys and commands.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace epx {

std::size_t edit_distance(std::string_view a, std::string_view b);

// The name in `names` nearest `word`, within two edits (the first of equals); "" when none is.
std::string nearest_name(const std::vector<std::string>& names, std::string_view word);

}  // namespace epx
