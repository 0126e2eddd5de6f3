// Parsing Megatron-Core's pipeline layout strings, for the check rule pipeline.layout.
#include "epx/check/pipeline_layout.hpp"

#include <algorithm>
#include <cctype>

#include <fmt/format.h>

#include "epx/config/config.hpp"

namespace epx {
namespace {

constexpr std::size_t kMaxLayers = std::size_t{1} << 20;

// re.sub(pattern, group(1) * int(group(2)), text) for Megatron's two patterns, scanned by hand
// (std::regex recurses per character and overflows the stack on long runs): `groups` is
// r'\(([^)]+)\)\*(\d+)', else r'(.)\*(\d+)'. Leftmost matches, as re.sub; the result is bounded.
std::string unroll(const std::string& s, bool groups, const std::string& layout) {
  std::string out;
  std::size_t i = 0;
  while (i < s.size()) {
    std::size_t begin = i, end = i;  // the repeated text s[begin, end), if this is a match
    if (groups) {
      const std::size_t close = s[i] == '(' ? s.find(')', i + 1) : std::string::npos;
      if (close != std::string::npos && close > i + 1) begin = i + 1, end = close;
    } else if (s[i] != '\n') {
      end = i + 1;
    }
    const std::size_t star = groups ? end + 1 : end;
    if (end > begin && star + 1 < s.size() && s[star] == '*' && std::isdigit(static_cast<unsigned char>(s[star + 1]))) {
      std::size_t next = star + 1, times = 0;
      for (; next < s.size() && std::isdigit(static_cast<unsigned char>(s[next])); ++next)
        times = std::min(times * 10 + static_cast<std::size_t>(s[next] - '0'), kMaxLayers + 1);  // leading zeros too
      if (out.size() + times * (end - begin) > kMaxLayers)
        throw ConfigError(fmt::format("pipeline_model_parallel_layout '{}' unrolls to more than {} layers", layout,
                                      kMaxLayers));
      for (std::size_t k = 0; k < times; ++k) out.append(s, begin, end - begin);
      i = next;
    } else {
      out += s[i++];
    }
  }
  return out;
}

// Python's repr of a str, as an f-string's {x=} prints it (quotes, backslashes, newlines).
std::string py_repr(const std::string& s) {
  const char quote = s.find('\'') != std::string::npos && s.find('"') == std::string::npos ? '"' : '\'';
  std::string out(1, quote);
  for (const char c : s) {
    if (c == '\\' || c == quote) out += '\\';
    if (c == '\n') out += "\\n";
    else out += c;
  }
  return out + quote;
}

}  // namespace

std::vector<std::string> parse_pipeline_layout(const std::string& text) {
  std::string s = text;
  s.erase(std::remove(s.begin(), s.end(), ','), s.end());  // purely cosmetic commas
  s = unroll(unroll(s, true, text), false, text);
  std::vector<std::string> stages;
  std::size_t begin = 0;
  while (true) {  // Python's str.split('|'): an empty stage where two bars meet or at either end
    const std::size_t bar = s.find('|', begin);
    stages.push_back(s.substr(begin, bar == std::string::npos ? std::string::npos : bar - begin));
    for (const char c : stages.back())
      if (c != 'E' && c != 'L' && c != 't' && c != 'm')
        throw ConfigError(fmt::format("Invalid layer character: {} (stage={}, layout_str={}), known layer "
                                      "characters: ['E', 'L', 't', 'm']",
                                      c, py_repr(stages.back()), py_repr(s)));
    if (bar == std::string::npos) break;
    begin = bar + 1;
  }
  return stages;
}

std::string pipeline_layout_text(const std::vector<Int>& layers, Int mtp) {
  std::string out;
  for (std::size_t k = 0; k < layers.size(); ++k) {
    if (k > 0) out += '|';
    if (k == 0) out += 'E';
    const Int n = layers[k];
    out += n > 2 ? fmt::format("t*{}", n) : std::string(static_cast<std::size_t>(std::max<Int>(0, n)), 't');
    if (k + 1 == layers.size()) out += std::string(static_cast<std::size_t>(std::max<Int>(0, mtp)), 'm') + 'L';
  }
  return out;
}

}  // namespace epx
