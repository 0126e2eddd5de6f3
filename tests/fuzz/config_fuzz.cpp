// A seeded fuzzer for epx's config front end: mutated recipes and Megatron-Bridge dumps, odd
// overrides and flags, fed to `epx check` (text and --json), `epx plan`, `epx advise` and `epx
// config show` as separate processes, the planner's now and then with a mutated hardware catalog
// (--hardware). Every run must end within a time limit with exit 0, 1 or 2 (never 3, "a bug in
// epx", nor a signal); --json must print valid JSON; a plan or advice must print no NaN or
// infinity; an exit 2 must name the file, a key, a flag or a line.
// Usage: epx_config_fuzz EPX DATA_DIR... [--hardware CATALOG] [--cases N] [--seed S]
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "fuzz_process.hpp"

namespace {

using fuzz::Outcome;
using fuzz::read_file;
namespace fs = std::filesystem;
constexpr double kTimeLimitS = 10;

class Mutator {
 public:
  explicit Mutator(unsigned seed) : rng_(seed) {}

  std::size_t below(std::size_t n) { return n == 0 ? 0 : std::uniform_int_distribution<std::size_t>(0, n - 1)(rng_); }
  template <class T>
  const T& pick(const std::vector<T>& v) { return v[below(v.size())]; }
  bool chance(double p) { return std::uniform_real_distribution<double>(0, 1)(rng_) < p; }

  std::string odd_value() {
    static const std::vector<std::string> values = {
        "99999999999999999999", "-1", "0", "null", "None", "[]", "{}", "[[[[", "&a x", "*a",
        "\xff\xfe\xc3", "1e999", "nan", "true", "'h900'", "~", "[1, [2, [3]]]", "{a: {b: c}}",
        "\"\\u0000\"", "!!binary AAAA", "2.5.1", "h100", "flex", "2", "18446744073709551617",
        std::string(3000, 'a'), "| \n  x", "*undefined_alias", "{<<: {a: 1}}", "[{<<: [1]}]"};
    return pick(values);
  }

  std::string mutate(std::string text) {
    const int edits = 1 + static_cast<int>(below(3));
    for (int i = 0; i < edits && !text.empty(); ++i) {
      switch (below(9)) {
        case 0: text[below(text.size())] = static_cast<char>(below(256)); break;
        case 1: text.insert(below(text.size()), random_bytes(1 + below(8))); break;
        case 2: text = delete_line(text); break;
        case 3: text = duplicate_line(text); break;
        case 4: text = replace_value(text); break;
        case 5: text = rename_key(text); break;
        case 6: text += "\ndataset:\n  a: &a [x, x, x, x, x, x, x, x]\n  b: &b [*a, *a, *a, *a, *a, *a, *a, *a]\n"
                        "  c: &c [*b, *b, *b, *b, *b, *b, *b, *b]\n  d: [*c, *c, *c, *c, *c, *c, *c, *c]\n";
          break;
        case 7: text.resize(below(text.size())); break;
        case 8: text += "\nmodel:\n  x: " + std::string(40 + below(80), '[') + "\n"; break;
      }
    }
    return text;
  }

