#include "config_args.hpp"

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>

#include <fmt/format.h>

#include "epx/check/check.hpp"
#include "epx/check/flex_backend.hpp"
#include "epx/config/mixed_precision.hpp"
#include "epx/base/to_lower.hpp"
#include "number_validators.hpp"

namespace epx::cli {
namespace {

const std::vector<std::pair<std::string, std::string>> kTwoLetterFlags = {
    {"-tp", "--tp"}, {"-pp", "--pp"}, {"-vp", "--vp"}, {"-cp", "--cp"}, {"-ep", "--ep"},
    {"-et", "--et"}, {"-gb", "--gb"}, {"-mb", "--mb"}, {"-sl", "--sl"}, {"-ng", "--ng"},
    {"-gn", "--gn"}, {"-ms", "--ms"}, {"-rl", "--rl"}, {"-mr", "--mr"}};

OptBool parse_bool_flag(const std::string& text) {
  const std::string s = to_lower(text);
  if (s == "true" || s == "1" || s == "t" || s == "yes" || s == "y") return true;
  if (s == "false" || s == "0" || s == "f" || s == "no" || s == "n") return false;
  throw ConfigError(fmt::format("--moe_a2a_overlap expects true or false, got '{}'", text));
}

// What the harness changes beside the flags' own fields (run_script.py: argument_parser's
// GPUs per node, overrides._apply_flat_cli_environment_compatibility): a GPU named without -gn
// brings its node size (4 on GB200 / GB300), not the recipe's; -ep on a HybridEP recipe resets
// NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN to the EP ranks in one NVLink domain, unless an
// env_vars override set it.
// The harness rebuilds DeepSeek-V3's pipeline layout when -pp or -vp is given (overrides.py:
// set_deepseek_v3_pipeline_model_parallel_layout): the recipe's table of (PP, VPP) layouts, the
// MTP layers beside the loss; a pair outside the table keeps the layout it had. It runs after
// the Hydra overrides, so only --pipeline_model_parallel_layout keeps a layout of one's own.
void couple_deepseek_v3_layout(Config& cfg, const HarnessFlags& f) {
  const bool vp_given = f.vp && *f.vp != "-1";
  if ((!f.pp && !vp_given) || f.pipeline_layout) return;
  const Int pp = cfg.model.pipeline_model_parallel_size, vp = cfg.model.virtual_pipeline_model_parallel_size.value_or(1);
  const std::string last = std::string(static_cast<std::size_t>(cfg.model.mtp_num_layers.value_or(0)), 'm') + "L";
  std::optional<std::string> layout;
  if (pp == 1 && vp == 1) layout = "null";
  else if (pp == 4 && vp == 1) layout = "'Et*16|t*16|t*16|t*13" + last + "'";
  else if (pp * vp == 8 && pp >= 4) layout = "'Et*8|(t*8|)*6t*5" + last + "'";  // (8, 1), (4, 2)
  else if (pp * vp == 16 && pp >= 4) layout = "'Et*4|(t*4|)*14t" + last + "'";  // (16, 1), (8, 2), (4, 4)
  if (layout) apply_override(cfg, "model.pipeline_model_parallel_layout=" + *layout, Config::Origin::flag);
}

void couple_harness_environment(Config& cfg, const HarnessFlags& f, const OptString& recipe_backend) {
  if (f.gpu && !f.gpus_per_node && *f.gpu != "cpu" && !cfg.set_on_command_line("target.gpus_per_node"))
    cfg.target.gpus_per_node.reset();
  const std::string var = std::string("env_vars.") + kRanksPerDomainVar;
  if (!f.ep || *f.ep < 1 || recipe_backend.value_or("") != "hybridep") return;
  const GpuInfo* gpu = cfg.target.gpu ? find_gpu(*cfg.target.gpu) : nullptr;
  if (!gpu || !gpu->cuda()) return;
  // The harness sizes the domain from the recipe's own backend, before any override changes it
  // (run_script.py: base_dispatcher_backend), and raises where it cannot, even when an env_vars
  // override keeps the variable; an EP size given as an override is not coupled at all.
  if (const std::string error = harness_hybridep_ep_error(*gpu, *f.ep); !error.empty())
    throw ConfigError(fmt::format("-ep {} -g {}: {}, and the harness raises (it checks the recipe's hybridep backend, "
                                  "whatever the overrides set); give the EP size as the override "
                                  "model.expert_model_parallel_size={}, which it does not couple",
                                  *f.ep, gpu->name, error, *f.ep));
  if (!cfg.set_on_command_line(var))
    cfg.env_vars[kRanksPerDomainVar] = std::to_string(hybridep_topology(cfg, *gpu).ranks_per_domain);
}

}  // namespace

Config ConfigArgs::load_with_world_and_gpu(const std::string& command) const {
  Config c = load();
  if (!c.target.num_gpus)
    throw ConfigError(fmt::format("target.num_gpus=None: {} is for a world size; pass -ng N (or set target.num_gpus)", command));
  if (!c.target.gpu)
    throw ConfigError(fmt::format("target.gpu=None: {} needs the hardware's rates; pass -g GPU (h100, b200, gb200, ..., cpu)",
                                  command));
  return c;
}

std::vector<std::string> normalize_harness_flags(int argc, char** argv) {
  std::vector<std::string> args;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    for (const auto& [short_form, long_form] : kTwoLetterFlags)
      if (a == short_form || a.starts_with(short_form + "=")) a = long_form + a.substr(3);
    args.push_back(a);
  }
  std::reverse(args.begin(), args.end());  // CLI11's parse(vector) takes arguments reversed
  return args;
}

