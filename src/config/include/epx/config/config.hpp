// The typed configuration tree, with Megatron-Bridge / Megatron-Core names and defaults.
//
// Sections follow Megatron-Bridge's ConfigContainer: model (TransformerConfig + parallelism),
// comm_overlap (CommOverlapConfig, optional as in Bridge), ddp, optimizer, scheduler, train, rng.
// epx adds `target` (the environment a config is meant for: GPU kind, world size, torch and TE
// versions) and `env_vars` (environment variables a recipe sets, as in Bridge's perf recipes).
//
// Optional fields are Megatron's `None` (null in YAML). Every field is described once in the
// schema (config/schema.cpp), which drives YAML load/dump, dotted overrides and the checker.
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <yaml-cpp/yaml.h>

#include "epx/base/error.hpp"

#include "epx/config/finding.hpp"

namespace epx {

using Int = std::int64_t;
using OptInt = std::optional<Int>;
using OptBool = std::optional<bool>;
using OptDouble = std::optional<double>;
using OptString = std::optional<std::string>;
using StringList = std::vector<std::string>;

// Megatron's Union[T, List[T]] fields (moe_router_load_balancing_type, moe_aux_loss_coeff): one
// value or a list. Megatron tells the two apart (a list never equals "sinkhorn"), so epx keeps which.
template <class T>
struct OneOrList {
  std::vector<T> values;
  bool is_list = false;
  OneOrList(T v) : values{std::move(v)} {}  // NOLINT: one value converts, as in Python
  explicit OneOrList(std::vector<T> v) : values(std::move(v)), is_list(true) {}
  bool operator==(const OneOrList&) const = default;
  // Megatron's `field == v`: only one value can equal it.
  bool is(const T& v) const { return !is_list && values.size() == 1 && values.front() == v; }
  bool contains(const T& v) const { return std::find(values.begin(), values.end(), v) != values.end(); }
};

// Megatron's moe_freq_type fields, moe_layer_freq and window_attn_skip_freq: an int N or an
// explicit 0/1 pattern per layer. YAML accepts an int, a list, or Megatron-LM's string form
// "([0]*3+[1]*58)".
struct LayerFreq {
  Int every = 1;
  std::vector<Int> pattern;  // non-empty: explicit per-layer pattern, `every` unused
  bool operator==(const LayerFreq&) const = default;
  // Whether decoder layer `i` (from 0) is an MoE layer: i % every == 0, or the pattern's entry
  // (a layer past a short pattern is dense; the check refuses a pattern of the wrong length).
  bool is_moe(Int i) const {
    return pattern.empty() ? i % std::max<Int>(1, every) == 0
                           : i < static_cast<Int>(pattern.size()) && pattern[static_cast<std::size_t>(i)] != 0;
  }
  // Megatron-Core's is_layer_window_attention: layer_number = i + 1 is not a multiple of N, or
  // the pattern's entry (1: sliding window).
  bool is_window(Int i) const {
    return pattern.empty() ? (i + 1) % std::max<Int>(1, every) != 0
                           : i < static_cast<Int>(pattern.size()) && pattern[static_cast<std::size_t>(i)] != 0;
  }
  // Megatron-Core's test for dense layers beside the MoE ones.
  bool has_dense() const {
    return pattern.empty() ? every > 1 : std::find(pattern.begin(), pattern.end(), Int{0}) != pattern.end();
  }
};

// TE's sliding window (window_size): query i sees keys [i - left, i + right]; -1 is unbounded.
// Causal attention has right 0 (TE sets it so, with a warning).
struct AttentionWindow {
  Int left = -1, right = 0;
  bool operator==(const AttentionWindow&) const = default;
};

struct ModelConfig {
  // Parallelism (ModelParallelConfig).
  Int tensor_model_parallel_size = 1;
  Int pipeline_model_parallel_size = 1;
  OptInt virtual_pipeline_model_parallel_size;
  OptInt microbatch_group_size_per_vp_stage;  // the interleaved schedule's group; None: PP
  Int context_parallel_size = 1;
  // CP's exchange per layer (p2p, a2a, allgather, a2a+p2p; a list: one per layer); None: TE's p2p.
  std::optional<OneOrList<std::string>> cp_comm_type;
  std::optional<OneOrList<Int>> hierarchical_context_parallel_sizes;  // a2a+p2p's levels, inner first; product = CP
  Int expert_model_parallel_size = 1;
  OptInt expert_tensor_parallel_size;  // None: ETP=1 when EP>1, else TP (finalize)
  bool sequence_parallel = false;
  OptString pipeline_model_parallel_layout;
  bool account_for_embedding_in_pipeline_split = false;  // count the embedding as a layer
  bool account_for_loss_in_pipeline_split = false;       // count the loss as a layer
  OptInt num_layers_in_first_pipeline_stage;  // uneven stages: the first / last stage's layers,
  OptInt num_layers_in_last_pipeline_stage;   // the rest split evenly over the middle stages