 private:
  std::string random_bytes(std::size_t n) {
    std::string s;
    for (std::size_t i = 0; i < n; ++i) s += static_cast<char>(below(256));
    return s;
  }
  std::vector<std::string> lines(const std::string& text) {
    std::vector<std::string> v;
    std::istringstream in(text);
    for (std::string l; std::getline(in, l);) v.push_back(l);
    return v;
  }
  std::string join(const std::vector<std::string>& v) {
    std::string s;
    for (const auto& l : v) s += l + "\n";
    return s;
  }
  std::string delete_line(const std::string& text) {
    auto v = lines(text);
    if (!v.empty()) v.erase(v.begin() + static_cast<long>(below(v.size())));
    return join(v);
  }
  std::string duplicate_line(const std::string& text) {
    auto v = lines(text);
    if (!v.empty()) {
      const auto at = below(v.size());
      v.insert(v.begin() + static_cast<long>(at), v[at]);
    }
    return join(v);
  }
  std::string replace_value(const std::string& text) {
    auto v = lines(text);
    for (int tries = 0; tries < 20 && !v.empty(); ++tries) {
      auto& l = v[below(v.size())];
      const auto colon = l.find(": ");
      if (colon == std::string::npos) continue;
      l = l.substr(0, colon + 2) + odd_value();
      break;
    }
    return join(v);
  }
  std::string rename_key(const std::string& text) {
    static const std::vector<std::string> keys = {
        "num_moe_experts", "expert_model_parallel_size", "gpu", "num_gpus", "torch_version",
        "moe_router_topk", "moe_token_dispatcher_type", "global_batch_size", "micro_batch_size",
        "num_moe_expert", "tensor_model_paralel_size", "_target_", "data_parallel_size", "<<", "'<<'"};
    auto v = lines(text);
    for (int tries = 0; tries < 20 && !v.empty(); ++tries) {
      auto& l = v[below(v.size())];
      const auto colon = l.find(':');
      const auto indent = l.find_first_not_of(' ');
      if (colon == std::string::npos || indent == std::string::npos || indent >= colon) continue;
      l = l.substr(0, indent) + pick(keys) + l.substr(colon);
      break;
    }
    return join(v);
  }

