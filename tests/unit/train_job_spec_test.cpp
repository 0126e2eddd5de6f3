// train/job_spec: the specs the layers below train/ run on, built from the config, and the
// run-time refusals that stand behind the checker's rules.
#include <cmath>
#include <cstdlib>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "epx/check/check.hpp"
#include "epx/config/schema.hpp"
#include "epx/train/job_spec.hpp"
#include "test_support.hpp"

namespace epx {
namespace {

Config resolved(const std::vector<std::string>& overrides) {
  Config c = test::load_with("qwen3_30b_a3b_proxy", overrides);
  c.target.gpu = "cpu";
  return resolve_config(c, std::nullopt);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// A Bridge dump's unmodelled fields that change the model (GPT-OSS's activation, Qwen3-Next's
// output gate, partial RoPE, ...) are refused by the runtime, naming the line; their defaults pass.
TEST(JobSpec, UnmodelledFieldsThatChangeTheModelAreRefused) {
  const std::string dump = read_config_text(std::string(EPX_TEST_DATA) + "/bridge_dump_qwen3_30b_a3b.yaml");
  const auto with = [&](const std::string& fields) {
    std::string text = dump;
    text.insert(text.find("  gated_linear_unit: true"), fields);
    Config c = load_config_text(text, "dump.yaml");
    c.target.gpu = "cpu";
    return resolve_config(c, std::nullopt);
  };
  EXPECT_NE(error_of([&] { model_spec_from_config(with("  attention_output_gate: true\n")); }).find("model.attention_output_gate=true"),
            std::string::npos);
  // Dropout, which epx does not apply (the dump's 0.0 passes, Megatron's default 0.1 does not).
  for (const char* field : {"hidden_dropout", "attention_dropout"}) {
    std::string text = dump;
    const std::string line = fmt::format("  {}: 0.0\n", field);
    text.replace(text.find(line), line.size(), fmt::format("  {}: 0.1\n", field));
    Config c = load_config_text(text, "dump.yaml");
    c.target.gpu = "cpu";
    const std::string e = error_of([&] { model_spec_from_config(resolve_config(c, std::nullopt)); });
    EXPECT_NE(e.find(fmt::format("dump.yaml:{}:", field == std::string("hidden_dropout") ? 54 : 53)), std::string::npos) << e;
    EXPECT_NE(e.find(fmt::format("model.{}=0.1: epx trains without dropout", field)), std::string::npos) << e;
  }
  // Set by an override, the refusal names the override, not the file's line of 0.0.
  Config overridden = load_config_text(dump, "dump.yaml");
  overridden.target.gpu = "cpu";
  apply_override(overridden, "model.hidden_dropout=0.1");
  const std::string e = error_of([&] { model_spec_from_config(resolve_config(overridden, std::nullopt)); });
  EXPECT_EQ(e.find("model.hidden_dropout=0.1: epx trains without dropout"), 0u) << e;
  // null is no probability: Megatron's dropout fails on it, so epx refuses it too.
  apply_override(overridden, "model.attention_dropout=null");
  apply_override(overridden, "model.hidden_dropout=0.0");
  const std::string null_error = error_of([&] { model_spec_from_config(resolve_config(overridden, std::nullopt)); });
  EXPECT_NE(null_error.find("model.attention_dropout=None: epx trains without dropout, and Megatron's dropout takes a "
                            "probability"),
            std::string::npos)
      << null_error;
  // MTP's variant epx does not build (hidden-state mixing); one layer reused
  // (mtp_use_repeated_layer) and detached heads it builds.
  EXPECT_EQ(error_of([&] { model_spec_from_config(with("  mtp_use_repeated_layer: true\n")); }), "");
  EXPECT_EQ(error_of([&] { model_spec_from_config(with("  mtp_detach_heads: true\n")); }), "");
  EXPECT_NE(error_of([&] { model_spec_from_config(with("  mtp_hsm: true\n")); }).find("model.mtp_hsm=true"), std::string::npos);
  EXPECT_NE(error_of([&] { moe_spec_from_config(with("  moe_apply_probs_on_input: true\n")); })
                .find("model.moe_apply_probs_on_input=true"),
            std::string::npos);
  // Partial RoPE is modelled: int(128 * 0.5) channels rotate; one channel cannot.
  EXPECT_EQ(model_spec_from_config(with("  rotary_percent: 0.5\n")).attention.rope_dim, 64);
  EXPECT_EQ(model_spec_from_config(with("  rotary_percent: 0.01\n")).attention.rope_dim, 1);  // rotates 2 channels
  // int(128 * 0.005) = 0: Megatron's RotaryEmbedding has no frequencies and rotates nothing.
  EXPECT_FALSE(model_spec_from_config(with("  rotary_percent: 0.005\n")).attention.rope);
  EXPECT_EQ(error_of([&] {
              moe_spec_from_config(with("  rotary_percent: 1.0\n  softmax_type: vanilla\n  window_size: null\n"
                                        "  attention_output_gate: false\n"));
            }),
            "");
}

// GPT-OSS's attention as a Bridge dump writes it (the window tuple as a block list, the skip
// frequency, learned sinks, YaRN) is modelled; what TE or Megatron refuses is refused with its field.
TEST(JobSpec, SlidingWindowAndSinksFromABridgeDump) {
  const std::string dump = read_config_text(std::string(EPX_TEST_DATA) + "/bridge_dump_qwen3_30b_a3b.yaml");
  const auto with = [&](const std::string& fields, const std::string& position = "rope") {
    std::string text = dump;
    text.insert(text.find("  gated_linear_unit: true"), fields);
    const std::string line = "position_embedding_type: rope";
    text.replace(text.find(line), line.size(), "position_embedding_type: " + position);
    Config c = load_config_text(text, "dump.yaml");
    c.target.gpu = "cpu";
    return resolve_config(c, std::nullopt);
  };
  const ModelSpec s =
      model_spec_from_config(with("  window_size:\n  - 127\n  - 0\n  window_attn_skip_freq: 2\n  softmax_type: learnable\n"));
  EXPECT_EQ(s.attention.window, 127);
  EXPECT_EQ(s.attention.softmax, AttentionSoftmax::learnable);
  ASSERT_EQ(s.is_window.size(), 48u);
  EXPECT_TRUE(s.is_window[0]);   // layer_number 1
  EXPECT_FALSE(s.is_window[1]);  // layer_number 2: full attention
  EXPECT_EQ(model_spec_from_config(with("  window_size: (127, 0)\n")).attention.window, 127);  // a tuple as Python writes it
  EXPECT_EQ(model_spec_from_config(with("  window_size: [127, 5]\n")).attention.window, 127);  // TE: right -> 0, warned
  const std::string right = error_of([&] { model_spec_from_config(with("  window_size: [-1, 3]\n")); });
  EXPECT_NE(right.find("dump.yaml:"), std::string::npos) << right;
  EXPECT_NE(right.find("model.window_size=[-1, 3]: [model.window_size_causal] window_size should be (-1, 0) or (>=0, 0) "
                       "for attn_mask_type=causal"),
            std::string::npos)
      << right;
  EXPECT_NE(error_of([&] { with("  window_size: [-2, 0]\n"); }).find("the left side is -1 (unbounded) or at least 0"),
            std::string::npos);
  EXPECT_NE(error_of([&] { with("  window_size: [1, 2, 3]\n"); }).find("a pair [left, right] of integers"),
            std::string::npos);
  const std::string short_pattern =
      error_of([&] { model_spec_from_config(with("  window_size: [3, 0]\n  window_attn_skip_freq: [1, 0]\n")); });
  EXPECT_NE(short_pattern.find("[model.window_pattern_length] the pattern has 2 entries for 48 layers"),
            std::string::npos)
      << short_pattern;
  EXPECT_NE(error_of([&] { with("  softmax_type: sigmoid\n"); }).find("vanilla|off-by-one|learnable"), std::string::npos);
  EXPECT_NE(error_of([&] { with("  window_attn_skip_freq: []\n"); }).find("model.window_attn_skip_freq is an empty list"),
            std::string::npos);
  // Megatron's own example of a pattern: a parenthesised group repeated.
  EXPECT_EQ(with("  window_attn_skip_freq: ([1]*3+[0]*1)*3\n").model.window_attn_skip_freq->pattern,
            (std::vector<Int>{1, 1, 1, 0, 1, 1, 1, 0, 1, 1, 1, 0}));
  EXPECT_EQ(with("  window_attn_skip_freq: ([1]+[0])*2+[1]\n").model.window_attn_skip_freq->pattern,
            (std::vector<Int>{1, 0, 1, 0, 1}));
  EXPECT_NE(error_of([&] { with("  window_attn_skip_freq: " + std::string(100000, '(') + "[1]" + std::string(100000, ')') + "\n"); })
                .find("model.window_attn_skip_freq"),
            std::string::npos);
  // GPT-OSS's YaRN as Bridge's provider sets it: every channel rotates whatever rotary_percent says.
  const std::string yarn =
      "  yarn_rotary_scaling_factor: 32.0\n"
      "  yarn_original_max_position_embeddings: 4096\n  yarn_beta_fast: 32.0\n  yarn_beta_slow: 1.0\n"
      "  yarn_mscale: null\n  yarn_mscale_all_dim: null\n  yarn_correction_range_round_to_int: false\n";
  const ModelSpec y = model_spec_from_config(with(yarn + "  rotary_percent: 0.5\n", "yarn"));
  ASSERT_TRUE(y.attention.yarn.has_value());
  EXPECT_EQ(y.attention.yarn->factor, 32.0);
  EXPECT_FALSE(y.attention.yarn->round_to_int);
  EXPECT_EQ(y.attention.rope_dim, 128);
  EXPECT_NEAR(y.attention.rope_concentration, 1 + 0.1 * std::log(32.0), 1e-12);
  // Bridge's patched concentration applies wherever the factor is set, plain RoPE too.
  EXPECT_NEAR(model_spec_from_config(with("  yarn_rotary_scaling_factor: 32.0\n")).attention.rope_concentration,
              1 + 0.1 * std::log(32.0), 1e-12);
  EXPECT_EQ(model_spec_from_config(with("")).attention.rope_concentration, 1.0);
  const std::string missing = error_of([&] {
    model_spec_from_config(with("  yarn_rotary_scaling_factor: 32.0\n", "yarn"));
  });
  EXPECT_NE(missing.find("model.yarn_original_max_position_embeddings=None: [model.yarn_fields]"), std::string::npos)
      << missing;
  std::string zero_beta = yarn;
  zero_beta.replace(zero_beta.find("yarn_beta_slow: 1.0"), 19, "yarn_beta_slow: 0.0");
  const std::string zero = error_of([&] { model_spec_from_config(with(zero_beta, "yarn")); });
  EXPECT_NE(zero.find("model.yarn_beta_slow=0: [model.yarn_fields] YaRN takes the logarithm of it"), std::string::npos) << zero;
}

// add_bias_linear (Megatron's default, GPT-OSS's) gives every linear layer a bias, add_qkv_bias
// linear_qkv's alone; the experts' need ETP 1 and no fused bias-dropout-add, as Megatron asserts.
TEST(JobSpec, LinearBiasesAsMegatronBuildsThem) {
  const ModelSpec plain = model_spec_from_config(resolved({}));
  EXPECT_FALSE(plain.bias || plain.attention.qkv_bias || plain.attention.proj_bias || plain.moe->bias);
  const ModelSpec all = model_spec_from_config(resolved({"model.add_bias_linear=true"}));
  EXPECT_TRUE(all.bias && all.attention.qkv_bias && all.attention.proj_bias && all.moe->bias);
  const ModelSpec qkv = model_spec_from_config(resolved({"model.add_qkv_bias=true"}));
  EXPECT_TRUE(qkv.attention.qkv_bias);
  EXPECT_FALSE(qkv.attention.proj_bias || qkv.bias || qkv.moe->bias);
  EXPECT_NE(error_of([] { moe_spec_from_config(resolved({"model.add_bias_linear=true", "model.bias_dropout_fusion=true"})); })
                .find("[moe.bias_dropout_fusion]"),
            std::string::npos);
}

// The dump's activation (a callable's _target_), its clamp and offset reach the experts and the
// dense MLPs; a dump without one computes Megatron-Core's default, GELU.
TEST(JobSpec, ActivationFromABridgeDump) {
  const std::string dump = read_config_text(std::string(EPX_TEST_DATA) + "/bridge_dump_qwen3_30b_a3b.yaml");
  const auto with = [&](const std::string& target, const std::string& fields) {
    std::string text = dump;
    const std::string silu = "torch.nn.functional.silu\n    _call_: false";  // the dump's callable
    if (target.empty()) {
      const std::size_t at = text.find("  activation_func:");
      text.erase(at, text.find("  add_bias_linear") - at);
    } else {  // a partial is dumped without _call_
      text.replace(text.find(silu), silu.size(), target.find("_partial_") != std::string::npos ? target : target + "\n    _call_: false");
    }
    text.insert(text.find("  add_bias_linear"), fields);
    Config c = load_config_text(text, "dump.yaml");
    c.target.gpu = "cpu";
    return resolve_config(c, std::nullopt);
  };
  EXPECT_EQ(moe_spec_from_config(with(std::string("torch.nn.functional.silu"), "")).activation.fn, ActivationFn::silu);
  const MoESpec gpt_oss = moe_spec_from_config(with("megatron.core.fusions.fused_bias_geglu.quick_gelu",
                                                    "  activation_func_clamp_value: 7.0\n  glu_linear_offset: 1.0\n"));
  EXPECT_EQ(gpt_oss.activation.fn, ActivationFn::quick_gelu);
  EXPECT_EQ(gpt_oss.activation.clamp, 7.f);
  EXPECT_EQ(gpt_oss.activation.linear_offset, 1.f);
  const ModelSpec gemma = model_spec_from_config(with("megatron.core.activations.fast_gelu", ""));
  EXPECT_EQ(gemma.activation.fn, ActivationFn::fast_gelu);
  EXPECT_EQ(gemma.moe->activation.fn, ActivationFn::fast_gelu);
  EXPECT_EQ(model_spec_from_config(with("", "")).activation.fn, ActivationFn::gelu);
  const std::string clamp = error_of([&] {
    moe_spec_from_config(with(std::string("torch.nn.functional.silu"), "  activation_func_clamp_value: -1.0\n"));
  });
  EXPECT_NE(clamp.find("dump.yaml:42:32: model.activation_func_clamp_value=-1: "), std::string::npos) << clamp;
  // A dumped functools.partial of torch's GELU with approximate="tanh" (Qwen3-VL's) is fast_gelu's math.
  const std::string partial = "torch.nn.functional.gelu\n    _partial_: true\n    _args_: []\n    approximate: tanh";
  EXPECT_EQ(moe_spec_from_config(with(partial, "")).activation.fn, ActivationFn::fast_gelu);
  const std::string other = error_of([&] { with("torch.nn.functional.silu\n    inplace: true", ""); });
  EXPECT_NE(other.find("model.activation_func: inplace=true on torch.nn.functional.silu: epx reads a callable as "
                       "{_target_: <path>, _call_: false}"),
            std::string::npos)
      << other;
  // Bridge's instantiate refuses a callable with arguments, and calls a target without _call_: false.
  EXPECT_NE(error_of([&] { with("torch.nn.functional.gelu\n    approximate: tanh", ""); }).find("approximate=tanh on"),
            std::string::npos);
  // Megatron's other kernels compute other math than its unfused glu(): refused rather than trained as epx's.
  const std::string te = error_of([&] {
    model_spec_from_config(with("torch.nn.functional.gelu", "  use_te_activation_func: true\n"));
  });
  EXPECT_NE(te.find("model.use_te_activation_func=true: Transformer Engine's activation ops compute GELU's tanh"),
            std::string::npos)
      << te;
  const std::string fused = error_of([&] {
    model_spec_from_config(with("torch.nn.functional.gelu", "  moe_shared_expert_intermediate_size: 64\n"));
  });
  EXPECT_NE(fused.find("model.bias_activation_fusion=true: [model.fused_gelu_is_tanh]"), std::string::npos) << fused;
  const std::string unknown = error_of([&] { with("torch.nn.functional.mish", ""); });
  EXPECT_NE(unknown.find("model.activation_func must be one of silu|quick_gelu|"), std::string::npos) << unknown;
  EXPECT_NE(unknown.find("got 'mish'"), std::string::npos) << unknown;
}

// Multi-latent attention with DeepSeek-V3's numbers: a key and value per head, head_dim = qk_head_dim
// + qk_pos_emb_head_dim, YaRN over the latter with its concentration factor (1 where mscale =
// mscale_all_dim), and the softmax scaled by mscale(40, mscale_all_dim)^2 / sqrt(192).
TEST(JobSpec, MultiLatentAttentionFromTheConfig) {
  const std::vector<std::string> dsv3{"model.multi_latent_attention=true", "model.q_lora_rank=1536",
                                      "model.kv_lora_rank=512",           "model.qk_head_dim=128",
                                      "model.qk_pos_emb_head_dim=64",     "model.v_head_dim=128",
                                      "model.qk_layernorm=true"};
  const auto with = [&](const std::vector<std::string>& extra) {
    std::vector<std::string> o = dsv3;
    o.insert(o.end(), extra.begin(), extra.end());
    return model_spec_from_config(resolved(o)).attention;
  };
  const double m40 = 0.1 * std::log(40.0) + 1;  // _yarn_get_mscale(40, 1)
  const AttentionSpec a = with({"model.mscale=1.0", "model.mscale_all_dim=1.0"});
  ASSERT_TRUE(a.mla);
  EXPECT_EQ(a.mla->q_lora_rank, 1536);
  EXPECT_EQ(a.groups, a.heads);
  EXPECT_EQ(a.head_dim, 192);
  EXPECT_EQ(a.value_dim(), 128);
  EXPECT_EQ(a.rope_dim, 64);
  ASSERT_TRUE(a.yarn);
  EXPECT_EQ(a.yarn->factor, 40);
  EXPECT_EQ(a.yarn->original_max_positions, 4096);
  EXPECT_TRUE(a.yarn->round_to_int);
  EXPECT_EQ(a.rope_concentration, 1.0);
  EXPECT_FLOAT_EQ(*a.softmax_scale, static_cast<float>(m40 * m40 / std::sqrt(192.0)));
  EXPECT_FALSE(a.qkv_bias);
  // MLATransformerConfig's defaults (mscale 1, mscale_all_dim 0): cos and sin times mscale(40, 1), the
  // logits at 1/sqrt(192); plain RoPE has no YaRN.
  const AttentionSpec defaults = with({});
  EXPECT_DOUBLE_EQ(defaults.rope_concentration, m40);
  EXPECT_FLOAT_EQ(*defaults.softmax_scale, static_cast<float>(1 / std::sqrt(192.0)));
  EXPECT_FALSE(with({"model.rope_type=rope"}).yarn);
  EXPECT_NE(error_of([&] { with({"model.qk_pos_emb_head_dim=63"}); }).find("model.qk_pos_emb_head_dim=63"),
            std::string::npos);
  EXPECT_NE(error_of([&] { with({"model.rotary_scaling_factor=0.0"}); }).find("model.rotary_scaling_factor=0"),
            std::string::npos);
  EXPECT_FALSE(with({"model.rope_type=rope", "model.rotary_scaling_factor=0.0"}).yarn);  // read by YaRN alone
  EXPECT_TRUE(with({"model.rotary_percent=0.5"}).yarn);  // YaRN's MLA table ignores it; plain RoPE's would not
  EXPECT_NE(error_of([&] { with({"model.rope_type=rope", "model.rotary_percent=0.5"}); }).find("model.rotary_percent=0.5"),
            std::string::npos);
  // Megatron's MLA asserts GPTModel hands it no YaRN table; with no q latent it norms x through TE.
  EXPECT_NE(error_of([&] { with({"model.position_embedding_type=yarn"}); }).find("[model.mla_position_embedding]"),
            std::string::npos);
  EXPECT_NE(error_of([&] { with({"model.q_lora_rank=null"}); }).find("model.qk_layernorm=true"), std::string::npos);
  EXPECT_FALSE(with({"model.q_lora_rank=null", "model.qk_layernorm=false"}).mla->q_lora_rank);
}

// gated_linear_unit=false (Megatron's default MLP) is modelled: fc1 is F wide, and the clamp and
// offset that only glu() reads are dropped as Megatron drops them; TE's ops for it are refused.
TEST(JobSpec, UngatedMlpFromABridgeDump) {
  const std::string dump = read_config_text(std::string(EPX_TEST_DATA) + "/bridge_dump_qwen3_30b_a3b.yaml");
  const auto with = [&](const std::string& fields) {
    std::string text = dump;
    const std::string gated = "  gated_linear_unit: true\n";
    text.replace(text.find(gated), gated.size(), "  gated_linear_unit: false\n" + fields);
    // The dump fuses the bias and SwiGLU, which Megatron refuses for an ungated silu.
    const std::string fused = "  bias_activation_fusion: true\n";
    text.replace(text.find(fused), fused.size(), "  bias_activation_fusion: false\n");
    Config c = load_config_text(text, "dump.yaml");
    c.target.gpu = "cpu";
    return resolve_config(c, std::nullopt);
  };
  const ModelSpec s = model_spec_from_config(with("  activation_func_clamp_value: 7.0\n  glu_linear_offset: 1.0\n"));
  for (const MlpActivation& a : {s.activation, s.moe->activation}) {
    EXPECT_FALSE(a.gated);
    EXPECT_EQ(a.fn, ActivationFn::silu);
    EXPECT_FALSE(a.clamp);
    EXPECT_EQ(a.linear_offset, 0.f);
    EXPECT_EQ(a.fc1_width(64), 64);
  }
  const std::string te = error_of([&] { model_spec_from_config(with("  use_te_activation_func: true\n")); });
  EXPECT_NE(te.find("model.use_te_activation_func=true: Megatron-Core's TEActivationOp [model.te_activation_ungated] "
                    "runs ReLU for an ungated silu"),
            std::string::npos)
      << te;
}

// The config's activation names are the kernel's, one for one.
TEST(JobSpec, ActivationNamesAreTheKernels) {
  std::vector<std::string> kernel;
  for (const ActivationFn fn : kActivationFns) kernel.emplace_back(activation_fn_name(fn));
  EXPECT_EQ(find_field("model.activation_func")->choices, kernel);
}

TEST(JobSpec, DispatcherOptionsFromTheConfigAndHybridEpVariables) {
  const DispatcherOptions a = dispatcher_options_from_config(resolved({"model.moe_token_dispatcher_type=alltoall"}));
  EXPECT_EQ(a.type, DispatcherType::alltoall);
  const DispatcherOptions f = dispatcher_options_from_config(
      resolved({"model.moe_token_dispatcher_type=flex", "model.moe_flex_dispatcher_backend=hybridep",
                "+env_vars.NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN=2",
                "+env_vars.NUM_OF_TOKENS_PER_CHUNK_DISPATCH_API=8"}));
  EXPECT_EQ(f.type, DispatcherType::flex);
  EXPECT_EQ(f.flex.backend, FlexBackend::hybridep);
  EXPECT_EQ(f.flex.ranks_per_domain, 2);
  EXPECT_EQ(f.flex.tokens_per_chunk, 8);
  // The process environment wins over the recipe's env_vars, as for HybridEP itself.
  setenv("NUM_OF_TOKENS_PER_CHUNK_DISPATCH_API", "16", 1);
  EXPECT_EQ(dispatcher_options_from_config(resolved({"model.moe_token_dispatcher_type=flex",
                                                     "+env_vars.NUM_OF_TOKENS_PER_CHUNK_DISPATCH_API=8"}))
                .flex.tokens_per_chunk,
            16);
  setenv("NUM_OF_TOKENS_PER_CHUNK_DISPATCH_API", "0", 1);
  const std::string bad = error_of([] { dispatcher_options_from_config(resolved({"model.moe_token_dispatcher_type=flex"})); });
  unsetenv("NUM_OF_TOKENS_PER_CHUNK_DISPATCH_API");
  EXPECT_NE(bad.find("NUM_OF_TOKENS_PER_CHUNK_DISPATCH_API='0'"), std::string::npos) << bad;
  EXPECT_NE(bad.find("set NUM_OF_TOKENS_PER_CHUNK_DISPATCH_API=64"), std::string::npos) << bad;
}

TEST(JobSpec, BackendNotBuiltIsAnEnvironmentError) {
  Config c = resolved({"model.moe_token_dispatcher_type=flex"});
  c.model.moe_flex_dispatcher_backend = "ncclep";
  try {
    dispatcher_options_from_config(c);
    FAIL() << "ncclep was accepted";
  } catch (const EnvironmentError& e) {
    EXPECT_NE(std::string(e.what()).find("no ncclep backend"), std::string::npos) << e.what();
  }
}

TEST(JobSpec, RunTimeRefusalsCiteTheCheckRule) {
  Config c = resolved({});
  c.model.moe_router_topk = 99;
  EXPECT_NE(error_of([&] { moe_spec_from_config(c); }).find("[moe.topk_range]"), std::string::npos);
  EXPECT_NE(error_of([] { experts_per_ep_rank(6, 4); }).find("[parallel.experts_divisible_by_ep]"), std::string::npos);
  EXPECT_NE(error_of([] {
              JobSpec::from_config(resolved({"comm_overlap.overlap_moe_expert_parallel_comm=true", "model.bf16=true",
                                             "model.recompute_granularity=selective", "model.recompute_modules=[moe]"}),
                                   2);
            }).find("[ep_overlap.recompute_moe]"),
            std::string::npos);
  // Each cited id is a row of the checker's table.
  const std::string table = format_rule_table();
  for (const char* id : {"moe.topk_range", "parallel.experts_divisible_by_ep", "ep_overlap.full_recompute",
                         "hybridep.domain_divides_ep", "ep_overlap.pp_needs_vpp", "parallel.vpp_needs_pp", "ddp.embedding_rows",
                         "moe.group_limited_routing", "ep_overlap.recompute_moe"})
    EXPECT_NE(table.find(id), std::string::npos) << id;
}

// As Megatron's compute_topk: routing is group-limited only when moe_router_group_topk is set.
TEST(JobSpec, GroupsAloneLeaveTheRoutingPlain) {
  const MoESpec plain = moe_spec_from_config(resolved({"model.moe_router_num_groups=4"}));
  EXPECT_EQ(plain.num_groups, 0);
  EXPECT_EQ(plain.group_topk, 0);
  const MoESpec grouped =
      moe_spec_from_config(resolved({"model.moe_router_num_groups=4", "model.moe_router_group_topk=2"}));
  EXPECT_EQ(grouped.num_groups, 4);
  EXPECT_EQ(grouped.group_topk, 2);
  Config c = resolved({});
  c.model.moe_router_group_topk = 2;  // past the checker: no groups
  EXPECT_NE(error_of([&] { moe_spec_from_config(c); }).find("model.moe_router_num_groups=None"), std::string::npos);
}

// A NaN loss stops the run unless the kept rerun_state_machine section turns the check off (as
// Bridge's performance recipes do); its value must be a bool.
TEST(JobSpec, TheNanCheckFollowsTheRerunStateMachine) {
  EXPECT_TRUE(JobSpec::from_config(resolved({}), 2).check_for_nan_in_loss);
  EXPECT_FALSE(JobSpec::from_config(resolved({"+rerun_state_machine.check_for_nan_in_loss=false"}), 2).check_for_nan_in_loss);
  EXPECT_NE(error_of([] { JobSpec::from_config(resolved({"+rerun_state_machine.check_for_nan_in_loss=maybe"}), 2); })
                .find("rerun_state_machine.check_for_nan_in_loss=maybe: expected true or false"),
            std::string::npos);
  // Group-limited routing where group_topk does not divide topk, as Megatron's floor takes it.
  EXPECT_EQ(error_of([] {
              moe_spec_from_config(resolved({"model.moe_router_num_groups=4", "model.moe_router_group_topk=3"}));
            }),
            "");
}

// Load balancing as Megatron's router reads it: a coefficient per aux loss, quantile balancing
// only as the one type; what epx does not run is refused with its rule.
TEST(JobSpec, LoadBalancingAsTheRouterReadsIt) {
  const MoESpec both = moe_spec_from_config(resolved(
      {"model.moe_router_load_balancing_type=[seq_aux_loss,global_aux_loss]", "model.moe_aux_loss_coeff=[1e-4,1e-3]"}));
  EXPECT_EQ(both.aux_loss_coeff, (AuxLossValues{0, 1e-4, 1e-3}));
  EXPECT_FALSE(both.quantile_balancing);
  const MoESpec qb = moe_spec_from_config(resolved({"model.moe_router_load_balancing_type=quantile_balancing",
                                                    "model.moe_router_quantile_balancing_ema=0.9"}));
  EXPECT_TRUE(qb.quantile_balancing);
  EXPECT_EQ(qb.aux_loss_coeff, AuxLossValues{});  // the coefficient is looked up by aux-loss type
  EXPECT_DOUBLE_EQ(qb.quantile_balancing_ema, 0.9);
  EXPECT_FALSE(moe_spec_from_config(resolved({"model.moe_router_load_balancing_type=[quantile_balancing]",
                                              "model.moe_aux_loss_coeff=[0.0]"}))
                   .quantile_balancing);  // inside a list it does nothing
  EXPECT_EQ(moe_spec_from_config(resolved({"model.moe_router_load_balancing_type=noaux_tc"})).aux_loss_coeff, AuxLossValues{});
  EXPECT_NE(error_of([] { moe_spec_from_config(resolved({"model.moe_router_load_balancing_type=[aux_loss,seq_aux_loss]"})); })
                .find("[moe.aux_loss_coeff_list]"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              moe_spec_from_config(resolved({"model.moe_router_load_balancing_type=quantile_balancing", "model.seq_length=255"}));
            }).find("[moe.quantile_balancing_assignments] Quantile balancing requires the number of routed assignments "
                    "(255 tokens * top-4) to be divisible by 16 experts."),
            std::string::npos);
  EXPECT_NE(error_of([] {
              moe_spec_from_config(resolved({"model.moe_router_load_balancing_type=sinkhorn", "model.moe_aux_loss_coeff=0"}));
            }).find("epx has no Sinkhorn routing"),
            std::string::npos);
  // Gemma's pair of RoPE bases loads and is checked; the runtime applies one.
  EXPECT_NE(error_of([] { JobSpec::from_config(resolved({"model.rotary_base=[10000,1000000]"}), 2); })
                .find("epx applies one RoPE base"),
            std::string::npos);
}

// TE's FusedAdam with FP32 state is epx's Adam (what -c bf16 sets); lower-precision state is refused.
TEST(JobSpec, ThePrecisionAwareOptimizerInFp32IsEpxsAdam) {
  const std::vector<std::string> aware = {"optimizer.use_precision_aware_optimizer=true", "ddp.use_distributed_optimizer=true"};
  EXPECT_EQ(error_of([&] { JobSpec::from_config(resolved(aware), 2); }), "");
  std::vector<std::string> bf16_state = aware;
  bf16_state.push_back("optimizer.exp_avg_dtype=bf16");
  EXPECT_NE(error_of([&] { JobSpec::from_config(resolved(bf16_state), 2); }).find("optimizer.exp_avg_dtype=bf16: epx's Adam"),
            std::string::npos);
}

TEST(JobSpec, TheRouterRunsInFp32) {
  EXPECT_EQ(error_of([] { moe_spec_from_config(resolved({"model.moe_router_dtype=fp32"})); }), "");
  EXPECT_NE(error_of([] { moe_spec_from_config(resolved({"model.moe_router_dtype=fp64"})); })
                .find("model.moe_router_dtype=fp64: epx routes in FP32"),
            std::string::npos);
}

// A value the runtime refuses that a file set is cited at its file and line, as the check's are.
TEST(JobSpec, RefusalsOfAFilesValueNameTheLine) {
  std::string text = dump_yaml(test::load_with("qwen3_30b_a3b_proxy", {}));
  const std::string key = "  fp16: false";
  text.replace(text.find(key), key.size(), "  fp16: true");
  Config c = load_config_text(text, "mine.yaml");
  c.target.gpu = "cpu";
  const std::string why = error_of([&] { model_spec_from_config(resolve_config(c, std::nullopt)); });
  EXPECT_NE(why.find("mine.yaml:"), std::string::npos) << why;
  EXPECT_NE(why.find(": model.fp16=true: epx computes in BF16 or FP32"), std::string::npos) << why;
}

TEST(JobSpec, FP8IsRefusedByTheRuntime) {
  EXPECT_NE(error_of([] { model_spec_from_config(resolved({"model.fp8=hybrid"})); }).find("model.fp8=hybrid: epx computes"),
            std::string::npos);
  EXPECT_NE(error_of([] { moe_spec_from_config(resolved({"model.fp8=e4m3"})); }).find("set model.fp8=null"),
            std::string::npos);
}

TEST(JobSpec, EmbeddingRowsNeedOverlapAndAnUntiedHead) {
  EXPECT_TRUE(grad_reduce_options_from_config(resolved({"ddp.overlap_grad_reduce=true", "ddp.reduce_embedding_rows=true"}), 2)
                  .embedding_rows);
  const std::string no_overlap = error_of([] {
    grad_reduce_options_from_config(resolved({"ddp.overlap_grad_reduce=false", "ddp.reduce_embedding_rows=true"}), 2);
  });
  EXPECT_NE(no_overlap.find("ddp.reduce_embedding_rows"), std::string::npos) << no_overlap;
  EXPECT_NE(no_overlap.find("set ddp.overlap_grad_reduce=true"), std::string::npos) << no_overlap;
  const std::string tied = error_of([] {
    grad_reduce_options_from_config(resolved({"ddp.overlap_grad_reduce=true", "ddp.reduce_embedding_rows=true",
                                              "model.share_embeddings_and_output_weights=true"}),
                                    2);
  });
  EXPECT_NE(tied.find("model.share_embeddings_and_output_weights=true"), std::string::npos) << tied;
}

TEST(JobSpec, OneLayoutForRunAndLayer) {
  const ParallelLayout l = parallel_layout_from_config(resolved({"model.expert_model_parallel_size=2"}), 4);
  EXPECT_EQ(l.dp, 4);
  EXPECT_EQ(l.ep, 2);
  EXPECT_NE(error_of([] { parallel_layout_from_config(resolved({"model.tensor_model_parallel_size=2"}), 4); })
                .find("model.tensor_model_parallel_size=2"),
            std::string::npos);
}

std::vector<std::string> with(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// Multi-token prediction: its layers take the last layer's kind, their loss weight is the
// factor split over them; a window is refused.
TEST(JobSpec, MultiTokenPredictionFromTheConfig) {
  const ModelSpec s = model_spec_from_config(
      resolved({"model.mtp_num_layers=2", "model.mtp_loss_scaling_factor=0.3", "model.moe_layer_freq=[0,1]", "model.num_layers=2"}));
  EXPECT_EQ(s.mtp_layers, 2);
  EXPECT_DOUBLE_EQ(s.mtp_loss_scale, 0.15);
  EXPECT_EQ(s.is_moe, (std::vector<bool>{false, true, true, true}));
  EXPECT_EQ(s.num_moe_layers(), 3);  // as Megatron's MoE metrics count them
  EXPECT_EQ(s.num_moe_loss_layers(), 3);
  ModelSpec repeated = s;  // one MTP layer built: training.py divides the MoE losses by 2
  repeated.mtp_repeated = true;
  EXPECT_EQ(repeated.num_moe_layers(), 3);  // (the FLOPs count each depth)
  EXPECT_EQ(repeated.num_moe_loss_layers(), 2);
  EXPECT_EQ(model_spec_from_config(resolved({"model.mtp_num_layers=1", "model.moe_layer_freq=[1,0]", "model.num_layers=2"})).is_moe,
            (std::vector<bool>{true, false, false}));
  EXPECT_NE(error_of([&] { model_spec_from_config(resolved({"model.mtp_num_layers=1", "model.window_size=[4,0]"})); })
                .find("sliding window"),
            std::string::npos);
  EXPECT_NE(error_of([&] { resolved({"model.mtp_loss_scaling_factor=-1.0"}); }).find("model.mtp_loss_scaling_factor=-1.0 is out of range"),
            std::string::npos);
}

TEST(JobSpec, PipelineSplitAndItsRefusals) {
  const std::vector<std::string> pp2{"model.num_layers=4", "model.pipeline_model_parallel_size=2", "target.num_gpus=4"};
  const JobSpec j = JobSpec::from_config(resolved(with(pp2, {"model.virtual_pipeline_model_parallel_size=2"})), 4);
  EXPECT_EQ(j.layout.pp, 2);
  EXPECT_TRUE(j.pipeline.interleaved);
  EXPECT_EQ(j.pipeline.layers[1][0].first, 1);  // stage 1's first chunk: virtual stage 1
  // PP without VPP refuses EP overlap at run time too, citing the check rule.
  EXPECT_NE(error_of([&] {
              pipeline_spec_from_config(resolved(with(pp2, {"comm_overlap.overlap_moe_expert_parallel_comm=true"})));
            }).find("[ep_overlap.pp_needs_vpp]"),
            std::string::npos);
  // Tied embeddings and MTP run over stages (the last keeps a copy of the embedding); the MTP
  // layers in the loss's chunk, or in a standalone MTP stage: another rank's last chunk, or the
  // first stage's only one (which holds the embedding), not a later chunk of the first stage.
  EXPECT_EQ(error_of([&] {
              pipeline_spec_from_config(resolved(with(pp2, {"model.share_embeddings_and_output_weights=true", "model.mtp_num_layers=1"})));
            }),
            "");
  EXPECT_EQ(pipeline_spec_from_config(resolved(with(pp2, {"model.mtp_num_layers=1"}))).mtp_stage, 1);
  EXPECT_EQ(pipeline_spec_from_config(resolved(with(pp2, {"model.mtp_num_layers=1", "model.pipeline_model_parallel_layout=Ettttm|L"})))
                .mtp_stage,
            0);
  const PipelineSpec standalone = pipeline_spec_from_config(resolved(
      {"model.num_layers=4", "model.pipeline_model_parallel_size=4", "model.mtp_num_layers=1",
       "model.pipeline_model_parallel_layout=E|t|t|t|t|m||L"}));
  EXPECT_EQ(standalone.mtp_stage, 5);
  EXPECT_EQ(standalone.describe(), "PP 4 x VPP 2: stage 0 [0,0) [3,4), stage 1 [0,1) [4,4)+MTP, stage 2 [1,2) [4,4), stage 3 [2,3) [4,4)");
  EXPECT_TRUE(standalone.carries_mtp(6) && !standalone.carries_mtp(4));
  EXPECT_NE(error_of([&] {
              pipeline_spec_from_config(resolved(with(pp2, {"model.mtp_num_layers=1", "model.pipeline_model_parallel_layout=E|t|tttm|||L"})));
            }).find("after every decoder layer (t), in the last model chunk of its pipeline rank"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              pipeline_spec_from_config(resolved(with(pp2, {"model.mtp_num_layers=1", "model.pipeline_model_parallel_layout=Et|tm|t|tL"})));
            }).find("(check rule pipeline.layout)"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              pipeline_spec_from_config(resolved(with(pp2, {"model.mtp_num_layers=1", "model.pipeline_model_parallel_layout=Et|ttt|m|L"})));
            }).find("[pipeline.mtp_first_rank_chunk]"),
            std::string::npos);
  // VPP without PP: refused, citing the check rule (and epx layer refuses PP).
  EXPECT_NE(error_of([&] { pipeline_spec_from_config(resolved({"model.virtual_pipeline_model_parallel_size=2"})); })
                .find("[parallel.vpp_needs_pp]"),
            std::string::npos);
  EXPECT_NE(error_of([&] { layer_layout_from_config(resolved(pp2), 4); }).find("model.pipeline_model_parallel_size=2"),
            std::string::npos);
  // The interleaved schedule's micro-batches: 2 / (1 x DP 2) = 1 per rank, fewer than PP.
  EXPECT_NE(error_of([&] {
              JobSpec::from_config(resolved(with(pp2, {"model.virtual_pipeline_model_parallel_size=2", "train.global_batch_size=2"})),
                                   4);
            }).find("train.global_batch_size=2: The number of contiguous micro-batches in a virtual pipeline stage "
                    "should range in [PP=2 , M=1]"),
            std::string::npos);
}

}  // namespace
}  // namespace epx