void ConfigArgs::add_to(CLI::App& app) {
  app.add_option("config", positional,
                 "RECIPE (name in recipes/) or FILE (YAML, including a Megatron-Bridge dump), "
                 "then overrides: section.key=value, +key=value, ~key");
  app.add_option("--config", config_file, "RECIPE or FILE, as an option (then every positional "
                 "argument is an override)");
  const char* group = "Performance-harness flags (win over dotted overrides)";
  app.add_option("--tp,--tensor_model_parallel_size", flags.tp, "-tp (and sequence_parallel = TP > 1, as the harness)")->transform(kPythonInt)->group(group);
  app.add_option("--pp,--pipeline_model_parallel_size", flags.pp, "-pp")->transform(kPythonInt)->group(group);
  app.add_option("--vp,--virtual_pipeline_model_parallel_size", flags.vp, "-vp: N, None (unset), -1 (keep)")
      ->transform(CLI::Validator(
          [](std::string& v) {  // the harness's `None if x == "None" else int(x)`
            return v == "None" || kPythonInt(v).empty()
                       ? std::string()
                       : "expected an integer, None (unset) or -1 (keep), as the harness's -vp";
          },
          ""))
      ->group(group);
  app.add_option("--cp,--context_parallel_size", flags.cp, "-cp")->transform(kPythonInt)->group(group);
  app.add_option("--ep,--expert_model_parallel_size", flags.ep, "-ep")->transform(kPythonInt)->group(group);
  app.add_option("--et,--expert_tensor_parallel_size", flags.et, "-et")->transform(kPythonInt)->group(group);
  app.add_option("--gb,--global_batch_size", flags.gb, "-gb")->transform(kPythonInt)->group(group);
  app.add_option("--mb,--micro_batch_size", flags.mb, "-mb")->transform(kPythonInt)->group(group);
  app.add_option("--sl,--seq_length", flags.sl, "-sl")->transform(kPythonInt)->group(group);
  app.add_option("--pipeline_model_parallel_layout", flags.pipeline_layout,
                 "the pipeline layout (on deepseek_v3 it replaces the -pp / -vp table's)")
      ->group(group);
  app.add_option("--ms,--max_steps", flags.max_steps, "-ms: train.train_iters")->transform(kPythonInt)->group(group);
  app.add_option("--moe_a2a_overlap", moe_a2a_overlap,
                 "true: EP overlap + delay_wgrad on, shared-expert overlap off; false: no change")
      ->group(group);
  app.add_option("--moe_flex_dispatcher_backend", flags.moe_flex_dispatcher_backend,
                 "deepep|hybridep (apply by GPU) or None (alltoall)")
      ->check(CLI::IsMember({"deepep", "hybridep", "None"}))
      ->group(group);
  app.add_option("-g,--gpu", flags.gpu, "target GPU: h100 h200 b200 b300 gb200 gb300 a100 v100 cpu")
      ->check(CLI::Validator([](std::string& s) { return s.empty() ? std::string("names no GPU") : std::string(); },
                             "GPU"))
      ->group(group);
  app.add_option("--ng,--num_gpus", flags.num_gpus, "-ng: world size")->transform(kPythonInt)->group(group);
  app.add_option("--gn,--gpus_per_node", flags.gpus_per_node, "-gn")->transform(kPythonInt)->group(group);
  app.add_option("--cuda_graph_impl", flags.cuda_graph_impl, "none|local|transformer_engine")
      ->check(CLI::IsMember({"none", "local", "transformer_engine"}))  // the harness's choices
      ->group(group);
  app.add_option("--cuda_graph_scope", flags.cuda_graph_scope,
                 "comma list of full_iteration attn mlp moe moe_router moe_preprocess mamba")
      ->check([](const std::string& v) -> std::string {  // the harness's is_cuda_graph_scope_valid
        static const std::set<std::string> kValid = {"full_iteration", "attn",           "mlp",  "moe",
                                                      "moe_router",     "moe_preprocess", "mamba"};
        for (std::size_t at = 0;;) {
          const std::size_t comma = std::min(v.find(',', at), v.size());
          if (!kValid.contains(v.substr(at, comma - at)))
            return fmt::format("'{}' is not a scope; give a comma list of full_iteration, attn, mlp, moe, moe_router, "
                               "moe_preprocess, mamba",
                               v.substr(at, comma - at));
          if (comma == v.size()) return "";
          at = comma + 1;
        }
      })
      ->group(group);
  app.add_option("--rl,--recompute_num_layers", flags.recompute_num_layers,
                 "-rl: full recompute, block method")->transform(kPythonInt)
      ->group(group);
  app.add_option("--recompute_modules", flags.recompute_modules, "comma list: selective recompute")
      ->group(group);
  app.add_option("-m,--model_family_name", model_family, "-m: the harness's model family (the recipe names the model)")
      ->group(group);
  app.add_option("--mr,--model_recipe_name", model_recipe,
                 "-mr: the harness's recipe name, which couples -pp / -vp to DeepSeek-V3's layouts (default: the "
                 "config's file name)")
      ->group(group);
  app.add_option("--task", task, "pretrain (sft and peft are not modelled)")
      ->check(CLI::IsMember({"pretrain", "sft", "peft"}))
      ->group(group);
  app.add_option("-c,--compute_dtype", compute_dtype,
                 "the perf recipes' precision, as Bridge's mixed_precision (applied over model.bf16/fp8/...): bf16, "
                 "fp8_cs, fp8_mx, fp8_sc, nvfp4")
      ->check(CLI::IsMember({"bf16", "fp8_cs", "fp8_mx", "fp8_sc", "nvfp4"}))
      ->group(group);
  app.add_option("--config_variant", config_variant, "the harness's recipe variant (v1, ...): one per recipe here")
      ->group(group);
  app.add_option("--tokenizer_type", tokenizer_type, "NullTokenizer (mock data)")
      ->check(CLI::IsMember({"NullTokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer"}))
      ->group(group);
  app.add_option("--torch-version", torch_version, "torch version in the target container");
  app.add_option("--te-version", te_version, "Transformer Engine version in the target container");
  // A flag given twice takes its last value, as the harness's argparse does (a fix appended to a
  // command line repeats a flag).
  for (CLI::Option* o : app.get_options())
    if (o->get_group() == group || o->check_lname("torch-version") || o->check_lname("te-version"))
      o->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
}