  // Architecture (TransformerConfig / GPTModelProvider).
  Int num_layers = 0;
  Int hidden_size = 0;
  OptInt ffn_hidden_size;
  Int num_attention_heads = 0;
  OptInt num_query_groups;
  OptInt kv_channels;
  bool qk_layernorm = false;
  std::string normalization = "LayerNorm";
  double layernorm_epsilon = 1e-5;
  bool layernorm_zero_centered_gamma = false;  // every norm multiplies by 1 + its weight, which starts at 0
  bool gated_linear_unit = false;
  // The MLPs' activation: Megatron-Core's default F.gelu, by the short name Bridge's activation map
  // gives it (silu, quick_gelu, gelu, fast_gelu, relu, squared_relu, sigmoid, tanh). A dump's
  // {_target_: torch.nn.functional.silu} reads as silu. GPT-OSS clamps its GLU's input and
  // offsets the linear half; DeepSeek-V4 clamps SwiGLU.
  std::string activation_func = "gelu";
  OptDouble activation_func_clamp_value;
  double glu_linear_offset = 0.0;
  bool bias_activation_fusion = false;
  bool use_te_activation_func = false;
  bool add_bias_linear = true;
  bool bias_dropout_fusion = false;
  bool add_qkv_bias = false;
  Int seq_length = 1024;
  OptInt vocab_size;
  Int make_vocab_size_divisible_by = 128;
  bool share_embeddings_and_output_weights = true;
  std::string position_embedding_type = "learned_absolute";
  OptDouble softmax_scale;      // the attention logits' scale; None: 1 / sqrt(kv_channels)
  double rotary_percent = 1.0;  // RoPE rotates the first int(kv_channels * rotary_percent) channels
  OneOrList<double> rotary_base{10000};  // Gemma's and MiMo's providers: (local, global) layers' bases
  // YaRN (position_embedding_type yarn; Bridge's provider fields, None unless a model sets them).
  OptDouble yarn_rotary_scaling_factor;
  OptInt yarn_original_max_position_embeddings;
  OptDouble yarn_beta_fast, yarn_beta_slow, yarn_mscale, yarn_mscale_all_dim;
  OptBool yarn_correction_range_round_to_int;
  std::optional<AttentionWindow> window_size;       // sliding-window attention (GPT-OSS); None: none
  std::optional<LayerFreq> window_attn_skip_freq;   // which layers have the window; None: every layer
  std::string softmax_type = "vanilla";             // vanilla, off-by-one or learnable (attention sinks)
  double init_method_std = 0.02;
  // Multi-latent attention (DeepSeek-V3).
  bool multi_latent_attention = false;
  OptInt q_lora_rank;
  Int kv_lora_rank = 512;
  Int qk_head_dim = 128;
  Int qk_pos_emb_head_dim = 64;
  Int v_head_dim = 128;
  // MLA's RoPE over the qk_pos_emb_head_dim channels, with MLATransformerConfig's names and
  // defaults (read only with multi_latent_attention): rope, or YaRN with these fields; the softmax
  // is scaled by YaRN's mscale(rotary_scaling_factor, mscale_all_dim) squared either way.
  std::string rope_type = "yarn";
  double rotary_scaling_factor = 40;
  Int original_max_position_embeddings = 4096;
  double beta_fast = 32, beta_slow = 1, mscale = 1.0, mscale_all_dim = 0.0;

