// `epx plan --search`: the layouts of a model on N GPUs of one kind (TP, PP, VPP, CP, EP with
// ETP 1, micro-batch size, full recompute or not, dispatcher, EP overlap, delayed wgrad), kept
// when `epx check` passes them without errors and they fit in memory, ranked by predicted step
// time.
#pragma once

#include <set>
#include <string>
#include <vector>

#include "epx/plan/plan.hpp"

namespace epx {

struct SearchRow {
  std::vector<std::string> overrides;  // on top of the config as given (the ones that change it)
  Variant variant;                     // the configured row of that config's plan
};
struct SearchResult {
  std::vector<SearchRow> top;  // best first
  int layouts_tried = 0, configs_checked = 0, passed_check = 0, fit = 0;
  std::string why;  // why the best beats the next
  GpuInfo gpu;      // the target's
  std::set<std::string> unchecked;  // rules the passing configs could not be judged by ("id: what is missing")
};

// `loaded`: the config with target.num_gpus and target.gpu given. `keep`: rows returned.
SearchResult search_layouts(const Config& loaded, const OptString& flex_backend_flag, int keep = 10);
std::string format_search(const SearchResult& r);
nlohmann::json search_json(const SearchResult& r);

}  // namespace epx