std::optional<std::string> ConfigArgs::file() const {
  if (positional.empty() && !config_file) return std::nullopt;
  try {
    return resolve_recipe(config_file ? *config_file : positional.front()).string();
  } catch (const ConfigError&) {
    return std::nullopt;  // load() says why
  }
}

Config ConfigArgs::load() const {
  if (positional.empty() && !config_file)
    throw ConfigError("no config given: name a recipe (see `epx config list`) or a YAML file");
  const std::size_t first_override = config_file ? 0 : 1;
  Config cfg = load_config_file(resolve_recipe(config_file ? *config_file : positional.front()));
  if (compute_dtype) {
    // The harness builds the recipe at this precision (the flat perf recipes' _perf_precision:
    // gradients reduced in BF16), before the overrides.
    static const std::map<std::string, std::string> kRecipeOf = {
        {"bf16", "bf16_mixed"},
        {"fp8_cs", "bf16_with_fp8_current_scaling_mixed"},
        {"fp8_mx", "bf16_with_mxfp8_mixed"},
        {"fp8_sc", "bf16_with_fp8_subchannel_scaling_mixed"},
        {"nvfp4", "bf16_with_nvfp4_mixed"}};
    YAML::Node precision = mixed_precision_recipe(kRecipeOf.at(*compute_dtype));
    precision["grad_reduce_in_fp32"] = false;
    precision["_source_"] = "-c " + *compute_dtype;  // for messages (mixed_precision.cpp)
    cfg.extra_sections.node["mixed_precision"] = precision;
    std::erase_if(cfg.file_locations, [](const auto& kv) { return kv.first.starts_with("mixed_precision"); });
  }
  const OptString recipe_backend = cfg.model.moe_flex_dispatcher_backend;
  for (size_t i = first_override; i < positional.size(); ++i) apply_override(cfg, positional[i]);
  // run_script.py's BF16 Adam takes the precision-aware optimizer (TE's FusedAdam), after the overrides.
  if (compute_dtype == "bf16" && cfg.optimizer.optimizer == "adam") {
    cfg.optimizer.use_precision_aware_optimizer = true;
    cfg.explicit_keys["optimizer.use_precision_aware_optimizer"] = Config::Origin::flag;
  }
  HarnessFlags f = flags;
  if (moe_a2a_overlap) f.moe_a2a_overlap = parse_bool_flag(*moe_a2a_overlap);  // "" too: not a bool
  apply_harness_flags(cfg, f);
  couple_harness_environment(cfg, f, recipe_backend);
  if (task && *task != "pretrain")
    throw ConfigError(fmt::format("--task {}: epx checks, plans and runs pretraining; drop --task or give pretrain", *task));
  if (model_recipe.value_or(std::filesystem::path(config_file ? *config_file : positional.front()).stem().string()) ==
      "deepseek_v3")
    couple_deepseek_v3_layout(cfg, f);
  if (torch_version)
    apply_override(cfg, "target.torch_version='" + *torch_version + "'", Config::Origin::flag);
  if (te_version)
    apply_override(cfg, "target.te_version='" + *te_version + "'", Config::Origin::flag);
  return cfg;
}

}  // namespace epx::cli
