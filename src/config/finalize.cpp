// Megatron-Bridge's derived fields (runtime_config_update, CommOverlapConfig.setup) and
// Megatron-Core's TransformerConfig post-init defaults, in Bridge's order.
#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "epx/config/config.hpp"
#include "epx/config/mixed_precision.hpp"

namespace epx {
namespace {

constexpr Int kDefaultBucketSize = 128LL * 1024 * 1024;

Finding note(const char* id, Severity sev, std::vector<std::pair<std::string, std::string>> values,
             std::string message, std::string fix = "") {
  return Finding{id, sev, std::move(values), std::move(message), std::move(fix)};
}

std::string text(const OptInt& v) { return v ? std::to_string(*v) : "null"; }

// epx does not model TE's userbuffer config; a Bridge dump's tp_comm_overlap_cfg is kept as is.
bool has_tp_overlap_cfg(const Config& c) {
  const YAML::Node cfg = c.extra_fields.child_map("comm_overlap")["tp_comm_overlap_cfg"];
  return cfg.IsDefined() && !cfg.IsNull();
}

// CommOverlapConfig._get_model_comm_overlap_cfgs + _apply_cfgs onto the model.
void setup_model_comm_overlap(Config& c, const FinalizeOptions& o, std::vector<Finding>& out) {
  CommOverlapConfig& user = *c.comm_overlap;
  ModelConfig& m = c.model;
  const Int vp = m.virtual_pipeline_model_parallel_size.value_or(1);

  // TP overlap gate: warn and disable, first match wins.
  if (user.tp_comm_overlap) {
    const char* id = nullptr;
    std::string why, fix;
    std::vector<std::pair<std::string, std::string>> values;
    if (m.tensor_model_parallel_size < 2) {
      id = "tp_overlap.tp_size";
      why = "Disabling tensor parallel communication overlap due to TP size < 2.";
      values = {{"model.tensor_model_parallel_size", std::to_string(m.tensor_model_parallel_size)}};
      fix = "comm_overlap.tp_comm_overlap=false";
    } else if (!m.sequence_parallel) {
      id = "tp_overlap.sequence_parallel";
      why = "Disabling tensor parallel communication overlap due to sequence_parallel=False.";
      values = {{"model.sequence_parallel", "false"}};
      fix = "model.sequence_parallel=true";
    } else if (!o.have_te) {
      id = "tp_overlap.no_te";
      why = "Disabling tensor parallel communication overlap due to TE not detected.";
      values = {{"target.te_version", c.target.te_version.value_or("null")}};
      fix = "comm_overlap.tp_comm_overlap=false";
    }
    if (id) {
      values.insert(values.begin(), {"comm_overlap.tp_comm_overlap", "true"});
      out.push_back(note(id, Severity::warning, values, why, fix));
      user.tp_comm_overlap = false;
    } else if (!has_tp_overlap_cfg(c)) {
      out.push_back(note("tp_overlap.default_cfg", Severity::warning,
                         {{"comm_overlap.tp_comm_overlap", "true"},
                          {"comm_overlap.tp_comm_overlap_cfg", "null"}},
                         "Tensor parallel overlap: No overlap config provided. Initializing TP "
                         "comm overlap with the default config."));
    }
  }

  // PP p2p defaults: interleaved (VPP > 1) overlaps p2p, plain PP batches it.
  bool overlap_p2p = false, batch_p2p = false;
  if (m.pipeline_model_parallel_size > 1) {
    overlap_p2p = vp > 1;
    batch_p2p = vp <= 1;
  }
  // A model-level switch that comm_overlap overwrites with its own value (unset: its default).
  auto overwritten = [&](const char* field, bool model_value, const OptBool& user_value, bool fallback = false) {
    if (model_value && !user_value && !fallback)
      out.push_back(note(
          "comm_overlap.overwrites_model", Severity::warning,
          {{fmt::format("model.{}", field), "true"}, {fmt::format("comm_overlap.{}", field), "null"}},
          fmt::format("comm_overlap is set, so Bridge copies comm_overlap.{0} (unset, so false) "
                      "over model.{0}=true: the feature is off",
                      field),
          fmt::format("comm_overlap.{}=true", field)));
  };
  overwritten("overlap_moe_expert_parallel_comm", m.overlap_moe_expert_parallel_comm,
              user.overlap_moe_expert_parallel_comm);
  overwritten("delay_wgrad_compute", m.delay_wgrad_compute, user.delay_wgrad_compute);
  overwritten("defer_embedding_wgrad_compute", m.defer_embedding_wgrad_compute, user.defer_embedding_wgrad_compute);
  overwritten("overlap_p2p_comm", m.overlap_p2p_comm, user.overlap_p2p_comm, overlap_p2p);

  m.tp_comm_overlap = user.tp_comm_overlap;
  m.overlap_p2p_comm = user.overlap_p2p_comm.value_or(overlap_p2p);
  m.batch_p2p_comm = user.batch_p2p_comm.value_or(batch_p2p);
  m.defer_embedding_wgrad_compute = user.defer_embedding_wgrad_compute.value_or(false);
  m.wgrad_deferral_limit = user.wgrad_deferral_limit.value_or(-1);
  m.overlap_moe_expert_parallel_comm = user.overlap_moe_expert_parallel_comm.value_or(false);
  m.delay_wgrad_compute = user.delay_wgrad_compute.value_or(false);
}

// CommOverlapConfig._get_optimizer_overlap_cfgs: only with the distributed optimizer. Its values
// replace the ddp section's (_apply_cfgs), even those the user set: an A/B of
// ddp.overlap_grad_reduce=false would run it on. Warned for an override or flag, as Bridge does
// not warn.
void setup_optimizer_comm_overlap(Config& c, Int dp, std::vector<Finding>& out) {
  const DdpConfig asked = c.ddp;
  const CommOverlapConfig& user = *c.comm_overlap;
  const ModelConfig& m = c.model;
  OptInt bucket;
  bool grad_reduce = false, param_gather = false, align = false;
  if (dp > 1) {
    bucket = kDefaultBucketSize;
    grad_reduce = true;
    param_gather = true;
    align = m.pipeline_model_parallel_size > 1 &&
            m.virtual_pipeline_model_parallel_size.value_or(1) > 1;
  }
  c.ddp.bucket_size = user.bucket_size ? user.bucket_size : bucket;
  c.ddp.overlap_grad_reduce = user.overlap_grad_reduce.value_or(grad_reduce);
  c.ddp.overlap_param_gather = user.overlap_param_gather.value_or(param_gather);
  c.ddp.align_param_gather = user.align_param_gather.value_or(align);
  c.optimizer.overlap_param_gather = c.ddp.overlap_param_gather;
  c.optimizer.overlap_param_gather_with_optimizer_step =
      user.overlap_param_gather_with_optimizer_step.value_or(false);
  c.optimizer.align_param_gather = c.ddp.align_param_gather;
  const auto replaced = [&](const char* field, const std::string& was, const std::string& now) {
    const std::string key = fmt::format("ddp.{}", field);
    // Asked for on the command line: a file's ddp values may be ones Bridge derived (a dump).
    if (!c.set_on_command_line(key) || was == now) return;
    out.push_back(note("comm_overlap.overwrites_ddp", Severity::warning, {{key, was}, {"comm_overlap." + std::string(field), "null"}},
                       fmt::format("with the distributed optimizer and a comm_overlap section, Bridge replaces "
                                   "{}={} by comm_overlap's {} (its default at DP {}): set it there",
                                   key, was, now, dp),
                       fmt::format("comm_overlap.{}={}", field, was)));
  };
  const auto yes = [](bool b) { return std::string(b ? "true" : "false"); };
  replaced("overlap_grad_reduce", yes(asked.overlap_grad_reduce), yes(c.ddp.overlap_grad_reduce));
  replaced("overlap_param_gather", yes(asked.overlap_param_gather), yes(c.ddp.overlap_param_gather));
  replaced("align_param_gather", yes(asked.align_param_gather), yes(c.ddp.align_param_gather));
  replaced("bucket_size", text(asked.bucket_size), text(c.ddp.bucket_size));
}

// Megatron-Core's deprecated per-backend SM-count knobs fold into moe_flex_dispatcher_num_sms.
void fold_deprecated_sm_knobs(ModelConfig& m, std::vector<Finding>& out) {
  std::vector<std::pair<std::string, std::string>> set;
  if (m.moe_deepep_num_sms) set.emplace_back("model.moe_deepep_num_sms", text(m.moe_deepep_num_sms));
  if (m.moe_hybridep_num_sms)
    set.emplace_back("model.moe_hybridep_num_sms", text(m.moe_hybridep_num_sms));
  if (set.empty()) return;
  std::string names = set[0].first.substr(6);
  if (set.size() == 2) names += ", " + set[1].first.substr(6);
  const OptInt value = m.moe_deepep_num_sms ? m.moe_deepep_num_sms : m.moe_hybridep_num_sms;
  // An explicit moe_flex_dispatcher_num_sms wins: the fix drops the old knobs and keeps it.
  std::vector<std::string> fix;
  if (!m.moe_flex_dispatcher_num_sms) fix.push_back(fmt::format("model.moe_flex_dispatcher_num_sms={}", text(value)));
  for (const auto& [key, v] : set) fix.push_back("~" + key);
  out.push_back(note("flex.deprecated_sm_knob", Severity::warning, set,
                     fmt::format("{} is deprecated. Use moe_flex_dispatcher_num_sms instead.{}", names,
                                 m.moe_flex_dispatcher_num_sms
                                     ? fmt::format(" (moe_flex_dispatcher_num_sms={} is set and takes precedence)",
                                                   *m.moe_flex_dispatcher_num_sms)
                                     : ""),
                     fmt::format("{}", fmt::join(fix, " "))));
  if (m.moe_flex_dispatcher_num_sms) return;
  if (m.moe_deepep_num_sms && m.moe_hybridep_num_sms &&
      *m.moe_deepep_num_sms != *m.moe_hybridep_num_sms) {
    out.push_back(note("flex.conflicting_sm_knobs", Severity::error, set,
                       fmt::format("Conflicting deprecated SM-count knobs {{moe_deepep_num_sms: {}, "
                                   "moe_hybridep_num_sms: {}}}; set a single "
                                   "moe_flex_dispatcher_num_sms instead.",
                                   *m.moe_deepep_num_sms, *m.moe_hybridep_num_sms),
                       fmt::format("model.moe_flex_dispatcher_num_sms={}", *m.moe_deepep_num_sms)));
    return;
  }
  m.moe_flex_dispatcher_num_sms = value;
}

}  // namespace

Int data_parallel_size(const Config& c) {
  const ModelConfig& m = c.model;
  const Int model_parallel =
      m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size;
  const Int world = c.target.num_gpus.value_or(0);
  if (model_parallel <= 0 || world <= 0 || world % model_parallel != 0) return 0;
  return world / model_parallel;
}

Int effective_etp(const ModelConfig& m) {
  if (m.expert_tensor_parallel_size) return *m.expert_tensor_parallel_size;
  // Bridge: EP > 1 and ETP unset -> 1. Megatron-Core otherwise defaults ETP to TP.
  return m.expert_model_parallel_size > 1 ? 1 : m.tensor_model_parallel_size;
}

namespace {

// Bridge's validate_cuda_graph_configuration clears the graph lists where no graph is taken;
// Megatron-Core's post-init then moves the legacy cuda_graph_scope into cuda_graph_modules and
// the deprecated "full_iteration" module into cuda_graph_impl. Each step only where Megatron's
// asserts pass: the check's cuda_graph rules name the rest on the config as written.
void migrate_cuda_graph(ModelConfig& m) {
  if (m.cuda_graph_impl == "none") {
    m.cuda_graph_modules.clear();
    m.cuda_graph_scope.clear();
    return;
  }
  if (!m.cuda_graph_scope.empty() && (m.cuda_graph_modules.empty() || m.cuda_graph_modules == StringList{"full"})) {
    m.cuda_graph_modules = m.cuda_graph_scope;
    m.cuda_graph_scope.clear();
  }
  const bool fits = m.cuda_graph_impl == "local" || m.cuda_graph_impl == "full_iteration";
  if (fits && m.cuda_graph_scope.empty() && !m.cuda_graph_modules.empty() &&
      std::all_of(m.cuda_graph_modules.begin(), m.cuda_graph_modules.end(), [](const std::string& s) { return s == "full_iteration"; })) {
    m.cuda_graph_impl = "full_iteration";
    m.cuda_graph_modules.clear();
  }
}

// Bridge's _validate_and_sync_distributed_optimizer_settings for one switch: on in either
// section, on in both.
void sync_ddp_and_optimizer(bool& ddp, bool& optimizer, const char* id, const char* field, const char* settings,
                            const char* what, std::vector<Finding>& out) {
  if (ddp != optimizer) {
    const auto py = [](bool b) { return b ? "True" : "False"; };
    out.push_back(note(id, Severity::warning,
                       {{fmt::format("ddp.{}", field), ddp ? "true" : "false"},
                        {fmt::format("optimizer.{}", field), optimizer ? "true" : "false"}},
                       fmt::format("{} settings were not in sync: ddp.{}={}, optimizer.{}={}. Automatically enabling {} "
                                   "for both settings.",
                                   settings, field, py(ddp), field, py(optimizer), what),
                       fmt::format("{}.{}=true", ddp ? "optimizer" : "ddp", field)));
  }
  ddp = optimizer = ddp || optimizer;
}

}  // namespace

std::vector<Finding> finalize(Config& c, const FinalizeOptions& options) {
  std::vector<Finding> out;
  apply_mixed_precision(c, out);  // first in runtime_config_update
  const Int dp = data_parallel_size(c);

  if (c.comm_overlap) {
    c.comm_overlap->data_parallel_size = dp > 0 ? OptInt(dp) : std::nullopt;
    setup_model_comm_overlap(c, options, out);
    if (c.ddp.use_distributed_optimizer) setup_optimizer_comm_overlap(c, dp, out);
  }
  // ConfigContainer.validate: the TE RNG tracker asked for in either place is on in both.
  c.model.use_te_rng_tracker = c.rng.te_rng_tracker = c.model.use_te_rng_tracker || c.rng.te_rng_tracker;
  // Bridge keeps these two in step between ddp and optimizer, with a warning where they differed.
  sync_ddp_and_optimizer(c.ddp.use_distributed_optimizer, c.optimizer.use_distributed_optimizer,
                         "optimizer.distributed_sync", "use_distributed_optimizer", "Distributed optimizer", "distributed optimizer", out);
  sync_ddp_and_optimizer(c.ddp.overlap_param_gather, c.optimizer.overlap_param_gather, "optimizer.param_gather_sync",
                         "overlap_param_gather", "overlap_param_gather", "overlap_param_gather", out);

  // Megatron-Core TransformerConfig post-init and Bridge's model finalize.
  ModelConfig& m = c.model;
  if (m.tensor_model_parallel_size <= 1) m.sequence_parallel = false;  // Bridge, before Megatron-Core's check
  m.expert_tensor_parallel_size = effective_etp(m);
  if (!m.recompute_modules) m.recompute_modules = StringList{"core_attn"};
  if (!m.ffn_hidden_size && m.hidden_size > 0) m.ffn_hidden_size = 4 * m.hidden_size;
  if (m.num_moe_experts && !m.moe_ffn_hidden_size && m.ffn_hidden_size) {
    m.moe_ffn_hidden_size = m.ffn_hidden_size;
    out.push_back(note("moe.ffn_hidden_size_unset", Severity::warning,
                       {{"model.moe_ffn_hidden_size", "null"}, {"model.ffn_hidden_size", std::to_string(*m.ffn_hidden_size)}},
                       "moe_ffn_hidden_size is not set, using ffn_hidden_size instead.",
                       fmt::format("model.moe_ffn_hidden_size={}", *m.ffn_hidden_size)));
  }
  if (m.moe_expert_capacity_factor && *m.moe_expert_capacity_factor < 0) m.moe_expert_capacity_factor.reset();
  migrate_cuda_graph(m);
  fold_deprecated_sm_knobs(m, out);
  if (m.moe_token_dispatcher_type == "flex" && m.moe_flex_dispatcher_backend == "hybridep" &&
      m.cuda_graph_impl == "none")
    m.moe_hybridep_pad_uneven_dispatch_inputs = true;
  return out;
}

}  // namespace epx
