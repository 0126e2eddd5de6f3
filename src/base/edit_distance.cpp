#include "epx/base/edit_distance.hpp"

#include <algorithm>
#include <vector>

namespace epx {

std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diag = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] != b[j - 1] ? 1 : 0)});
      diag = up;
    }
  }
  return row[b.size()];
}

std::string nearest_name(const std::vector<std::string>& names, std::string_view word) {
  std::string best;
  std::size_t best_distance = 3;
  for (const std::string& n : names)
    if (const std::size_t d = edit_distance(n, word); d < best_distance) best = n, best_distance = d;
  return best;
}

}  // namespace epx