  // Mixture of experts.
  OptInt num_moe_experts;
  OptInt moe_ffn_hidden_size;
  Int moe_router_topk = 2;
  LayerFreq moe_layer_freq;
  OptInt moe_shared_expert_intermediate_size;
  bool moe_shared_expert_overlap = false;
  bool moe_shared_expert_gate = false;  // Qwen3-Next / Qwen3.5: the shared output times sigmoid(x . w)
  OneOrList<std::string> moe_router_load_balancing_type{"aux_loss"};
  OneOrList<double> moe_aux_loss_coeff{0.0};  // one per load-balancing type when that is a list
  double moe_router_quantile_balancing_ema = 0.0;
  OptDouble moe_z_loss_coeff;
  bool moe_router_pre_softmax = false;
  std::string moe_router_score_function = "softmax";
  OptDouble moe_router_topk_scaling_factor;
  bool moe_router_enable_expert_bias = false;
  double moe_router_bias_update_rate = 1e-3;
  OptInt moe_router_num_groups;
  OptInt moe_router_group_topk;
  OptString moe_router_dtype;
  bool moe_router_force_load_balancing = false;
  bool moe_grouped_gemm = false;
  std::string moe_token_dispatcher_type = "allgather";
  OptString moe_flex_dispatcher_backend = "deepep";
  OptInt moe_flex_dispatcher_num_sms;
  OptInt moe_deepep_num_sms;    // deprecated: use moe_flex_dispatcher_num_sms
  OptInt moe_hybridep_num_sms;  // deprecated: use moe_flex_dispatcher_num_sms
  Int moe_hybridep_num_sms_preprocessing = 108;
  bool moe_permute_fusion_into_hybridep = false;
  bool moe_hybridep_pad_uneven_dispatch_inputs = false;
  bool moe_permute_fusion = false;
  bool moe_router_fusion = false;
  OptDouble moe_expert_capacity_factor;
  bool moe_pad_expert_input_to_capacity = false;
  std::string moe_token_drop_policy = "probs";
  bool high_priority_a2a_comm_stream = false;

  // Communication overlap as the model sees it (comm_overlap.* is copied here by finalize).
  bool tp_comm_overlap = false;
  bool overlap_p2p_comm = false;
  bool batch_p2p_comm = true;
  bool overlap_moe_expert_parallel_comm = false;
  bool delay_wgrad_compute = false;
  bool overlap_dispatch_backward_with_experts_wgrad = false;
  bool ep_overlap_early_attn_memory_release = false;
  bool defer_embedding_wgrad_compute = false;
  Int wgrad_deferral_limit = 0;

  // Precision.
  bool bf16 = false;
  bool fp16 = false;
  OptString fp8;                     // Transformer Engine's FP8 format: e4m3 | hybrid (None: off)
  OptString fp8_recipe = "delayed";  // tensorwise | delayed | mxfp8 | blockwise | custom
  bool fp8_param = false;            // the GEMM weights kept in FP8
  // Bridge's GPTModelProvider turns it on wherever Transformer Engine imports
  // (utils/fusions.py: can_enable_gradient_accumulation_fusion), as in every perf container.
  bool gradient_accumulation_fusion = true;

  // Activation recomputation.
  OptString recompute_granularity;  // full | selective
  OptString recompute_method;       // uniform | block
  OptInt recompute_num_layers;
  std::optional<StringList> recompute_modules;  // None: ["core_attn"] (finalize)

