// Parsing Megatron-Core's pipeline layout strings, for the check rule pipeline.layout.
#include "epx/check/pipeline_layout.hpp"

#include <algorithm>
#include <regex>

#include <fmt/format.h>

#include "epx/config/config.hpp"

namespace epx {
namespace {

constexpr std::size_t kMaxLayers = std::size_t{1} << 20;

// re.sub(pattern, group(1) * int(group(2)), text), left to right, with the result bounded.
std::string unroll(const std::string& text, const std::regex& pattern, const std::string& layout) {
  std::string out;
  auto last = text.cbegin();
  for (std::sregex_iterator it(text.begin(), text.end(), pattern), end; it != end; ++it) {
    const std::smatch& m = *it;
    out.append(last, m[0].first);
    const std::string times = m[2].str();
    const std::size_t n = times.size() > 7 ? kMaxLayers + 1 : std::stoul(times);
    if (n * m[1].length() + out.size() > kMaxLayers)
      throw ConfigError(fmt::format("pipeline_model_parallel_layout '{}' unrolls to more than {} layers", layout,
                                    kMaxLayers));
    for (std::size_t i = 0; i < n; ++i) out += m[1].str();
    last = m[0].second;
  }
  out.append(last, text.cend());
  return out;
}

}  // namespace

std::vector<std::string> parse_pipeline_layout(const std::string& text) {
  std::string s = text;
  s.erase(std::remove(s.begin(), s.end(), ','), s.end());  // purely cosmetic commas
  static const std::regex group(R"(\(([^)]+)\)\*(\d+))"), single(R"((.)\*(\d+))");
  s = unroll(unroll(s, group, text), single, text);
  std::vector<std::string> stages;
  std::size_t begin = 0;
  while (true) {  // Python's str.split('|'): an empty stage where two bars meet or at either end
    const std::size_t bar = s.find('|', begin);
    stages.push_back(s.substr(begin, bar == std::string::npos ? std::string::npos : bar - begin));
    for (const char c : stages.back())
      if (c != 'E' && c != 'L' && c != 't' && c != 'm')  // Python quotes f"{stage=}", f"{layout_str=}"
        throw ConfigError(fmt::format("Invalid layer character: {} (stage='{}', layout_str='{}'), known layer "
                                      "characters: ['E', 'L', 't', 'm']",
                                      c, stages.back(), s));
    if (bar == std::string::npos) break;
    begin = bar + 1;
  }
  return stages;
}

}  // namespace epx
