// How long the pre-flight checker takes: load + overrides + resolve + every rule, per recipe.
// A checker meant to run before every launch should cost milliseconds, not seconds.
#include <benchmark/benchmark.h>

#include "epx/check/check.hpp"

namespace {

void BM_LoadRecipe(benchmark::State& state, const char* name) {
  const auto path = epx::resolve_recipe(name);
  for (auto _ : state) benchmark::DoNotOptimize(epx::load_config_file(path));
}

void BM_CheckRecipe(benchmark::State& state, const char* name) {
  const epx::Config cfg = epx::load_config_file(epx::resolve_recipe(name));
  for (auto _ : state) benchmark::DoNotOptimize(epx::run_check(cfg));
}

void BM_DumpYaml(benchmark::State& state, const char* name) {
  const epx::Config cfg = epx::resolve_config(epx::load_config_file(epx::resolve_recipe(name)), {});
  for (auto _ : state) benchmark::DoNotOptimize(epx::dump_yaml(cfg));
}

BENCHMARK_CAPTURE(BM_LoadRecipe, qwen3_30b_a3b, "qwen3_30b_a3b");
BENCHMARK_CAPTURE(BM_LoadRecipe, deepseek_v3, "deepseek_v3");
BENCHMARK_CAPTURE(BM_CheckRecipe, qwen3_30b_a3b, "qwen3_30b_a3b");
BENCHMARK_CAPTURE(BM_CheckRecipe, qwen3_235b_a22b, "qwen3_235b_a22b");
BENCHMARK_CAPTURE(BM_CheckRecipe, deepseek_v3, "deepseek_v3");
BENCHMARK_CAPTURE(BM_DumpYaml, qwen3_30b_a3b, "qwen3_30b_a3b");

}  // namespace