  std::mt19937 rng_;
};

// Whether a plan's JSON holds a null where a time, size or rate goes (nlohmann writes a NaN or
// an infinity as null).
bool null_figure(const nlohmann::json& j) {
  if (j.is_array()) return std::any_of(j.begin(), j.end(), null_figure);
  if (!j.is_object()) return false;
  for (const auto& [key, value] : j.items())
    if ((value.is_null() && (key.ends_with("_s") || key.ends_with("_gb") || key.ends_with("_gpu"))) || null_figure(value))
      return true;
  return false;
}

// An exit 2 names where the problem is: the file, a dotted key, a flag or a line.
bool names_a_place(const std::string& err, const std::string& file) {
  if (err.find(file) != std::string::npos) return true;
  for (const char* s : {"model.", "target.", "train.", "comm_overlap", "ddp.", "optimizer.",
                        "scheduler.", "rng.", "env_vars", "--", "-ng", "-g", "line", "override"})
    if (err.find(s) != std::string::npos) return true;
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: epx_config_fuzz EPX DATA_DIR... [--hardware CATALOG] [--cases N] [--seed S]\n";
    return 2;
  }
  const std::string epx = argv[1];
  std::vector<std::string> corpus;
  std::string hardware;  // the catalog's text, mutated for --hardware
  int cases = 300;
  unsigned seed = 20261123;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--hardware" && i + 1 < argc) {
      hardware = read_file(argv[++i]);
    } else if (a == "--cases" && i + 1 < argc) {
      cases = std::atoi(argv[++i]);
    } else if (a == "--seed" && i + 1 < argc) {
      seed = static_cast<unsigned>(std::strtoul(argv[++i], nullptr, 10));
    } else {
      for (const auto& e : fs::directory_iterator(a))
        if (e.path().extension() == ".yaml") corpus.push_back(read_file(e.path()));
    }
  }
  if (corpus.empty()) {
    std::cerr << "no .yaml files in the data directories\n";
    return 2;
  }
  fuzz::fail_on_sanitizer_reports();
  const fs::path dir = fs::temp_directory_path() / ("epx_fuzz_" + std::to_string(getpid()));
  fs::create_directories(dir);
  const std::string file = (dir / "case.yaml").string(), hardware_file = (dir / "hardware.yaml").string();

  Mutator m(seed);
  const std::vector<std::vector<std::string>> flag_sets = {
      {"--torch-version", "99999999999999999999.0"}, {"--te-version", "2.6.0rc1+git12"},
      {"--torch-version", "not-a-version"}, {"-ng", "16"}, {"-ng", "0"}, {"-ng", "-4"},
      {"-ng", "99999999999999999999"}, {"-g", "h100"}, {"-g", "h900"}, {"-g", "gb200"},
      {"-ep", "3"}, {"--moe_flex_dispatcher_backend", "hybridep"}, {"--moe_a2a_overlap", "maybe"},
      {"--moe_a2a_overlap", "true"}, {"-gb", "7"}, {"--te-version", std::string(300, '9')},
      {"-ep", "0"}, {"-tp", "0"}, {"-pp", "0"}, {"-cp", "-2"}, {"-mb", "0"}, {"-gb", "-8"},
      {"-et", "0"}, {"-vp", "0"}, {"-gn", "0"}, {"-sl", "-1"}, {"-rl", "0"}, {"-vp", "None"}, {"-vp", "2"},
      {"-pp", "2"}, {"--max-steps", "3"}};
  const std::vector<std::string> overrides = {
      "model.num_moe_experts=[1,2]", "target.gpu=h900", "x.y=1", "~model", "+env_vars.A=\xff",
      "model.moe_router_topk=99999999999999999999", "model.moe_router_topk=0",
      std::string(500, 'k') + "=1", "model.num_moe_expert=8", "comm_overlap=3", "=",
      "model.cuda_graph_scope=[attn,moe]", "target.num_gpus=null", "model.seq_length=[[[[",
      "~comm_overlap", "train.micro_batch_size=0", "model.num_layers=-3", "model.num_moe_experts=0",
      "model.expert_model_parallel_size=-1", "model.num_attention_heads=0", "target.gpus_per_node=0",
      "model.moe_layer_freq=0", "model.moe_layer_freq=[0,1]", "model.moe_router_num_groups=0",
      "model.virtual_pipeline_model_parallel_size=0", "env_vars.NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN=0",
      "optimizer.lr=nan", "optimizer.adam_beta1=1", "model.moe_expert_capacity_factor=0",
      "model.moe_router_group_topk=3", "model.moe_router_num_groups=-4", "model.num_query_groups=3",
      "model.pipeline_model_parallel_layout=Et|(tt|)*30mL", "model.pipeline_model_parallel_layout=((t)*2)*3|L",
      "model.pipeline_model_parallel_layout=t*99999999999", "model.pipeline_model_parallel_layout=|", "model.pipeline_model_parallel_layout=Et*(9)*100000L",
      "model.recompute_granularity=selective", "model.recompute_modules=[mla_up_proj]", "model.sequence_parallel=true",
      "model.pipeline_model_parallel_layout=E|tt|tt|L", "model.pipeline_model_parallel_layout=Ett|ttL",
      "model.pipeline_model_parallel_size=2", "model.num_layers_in_first_pipeline_stage=1",
      "model.account_for_embedding_in_pipeline_split=true", "train.train_samples=64", "train.train_iters=null",
      "scheduler.lr_warmup_fraction=1.5", "scheduler.max_steps=1", "scheduler.lr_decay_samples=1",
      "scheduler.lr_warmup_samples=99999999", "+dataset.x=1", "+peft.y=[1", "ddp.grad_reduce_in_fp32=true",
      "ddp.use_distributed_optimizer=true", "model.pipeline_model_parallel_layout=[[embedding,decoder],[decoder,loss]]",
      "model.pipeline_model_parallel_layout=[[encoder],[1]]", "model.pipeline_model_parallel_layout=[embedding]",
      "model.fp8=hybrid", "model.fp8=hybird", "model.fp8_recipe=mxfp8", "model.fp8_param=true",
      "optimizer.use_precision_aware_optimizer=true", "optimizer.exp_avg_dtype=bf16",
      "optimizer.main_grads_dtype={_target_: torch.bfloat16, _call_: false}", "optimizer.exp_avg_dtype={_target_: 3}",
      "+model.moe_router_top_k=4", "+model.fp4=null", "~model.moe_router_top_k", "+train.rampup_batch_size=[1,1,8]",
      "model.num_layers_in_last_pipeline_stage=3", "model.virtual_pipeline_model_parallel_size=3",
      "model.microbatch_group_size_per_vp_stage=3", "model.microbatch_group_size_per_vp_stage=0",
      "model.cuda_graph_impl=full_iteration", "model.cuda_graph_scope=[full_iteration]", "target.gpu=gb200",
      "target.gpus_per_node=4", "target.num_gpus=304", "model.multi_latent_attention=true", "model.q_lora_rank=0",
      "+env_vars.NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN=3", "model.mtp_num_layers=1"};

  const std::vector<std::string> gpus = {"h100", "gb200", "cpu"};
  static const std::regex not_a_number(R"((^|[\s:(\[,=])-?(nan|inf)(?![A-Za-z_]))", std::regex::icase);
  int passed = 0, failed = 0;
  for (int i = 0; i < cases; ++i) {
    {
      std::ofstream out(file, std::ios::binary | std::ios::trunc);
      out << m.mutate(m.pick(corpus));
    }
    std::vector<std::string> args = {epx};
    const bool show = m.chance(0.2), plan = !show && m.chance(0.25);
    if (show) {
      args.insert(args.end(), {"config", "show", file});
    } else if (plan) {  // the planner or the advisor on whatever passes the check (a world and a GPU given)
      args.insert(args.end(), {m.chance(0.7) ? "plan" : "advise", file, "-ng", "16", "-g", m.pick(gpus)});
      if (!hardware.empty() && m.chance(0.3)) {
        std::ofstream(hardware_file, std::ios::binary | std::ios::trunc) << m.mutate(hardware);
        args.insert(args.end(), {"--hardware", hardware_file});
      }
    } else {
      args.insert(args.end(), {"check", file});
    }
    for (std::size_t k = m.below(3); k > 0; --k) args.push_back(m.pick(overrides));
    for (std::size_t k = m.below(3); k > 0; --k) {
      const auto& f = m.pick(flag_sets);
      args.insert(args.end(), f.begin(), f.end());
    }
    const bool json = !show && m.chance(0.5);
    if (json) args.push_back("--json");

    const Outcome r = fuzz::run(args, dir, kTimeLimitS);
    std::string problem;
    if (r.timed_out) {
      problem = "did not finish within the time limit";
    } else if (r.code < 0 || r.code > 2) {
      problem = "exit " + std::to_string(r.code) + " (want 0, 1 or 2)";
    } else if (json && r.code <= 1 && !nlohmann::json::accept(r.out)) {
      problem = "--json printed invalid JSON";
    } else if (plan && r.code <= 1 && (json ? null_figure(nlohmann::json::parse(r.out)) : std::regex_search(r.out, not_a_number))) {
      problem = "printed a NaN or an infinity";
    } else if (r.code == 2 && !names_a_place(r.err, file) && !names_a_place(r.err, hardware_file)) {
      problem = "exit 2 without naming a file, key, flag or line";
    }
    if (problem.empty()) {
      ++passed;
      continue;
    }
    ++failed;
    const fs::path kept = dir / ("failure_" + std::to_string(i) + ".yaml");
    fs::copy_file(file, kept, fs::copy_options::overwrite_existing);
    std::cout << "case " << i << ": " << problem << "\n  command:";
    for (std::size_t a = 1; a < args.size(); ++a) std::cout << " '" << (args[a] == file ? kept.string() : args[a].substr(0, 80)) << "'";
    std::cout << "\n  stderr: " << r.err.substr(0, 400) << "\n";
  }
  if (failed == 0) fs::remove_all(dir);
  std::cout << "seed " << seed << ", " << cases << " cases\n" << passed << " passed, " << failed << " failed\n";
  return failed == 0 ? 0 : 1;
}
