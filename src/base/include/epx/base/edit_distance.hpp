// Levenshtein distance, for the "did you mean" hints of keys and commands.
#pragma once

#include <cstddef>
#include <string_view>

namespace epx {

std::size_t edit_distance(std::string_view a, std::string_view b);

}  // namespace epx
