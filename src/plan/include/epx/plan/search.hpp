// `epx plan --search`: every legal layout of a model on N GPUs of one kind (TP, PP, VPP, CP, EP,
// ETP, micro-batch size, recompute, dispatcher, EP overlap, delayed wgrad), kept when `epx
// check` passes it without errors and it fits in memory, ranked by predicted throughput.
#pragma once

#include <string>
#include <vector>

#include "epx/plan/plan.hpp"

namespace epx {

struct SearchRow {
  std::vector<std::string> overrides;  // on top of the config as given
  Variant variant;                     // the configured row of that config's plan
  double compute_s = 0, bubble_s = 0;
};
struct SearchResult {
  std::vector<SearchRow> top;  // best first
  int layouts_tried = 0, configs_checked = 0, passed_check = 0, fit = 0;
  std::string why;  // why the best beats the next
};

// `loaded`: the config with target.num_gpus and target.gpu given. `keep`: rows returned.
SearchResult search_layouts(const Config& loaded, const OptString& flex_backend_flag, int keep = 10);
std::string format_search(const SearchResult& r);

}  // namespace epx