  // Multi-token prediction.
  OptInt mtp_num_layers;
  double mtp_loss_scaling_factor = 0.1;  // the MTP losses' weight, split over the MTP layers
  bool mtp_use_repeated_layer = false;   // one MTP layer run at every depth (EXAONE-MoE)
  bool mtp_detach_heads = false;  // the MTP losses train the MTP layers alone, clipped as a group of their own

  // CUDA graphs (Bridge keeps the legacy `cuda_graph_scope` beside MCore's modules list;
  // an empty list means "full").
  std::string cuda_graph_impl = "none";
  StringList cuda_graph_scope;
  StringList cuda_graph_modules;
  bool use_te_rng_tracker = false;  // Transformer Engine's RNG tracker, which CUDA graphs need
};

// Whether the model has MLPs besides the routed experts: dense layers (no experts at all, or
// moe_layer_freq's dense ones) or a shared expert. Megatron builds these from transformer/mlp.py.
inline bool has_dense_mlps(const ModelConfig& m) {
  return !m.num_moe_experts || m.moe_layer_freq.has_dense() || m.moe_shared_expert_intermediate_size.value_or(0) > 0;
}

// `vocab` padded as Megatron pads the LM head (make_vocab_size_divisible_by x TP), which its model
// FLOPs count.
inline Int padded_vocab(Int vocab, const ModelConfig& m) {
  const Int multiple = std::max<Int>(1, m.make_vocab_size_divisible_by) * std::max<Int>(1, m.tensor_model_parallel_size);
  return (vocab + multiple - 1) / multiple * multiple;
}

// The sliding window's left side where it limits the attention: none when window_size is unset,
// unbounded (-1), or as long as the sequence (every earlier key is in it). The runtime and the
// planner read the window through it.
inline OptInt sliding_window(const ModelConfig& m) {
  if (!m.window_size || m.window_size->left < 0 || m.window_size->left >= m.seq_length - 1) return std::nullopt;
  return m.window_size->left;
}

// Whether Megatron's training log tracks the loss of `type` (training.py's `type in
// moe_router_load_balancing_type`: a substring of one name, an element of a list).
inline bool tracks_loss(const OneOrList<std::string>& types, const std::string& type) {
  return types.is_list ? types.contains(type) : types.values.front().find(type) != std::string::npos;
}

// Whether the aux-loss coefficients fit the load-balancing types as Megatron takes them: a list of
// types, a list of coefficients as long (TransformerConfig's assert); one aux-loss type beside a
// list stops the router (it compares the list with 0).
inline bool aux_loss_coeffs_fit(const ModelConfig& m) {
  const auto& types = m.moe_router_load_balancing_type;
  const auto& coeffs = m.moe_aux_loss_coeff;
  if (types.is_list) return coeffs.is_list && coeffs.values.size() == types.values.size();
  return !coeffs.is_list || !(types.is("aux_loss") || types.is("seq_aux_loss") || types.is("global_aux_loss"));
}

// Megatron's Router.get_aux_loss_coeff: the coefficient of one aux loss (aux_loss, seq_aux_loss,
// global_aux_loss), 0 where the type is not selected. The check refuses the shapes Megatron does
// not take (a list of types beside one coefficient, or the reverse).
inline double aux_loss_coeff(const ModelConfig& m, const std::string& type) {
  const auto& types = m.moe_router_load_balancing_type.values;
  const auto& coeffs = m.moe_aux_loss_coeff.values;
  const auto at = std::find(types.begin(), types.end(), type);
  const auto i = static_cast<std::size_t>(at - types.begin());
  return at != types.end() && i < coeffs.size() ? coeffs[i] : 0.0;
}

// Bridge's CommOverlapConfig: None means "not set by the user, use the computed default".
struct CommOverlapConfig {
  bool tp_comm_overlap = false;
  OptString tp_comm_bootstrap_backend = "nccl";
  OptBool overlap_p2p_comm;
  OptBool batch_p2p_comm;
  OptBool overlap_grad_reduce;
  OptBool overlap_param_gather;
  OptBool overlap_param_gather_with_optimizer_step;
  OptBool align_param_gather;
  OptInt bucket_size;
  OptBool defer_embedding_wgrad_compute;
  OptInt wgrad_deferral_limit;
  OptBool overlap_moe_expert_parallel_comm;
  OptBool delay_wgrad_compute;
  OptInt data_parallel_size;  // derived: world // (TP*PP*CP)
};

struct DdpConfig {
  bool overlap_grad_reduce = false;
  bool overlap_param_gather = false;
  bool align_param_gather = false;
  bool use_distributed_optimizer = false;
  OptInt bucket_size;
  bool grad_reduce_in_fp32 = false;
  // epx's own (not in Megatron's DDP): with overlap_grad_reduce, the embedding's gradient is
  // reduced in two parts, the earlier micro-batches' sum under the last micro-batch and the last
  // one's token rows all-gathered after it, instead of the whole table after the backward.
  bool reduce_embedding_rows = false;
};

struct OptimizerConfig {
  std::string optimizer = "adam";
  OptDouble lr;
  OptDouble min_lr;
  double weight_decay = 0.01;
  double adam_beta1 = 0.9;
  double adam_beta2 = 0.999;
  double adam_eps = 1e-8;
  double clip_grad = 1.0;
  bool use_distributed_optimizer = false;
  bool overlap_param_gather = false;
  bool overlap_param_gather_with_optimizer_step = false;
  bool align_param_gather = false;
  // Transformer Engine's FusedAdam with lower-precision state (fp32 | bf16 | fp16 | fp8, as
  // Megatron's --*-dtype flags; a Bridge dump's torch dtypes read so).
  bool use_precision_aware_optimizer = false;
  bool store_param_remainders = true;  // an FP32 master as the 16 bits a BF16 weight lacks
  std::string main_grads_dtype = "fp32";
  std::string main_params_dtype = "fp32";
  std::string exp_avg_dtype = "fp32";
  std::string exp_avg_sq_dtype = "fp32";
};

// Iteration-based (train.train_iters) or sample-based (train.train_samples) training, as Bridge's
// SchedulerConfig / TrainingConfig; config/scheduler_steps turns them into the scheduler's steps.
struct SchedulerConfig {
  std::string lr_decay_style = "linear";
  Int lr_warmup_iters = 0;
  OptInt lr_decay_iters;  // None: scheduler.max_steps, else train_iters
  Int lr_warmup_samples = 0;
  OptInt lr_decay_samples;      // None: train_samples
  OptDouble lr_warmup_fraction;  // of the decay, instead of lr_warmup_iters / lr_warmup_samples
  OptInt max_steps;              // the full run's steps for the schedules, when train_iters runs only the first
  double lr_warmup_init = 0.0;
};

struct TrainConfig {
  OptInt train_iters;
  OptInt train_samples;  // sample-based training: train_iters = train_samples // global_batch_size
  OptInt global_batch_size;
  OptInt micro_batch_size;
  OptInt eval_iters;  // Bridge's default None (Megatron-LM's 100); epx runs no evaluation
  bool manual_gc = false;
};

struct RngConfig {
  Int seed = 1234;
  bool te_rng_tracker = false;  // kept in step with model.use_te_rng_tracker (Bridge's validate)
};

// epx's own section: the environment a config targets (the performance harness's -g/-ng/-gn
// and the checker's --gpu/--torch-version/--te-version).
// Unset fields are facts the user did not give: `epx check` lists the rules that need them as
// unchecked rather than guessing (a Megatron-Bridge dump names neither: Bridge takes the world
// from the launcher and the GPU from the machine). `epx run` and `epx layer` fill them from the
// job: its rank count, and `cpu`.
struct TargetConfig {
  OptString gpu;               // h100 h200 b200 b300 gb200 gb300 a100 v100 cpu
  OptInt num_gpus;             // world size (ranks)
  OptInt gpus_per_node;        // None: from the GPU kind (8, or 4 on GB200/GB300)
  OptString torch_version;     // None: unknown, rules that need it are reported unchecked
  OptString te_version;
};

// A YAML mapping held by value: copies are deep, unlike yaml-cpp's Node, whose copies share one
// tree (so editing a copied Config would edit the original).
struct OwnedYaml {
  YAML::Node node = YAML::Node(YAML::NodeType::Map);
  OwnedYaml() = default;
  OwnedYaml(const OwnedYaml& o) : node(YAML::Clone(o.node)) {}
  OwnedYaml& operator=(const OwnedYaml& o) {
    if (this != &o) node.reset(YAML::Clone(o.node));
    return *this;
  }
  // The mapping under `key`, or an empty map. Looks up without inserting (yaml-cpp's mutable
  // operator[] would) and without the invalid node its const operator[] returns for a miss.
  YAML::Node child_map(const std::string& key) const {
    const YAML::Node found = static_cast<const YAML::Node&>(node)[key];
    return found.IsDefined() && found.IsMap() ? found : YAML::Node(YAML::NodeType::Map);
  }
};

struct Config {
  ModelConfig model;
  std::optional<CommOverlapConfig> comm_overlap;  // absent as in Bridge's comm_overlap=None
  DdpConfig ddp;
  OptimizerConfig optimizer;
  SchedulerConfig scheduler;
  TrainConfig train;
  RngConfig rng;
  TargetConfig target;
  std::map<std::string, std::string> env_vars;

