#include "same_job.hpp"

#include <sstream>
#include <vector>

#include <fmt/format.h>

#include "epx/base/error.hpp"
#include "epx/comm/collectives.hpp"

namespace epx::cli {
namespace {

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    line.erase(line.find_last_not_of(' ') + 1);  // allgather_text pads with spaces
    out.push_back(line);
  }
  return out;
}

// The first line that differs, as "section.line" (a YAML dump's sections are its unindented lines).
std::pair<std::string, std::string> first_difference(const std::string& a, const std::string& b) {
  const std::vector<std::string> x = lines_of(a), y = lines_of(b);
  std::string section;
  for (std::size_t i = 0; i < std::max(x.size(), y.size()); ++i) {
    const std::string u = i < x.size() ? x[i] : "(nothing)", v = i < y.size() ? y[i] : "(nothing)";
    if (u != v) {
      const auto in_section = [&](const std::string& s) {
        return s.starts_with(" ") && !section.empty() ? section + "." + s.substr(s.find_first_not_of(' ')) : s;
      };
      return {in_section(u), in_section(v)};
    }
    if (!u.empty() && !u.starts_with(" ")) section = u.substr(0, u.find(':'));
  }
  return {"", ""};
}

}  // namespace

void require_same_job(Communicator& world, const std::string& job) {
  if (world.size() <= 1) return;
  const std::vector<std::string> jobs = allgather_text(world, job);
  for (std::size_t r = 1; r < jobs.size(); ++r) {
    if (jobs[r] == jobs[0]) continue;
    const auto [theirs, first] = first_difference(jobs[r], jobs[0]);
    throw ConfigError(fmt::format("rank {} was started with another job than rank 0: '{}' on rank {}, '{}' on rank 0; "
                                  "launch every rank with the same config, overrides and flags",
                                  r, theirs, r, first));
  }
}

}  // namespace epx::cli