  // Kept from a Megatron-Bridge dump but not modelled: whole sections (name -> node), and
  // fields of modelled sections (section -> name -> node). Dumped back unchanged.
  OwnedYaml extra_sections;
  OwnedYaml extra_fields;
  // MoE-only fields a Bridge dump of a dense model leaves None (Gemma4's moe_router_topk,
  // Qwen3-VL's moe_token_dispatcher_type): read as their defaults; with experts the check refuses
  // them (moe.field_is_none).
  StringList none_moe_fields;

  // Keys ("model.num_moe_experts") set by the recipe file, an override or a flag, as opposed
  // to left at Megatron's default. Some pitfalls depend on what the user asked for.
  enum class Origin { file, override_arg, flag };
  std::map<std::string, Origin> explicit_keys;
  std::map<std::string, std::string> file_locations;  // key -> "file:line:col" it was read at
  std::string source;  // where the config came from (file path or recipe name)

  // "file:line:col: key" for a key read from a file, else the key: the prefix of a message about
  // a value that turns out to be wrong after loading (an unknown GPU, an unreadable version).
  std::string cite(const std::string& key) const {
    auto it = file_locations.find(key);
    return it == file_locations.end() ? key : it->second + ": " + key;
  }
  // Whether the config is a Megatron-Bridge dump (its sections carry `_target_` tags).
  bool is_bridge_dump() const;

  bool set_on_command_line(const std::string& key) const {
    auto it = explicit_keys.find(key);
    return it != explicit_keys.end() && it->second != Origin::file;
  }
};


// ---- Loading, overrides, dumping --------------------------------------------------------------

// A recipe name ("qwen3_30b_a3b", looked up in the recipes directories in turn: $EPX_RECIPES_DIR,
// ../share/epx/recipes and ../recipes beside the binary, the source tree's recipes/) or a path
// to a YAML file.
std::filesystem::path resolve_recipe(const std::string& name_or_path);
std::vector<std::string> list_recipes();

// Load an epx recipe, an `epx config show` dump, or a Megatron-Bridge config dumped as YAML.
// Sections epx does not model (dataset, logger, ...) and, in Bridge dumps (sections carrying
// `_target_`), fields epx does not model are kept and reported by ignored_note(). Errors name
// the file, line and column.
Config load_config_file(const std::filesystem::path& path);
Config load_config_text(const std::string& yaml_text, const std::string& source_name);

// One Hydra-style override: `section.key=value` (value in YAML syntax; None/null unset it),
// `+key=value` (also adds keys outside the schema: env_vars, kept Bridge sections),
// `++key=value` (same), `~key` (back to Megatron's default; `~comm_overlap` drops the section).
// Throws ConfigError naming the key, with a "did you mean" hint for unknown keys.
void apply_override(Config& cfg, const std::string& text,
                    Config::Origin origin = Config::Origin::override_arg);

// The performance harness's flags (scripts/performance/run_script.py). Applied after the dotted
// overrides, so flags win, as in the harness. `--moe_flex_dispatcher_backend deepep|hybridep`
// depends on the GPU and is applied by the checker (check/flex_backend).
struct HarnessFlags {
  OptInt tp, pp, cp, ep, et, gb, mb, sl, max_steps;
  OptString vp;  // an integer, -1 (keep, the harness's default) or None (unset VPP)
  OptBool moe_a2a_overlap;
  OptString moe_flex_dispatcher_backend;  // "deepep", "hybridep" or "None"
  OptString gpu;
  OptInt num_gpus, gpus_per_node;
  OptString cuda_graph_impl, cuda_graph_scope;
  OptInt recompute_num_layers;
  OptString recompute_modules;
  OptString pipeline_layout;  // --pipeline_model_parallel_layout
};
void apply_harness_flags(Config& cfg, const HarnessFlags& flags);
// The harness's integer flags that each set one key: one table for applying them and for naming
// the flag that set a key (a fix must give the flag, which wins over an override).
struct HarnessIntFlag {
  const char* flag;
  const char* key;
  OptInt HarnessFlags::*value;
};
inline constexpr HarnessIntFlag kHarnessIntFlags[] = {
    {"-tp", "model.tensor_model_parallel_size", &HarnessFlags::tp},
    {"-pp", "model.pipeline_model_parallel_size", &HarnessFlags::pp},
    {"-cp", "model.context_parallel_size", &HarnessFlags::cp},
    {"-ep", "model.expert_model_parallel_size", &HarnessFlags::ep},
    {"-et", "model.expert_tensor_parallel_size", &HarnessFlags::et},
    {"-gb", "train.global_batch_size", &HarnessFlags::gb},
    {"-mb", "train.micro_batch_size", &HarnessFlags::mb},
    {"-sl", "model.seq_length", &HarnessFlags::sl},
    {"-ms", "train.train_iters", &HarnessFlags::max_steps},
    {"-ng", "target.num_gpus", &HarnessFlags::num_gpus},
    {"-gn", "target.gpus_per_node", &HarnessFlags::gpus_per_node}};

// The config as YAML; load_config_text(dump_yaml(c)) gives back the same values.
std::string dump_yaml(const Config& cfg);

// One line naming what was kept but not modelled; empty when nothing was.
std::string ignored_note(const Config& cfg);

// ---- Finalize: Megatron-Bridge's derived fields ------------------------------------------------

struct FinalizeOptions {
  bool have_te = true;  // Transformer Engine present in the target environment
};

// Derive what Bridge derives at runtime_config_update, in its order: data-parallel size,
// comm_overlap defaults + user values copied onto the model (TP-overlap auto-disable), PP p2p
// defaults, DP-overlap defaults for the distributed optimizer, then Megatron-Core's post-init
// (ETP default, recompute_modules default, deprecated SM-count knobs). Idempotent. Returns the
// warnings Bridge logs while doing so (rule ids from the checker's table).
std::vector<Finding> finalize(Config& cfg, const FinalizeOptions& options = {});

// Helpers used by finalize and the checker.
Int data_parallel_size(const Config& cfg);  // world // (TP*PP*CP); 0 if it does not divide or
                                            // the world size is not given
Int effective_etp(const ModelConfig& m);    // ETP with Megatron's default applied

}  // namespace epx
