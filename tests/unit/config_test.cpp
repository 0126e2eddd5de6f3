// Config tree: defaults, YAML load/dump, overrides, harness flags, Bridge dumps.
#include <gtest/gtest.h>

#include <functional>
#include <set>

#include "epx/check/check.hpp"
#include "epx/config/config.hpp"
#include "epx/config/schema.hpp"
#include "test_support.hpp"

namespace epx {
namespace {

using test::load_with;
using test::recipe_path;

using test::error_of;

TEST(ConfigDefaults, MatchMegatron) {
  const Config c;
  EXPECT_EQ(c.model.moe_router_topk, 2);
  EXPECT_EQ(c.model.moe_token_dispatcher_type, "allgather");
  EXPECT_EQ(c.model.moe_flex_dispatcher_backend, "deepep");
  EXPECT_EQ(c.model.cuda_graph_impl, "none");
  EXPECT_TRUE(c.model.batch_p2p_comm);
  EXPECT_FALSE(c.model.overlap_p2p_comm);
  EXPECT_TRUE(c.model.add_bias_linear);
  EXPECT_EQ(c.model.moe_hybridep_num_sms_preprocessing, 108);
  EXPECT_FALSE(c.comm_overlap.has_value());
  EXPECT_EQ(c.model.moe_layer_freq.every, 1);
  EXPECT_FALSE(c.model.expert_tensor_parallel_size.has_value());
}

TEST(ConfigSchema, EveryKeyIsUniqueAndFindable) {
  std::set<std::string> keys;
  for (const auto& f : schema()) {
    EXPECT_TRUE(keys.insert(f.key()).second) << f.key();
    EXPECT_EQ(find_field(f.key()), &f);
  }
  for (const auto& [alias, canonical] : field_aliases())
    EXPECT_EQ(find_field(alias), find_field(canonical)) << alias;
}

TEST(ConfigRecipes, ShippedRecipesLoadAndRoundTrip) {
  const auto names = list_recipes();
  ASSERT_GE(names.size(), 5u);
  for (const auto& name : names) {
    SCOPED_TRACE(name);
    const Config loaded = load_config_file(resolve_recipe(name));
    const Config resolved = resolve_config(loaded, std::nullopt);
    const std::string dumped = dump_yaml(resolved);
    const Config reloaded = load_config_text(dumped, "dump");
    EXPECT_EQ(dump_yaml(reloaded), dumped);
    // Finalize is idempotent: resolving the dump changes nothing.
    EXPECT_EQ(dump_yaml(resolve_config(reloaded, std::nullopt)), dumped);
  }
  // A string that YAML 1.1 would read as another integer is written quoted, and reads back so.
  Config c = load_with("qwen3_30b_a3b_proxy", {"+env_vars.B=010", "+env_vars.C=0x10"});
  const Config reloaded = load_config_text(dump_yaml(c), "dump");
  EXPECT_EQ(reloaded.env_vars.at("B"), "010");
  EXPECT_EQ(reloaded.env_vars.at("C"), "0x10");
  // A field of a recipe's name has nowhere to go.
  apply_override(c, "mixed_precision=bf16_mixed");
  EXPECT_NE(error_of([&] { apply_override(c, "+mixed_precision.fp8=hybrid"); }).find("is the recipe name 'bf16_mixed'"),
            std::string::npos);
}

TEST(ConfigRecipes, RealShapes) {
  const Config q = load_config_file(resolve_recipe("qwen3_30b_a3b"));
  EXPECT_EQ(q.model.hidden_size, 2048);
  EXPECT_EQ(q.model.num_moe_experts, 128);
  EXPECT_EQ(q.model.moe_router_topk, 8);
  EXPECT_EQ(q.model.moe_ffn_hidden_size, 768);
  EXPECT_EQ(q.model.expert_model_parallel_size, 16);
  EXPECT_EQ(q.target.num_gpus, 16);
  const Config d = load_config_file(resolve_recipe("deepseek_v3"));
  ASSERT_EQ(d.model.moe_layer_freq.pattern.size(), 61u);
  EXPECT_EQ(d.model.moe_layer_freq.pattern[2], 0);
  EXPECT_EQ(d.model.moe_layer_freq.pattern[3], 1);
  EXPECT_EQ(d.model.num_moe_experts, 256);
}

TEST(ConfigOverrides, ALayerPatternIsExpandedWithinTheListBound) {
  // A few bytes of pattern must not ask for gigabytes: past 20,000 layers it is refused, named.
  Config c = load_config_file(resolve_recipe("qwen3_30b_a3b"));
  apply_override(c, "model.moe_layer_freq=([0]*1+[1]*47)");
  ASSERT_EQ(c.model.moe_layer_freq.pattern.size(), 48u);
  EXPECT_EQ(c.model.moe_layer_freq.pattern[0], 0);
  for (const char* big : {"model.moe_layer_freq=([0]*1000000000)", "model.moe_layer_freq=([0]*1+[1]*20000)",
                          "model.moe_layer_freq=([0,1]*9223372036854775807)"}) {
    const std::string e = error_of([&] { apply_override(c, big); });
    EXPECT_NE(e.find("model.moe_layer_freq: the pattern expands to more than 20000 layers"), std::string::npos) << e;
  }
}

TEST(ConfigRecipes, MissingRecipeNamesTheShippedOnes) {
  const std::string e = error_of([] { resolve_recipe("qwen9"); });
  EXPECT_NE(e.find("no recipe named 'qwen9'"), std::string::npos) << e;
  EXPECT_NE(e.find("qwen3_30b_a3b"), std::string::npos) << e;
}

TEST(ConfigOverrides, TypesAndNulls) {
  Config c;
  apply_override(c, "model.moe_router_topk=4");
  apply_override(c, "model.bf16=yes");
  apply_override(c, "model.num_moe_experts=64");
  apply_override(c, "model.moe_expert_capacity_factor=1.25");
  apply_override(c, "model.recompute_modules=[moe_act,layernorm]");
  apply_override(c, "model.cuda_graph_scope=attn,moe_router");
  EXPECT_EQ(c.model.moe_router_topk, 4);
  EXPECT_TRUE(c.model.bf16);
  EXPECT_EQ(c.model.num_moe_experts, 64);
  EXPECT_DOUBLE_EQ(*c.model.moe_expert_capacity_factor, 1.25);
  EXPECT_EQ(*c.model.recompute_modules, (StringList{"moe_act", "layernorm"}));
  EXPECT_EQ(c.model.cuda_graph_scope, (StringList{"attn", "moe_router"}));
  apply_override(c, "model.num_moe_experts=None");
  EXPECT_FALSE(c.model.num_moe_experts.has_value());
  apply_override(c, "model.moe_expert_capacity_factor=null");
  EXPECT_FALSE(c.model.moe_expert_capacity_factor.has_value());
  apply_override(c, "model.moe_router_load_balancing_type=none");  // a value, not null
  EXPECT_TRUE(c.model.moe_router_load_balancing_type.is("none"));
  // Megatron's Union[str, List[str]]: a list is kept as one, and a list of one is no string.
  apply_override(c, "model.moe_router_load_balancing_type=[aux_loss,global_aux_loss]");
  apply_override(c, "model.moe_aux_loss_coeff=[1e-3, 1e-4]");
  EXPECT_EQ(c.model.moe_router_load_balancing_type.values, (StringList{"aux_loss", "global_aux_loss"}));
  EXPECT_DOUBLE_EQ(aux_loss_coeff(c.model, "global_aux_loss"), 1e-4);
  EXPECT_DOUBLE_EQ(aux_loss_coeff(c.model, "seq_aux_loss"), 0.0);
  apply_override(c, "model.moe_router_load_balancing_type=[sinkhorn]");
  EXPECT_TRUE(c.model.moe_router_load_balancing_type.is_list);
  EXPECT_FALSE(c.model.moe_router_load_balancing_type.is("sinkhorn"));
  apply_override(c, "model.moe_router_load_balancing_type=aux_loss,seq_aux_loss");  // one name, as Megatron reads it
  EXPECT_TRUE(c.model.moe_router_load_balancing_type.is("aux_loss,seq_aux_loss"));
  EXPECT_NE(error_of([&] { apply_override(c, "model.moe_aux_loss_coeff=[]"); }).find("moe_aux_loss_coeff is an empty list"),
            std::string::npos);
  EXPECT_NE(error_of([&] { apply_override(c, "model.moe_aux_loss_coeff=[0.1,x]"); }).find("expects a finite number"),
            std::string::npos);
  apply_override(c, "model.moe_layer_freq=([0]*1+[1]*3)");
  EXPECT_EQ(c.model.moe_layer_freq.pattern, (std::vector<Int>{0, 1, 1, 1}));
}

TEST(ConfigOverrides, AddDeleteAndAliases) {
  Config c;
  apply_override(c, "model.moe_router_topk=4");
  apply_override(c, "~model.moe_router_topk");
  EXPECT_EQ(c.model.moe_router_topk, 2);
  EXPECT_EQ(c.explicit_keys.count("model.moe_router_topk"), 0u);

  apply_override(c, "comm_overlap.overlap_moe_expert_parallel_comm=true");
  ASSERT_TRUE(c.comm_overlap.has_value());
  EXPECT_EQ(c.comm_overlap->overlap_moe_expert_parallel_comm, true);
  apply_override(c, "~comm_overlap");
  EXPECT_FALSE(c.comm_overlap.has_value());
  apply_override(c, "+comm_overlap.delay_wgrad_compute=true");
  apply_override(c, "comm_overlap=null");
  EXPECT_FALSE(c.comm_overlap.has_value());
  apply_override(c, "+comm_overlap.delay_wgrad_compute=true");
  apply_override(c, "comm_overlap=None");  // Bridge's (Python's) spelling
  EXPECT_FALSE(c.comm_overlap.has_value());
  // + adds a key (Hydra): a scalar on a field that holds a value is refused, as Bridge refuses it;
  // on a None field, or a list, it sets it; ++ sets it either way.
  EXPECT_NE(error_of([&] { apply_override(c, "+model.num_layers=3"); }).find("Could not append"), std::string::npos);
  apply_override(c, "++model.num_layers=3");
  EXPECT_EQ(c.model.num_layers, 3);
  apply_override(c, "+model.recompute_granularity=selective");  // None before
  EXPECT_EQ(c.model.recompute_granularity, std::optional<std::string>("selective"));
  apply_override(c, "+model.moe_layer_freq=[1,0]");  // a list
  EXPECT_EQ(c.model.moe_layer_freq.pattern.size(), 2u);

  EXPECT_NE(error_of([&] { apply_override(c, "env_vars.FOO=1"); }).find("+env_vars.FOO=1"),
            std::string::npos);
  apply_override(c, "+env_vars.FOO=1");
  EXPECT_EQ(c.env_vars.at("FOO"), "1");
  // A Bridge group the config lacks: `+` starts it (kept, not modelled); without `+` it is named.
  EXPECT_NE(error_of([&] { apply_override(c, "dataset.num_workers=4"); }).find("+dataset.KEY=VALUE"),
            std::string::npos);
  apply_override(c, "+dataset.num_workers=4");
  EXPECT_EQ(c.extra_sections.node["dataset"]["num_workers"].as<int>(), 4);
  apply_override(c, "env_vars.FOO=2");
  EXPECT_EQ(c.env_vars.at("FOO"), "2");
  apply_override(c, "~env_vars.FOO");
  EXPECT_EQ(c.env_vars.count("FOO"), 0u);
  EXPECT_NE(error_of([&] { apply_override(c, "~env_vars.FOO"); }).find("not set"),
            std::string::npos);

  apply_override(c, "train.seed=7");
  apply_override(c, "train.seq_length=512");
  apply_override(c, "train.lr=0.001");
  EXPECT_EQ(c.rng.seed, 7);
  EXPECT_EQ(c.model.seq_length, 512);
  EXPECT_DOUBLE_EQ(*c.optimizer.lr, 0.001);
}

TEST(ConfigOverrides, ClearErrors) {
  Config c;
  EXPECT_EQ(error_of([&] { apply_override(c, "model.moe_router_topk=abc"); }),
            "model.moe_router_topk expects an integer, got abc");
  EXPECT_EQ(error_of([&] { apply_override(c, "model.bf16=maybe"); }),
            "model.bf16 expects a bool (true|false), got maybe");
  EXPECT_EQ(error_of([&] { apply_override(c, "model.moe_router_topk=null"); }),
            "model.moe_router_topk expects an integer, got null");
  EXPECT_NE(error_of([&] { apply_override(c, "model.moe_token_dispatcher_type=deepep"); })
                .find("must be one of allgather|alltoall|flex, got 'deepep'"),
            std::string::npos);
  const std::string unknown = error_of([&] { apply_override(c, "model.moe_topk=4"); });
  EXPECT_NE(unknown.find("unknown key 'model.moe_topk'"), std::string::npos) << unknown;
  EXPECT_NE(unknown.find("did you mean model.moe_router_topk"), std::string::npos) << unknown;
  const std::string wrong_section = error_of([&] { apply_override(c, "train.num_moe_experts=8"); });
  EXPECT_NE(wrong_section.find("model.num_moe_experts"), std::string::npos) << wrong_section;
  EXPECT_NE(error_of([&] { apply_override(c, "dir/b.yaml"); }).find("is a file, not an override"), std::string::npos);
  EXPECT_NE(error_of([&] { apply_override(c, "model.bf16"); }).find("has no value"),
            std::string::npos);
  EXPECT_NE(error_of([&] { apply_override(c, "=3"); }).find("expected key=value"),
            std::string::npos);
  EXPECT_NE(error_of([&] { apply_override(c, "model.moe_layer_freq=([2]*3)"); })
                .find("must be 0 or 1"),
            std::string::npos);
}

TEST(ConfigYaml, ErrorsNameFileLineAndKey) {
  EXPECT_EQ(error_of([] { load_config_text("model:\n  num_layers: [1, 2\n", "bad.yaml"); })
                .rfind("bad.yaml:", 0),
            0u);
  EXPECT_EQ(error_of([] { load_config_text("model:\n  num_layers: 2\n  hidden_size: big\n", "f.yaml"); }),
            "f.yaml:3:16: model.hidden_size expects an integer, got big");
  // An empty value is cited at its key, not at the next line's.
  EXPECT_EQ(error_of([] { load_config_text("model:\n  hidden_size:\n  num_layers: 2\n", "f.yaml"); }),
            "f.yaml:2:3: model.hidden_size expects an integer, got null");
  const std::string unknown =
      error_of([] { load_config_text("model:\n  num_layer: 2\n", "f.yaml"); });
  EXPECT_NE(unknown.find("f.yaml:2:3: unknown key 'model.num_layer'"), std::string::npos)
      << unknown;
  EXPECT_NE(unknown.find("did you mean model.num_layers"), std::string::npos) << unknown;
  const std::string section = error_of([] { load_config_text("modle:\n  x: 1\n", "f.yaml"); });
  EXPECT_NE(section.find("unknown section 'modle'"), std::string::npos) << section;
  EXPECT_NE(section.find("did you mean model"), std::string::npos) << section;
  EXPECT_NE(error_of([] { load_config_text("- 1\n- 2\n", "f.yaml"); }).find("mapping of sections"),
            std::string::npos);
  EXPECT_NE(error_of([] { load_config_file("/nonexistent/x.yaml"); }).find("cannot open"),
            std::string::npos);
  EXPECT_NE(error_of([] { load_config_text("", "e.yaml"); }).find("e.yaml: the file is empty"),
            std::string::npos);
  EXPECT_EQ(error_of([] { load_config_text("? [a, b]\n: 1\n", "k.yaml"); }).rfind("k.yaml:1:", 0),
            0u);
  // A key given twice (yaml-cpp keeps both; the last would win silently), a section too.
  EXPECT_EQ(error_of([] { load_config_text("model:\n  num_layers: 2\n  num_layers: 3\n", "d.yaml"); })
                .rfind("d.yaml:3:3: duplicate key 'num_layers' (also at line 2)", 0),
            0u);
  EXPECT_NE(error_of([] { load_config_text("model: {}\ntrain: {}\nmodel: {}\n", "d.yaml"); }).find("duplicate key 'model'"),
            std::string::npos);
}

TEST(ConfigYaml, IntegersReadAsPyYamlReadsThem) {
  // OmegaConf reads Bridge's files with PyYAML (YAML 1.1): 010 is octal, 0x hex, 0b binary, '_'
  // between digits, ':' base 60; quoted, a string (which an integer field reads as int() does).
  const Config c = load_config_text(
      "model:\n  num_layers: 010\n  hidden_size: 0x100\n  num_moe_experts: 0b1000\n  seq_length: 1_024\n"
      "  moe_router_topk: \"02\"\n  num_attention_heads: 1:04\n  ffn_hidden_size: 09\n"
      "train:\n  train_iters: +0_5\n",
      "y.yaml");
  EXPECT_EQ(c.model.num_layers, 8);
  EXPECT_EQ(c.model.hidden_size, 256);
  EXPECT_EQ(c.model.num_moe_experts, 8);
  EXPECT_EQ(c.model.seq_length, 1024);
  EXPECT_EQ(c.model.moe_router_topk, 2);
  EXPECT_EQ(c.model.num_attention_heads, 64);
  EXPECT_EQ(c.model.ffn_hidden_size, 9);  // 09 is no YAML 1.1 integer: the string "09", then int("09")
  EXPECT_EQ(c.train.train_iters, 5);
  EXPECT_EQ(error_of([] { load_config_text("model:\n  num_layers: 0x8000000000000000\n", "big.yaml"); }),
            "big.yaml:2:15: model.num_layers expects an integer, got 0x8000000000000000");
}

TEST(ConfigYaml, MergeKeysReadAsPyYamlReadsThem) {
  // YAML 1.1's `<<` (OmegaConf reads it through PyYAML): the mapping's own keys win, then the
  // mappings listed, the first first; a merged mapping's own merge counts; values keep their place.
  const Config c = load_config_text(
      "_sizes: &sizes {num_layers: 4, hidden_size: 512}\n"
      "_more: &more {<<: *sizes, num_attention_heads: 8, hidden_size: 1024}\n"
      "model:\n  <<: [*more, {ffn_hidden_size: 64, num_attention_heads: 2}]\n  num_layers: 2\n",
      "m.yaml");
  EXPECT_EQ(c.model.num_layers, 2);
  EXPECT_EQ(c.model.hidden_size, 1024);
  EXPECT_EQ(c.model.num_attention_heads, 8);
  EXPECT_EQ(c.model.ffn_hidden_size, 64);
  EXPECT_EQ(error_of([] { load_config_text("_a: &a {seq_length: x}\nmodel:\n  <<: *a\n", "m.yaml"); }),
            "m.yaml:1:21: model.seq_length expects an integer, got x");
  EXPECT_EQ(error_of([] { load_config_text("_n: &n 3\nmodel:\n  <<: *n\n", "m.yaml"); })
                .rfind("m.yaml:3:3: the merge key '<<' takes a mapping or a list of mappings", 0),
            0u);
  EXPECT_EQ(load_config_text("model:\n  <<: []\n  num_layers: 3\n", "m.yaml").model.num_layers, 3);  // nothing merged
  // PyYAML's order: the merged entries, the last mapping listed first, then the own; each key
  // where it first appears, with its winning value (a kept section is dumped back as read).
  const std::string kept = dump_yaml(load_config_text(
      "_x: &x {b: 1, a: 2}\n_y: &y {d: 4, b: 6}\n_z:\n  <<: [*x, *y]\n  c: 3\n  a: 5\n", "m.yaml"));
  const std::size_t z = kept.find("_z:");
  ASSERT_NE(z, std::string::npos) << kept;
  EXPECT_EQ(kept.substr(z, kept.find("\n", kept.find("c: 3", z)) - z), "_z:\n  d: 4\n  b: 1\n  a: 5\n  c: 3") << kept;
  // Quoted, '<<' is a key like any other.
  EXPECT_EQ(error_of([] { load_config_text("model:\n  '<<': {num_layers: 2}\n", "m.yaml"); }).rfind("m.yaml:2:3: unknown key 'model.<<'", 0),
            0u);
}

// After Megatron-Core's post-init, a dump has the scope as None and the modules as enum members.
TEST(ConfigYaml, ReadsCudaGraphModulesAsABridgeDumpWritesThem) {
  const Config c = load_config_text(
      "model:\n  cuda_graph_scope: null\n  cuda_graph_modules:\n"
      "  - {_target_: megatron.core.transformer.enums.CudaGraphModule, _call_: true, _args_: [4], _name_: moe_router}\n"
      "  - {_target_: megatron.core.transformer.enums.CudaGraphModule, _call_: true, _args_: [5], _name_: moe_preprocess}\n",
      "post.yaml");
  EXPECT_TRUE(c.model.cuda_graph_scope.empty());
  EXPECT_EQ(c.model.cuda_graph_modules, (StringList{"moe_router", "moe_preprocess"}));
  // A Bridge recipe's torch dtype where Megatron takes 'fp32' keeps its name (the check warns).
  EXPECT_EQ(load_config_text("model:\n  moe_router_dtype: {_target_: torch.float32, _call_: false}\n", "d.yaml")
                .model.moe_router_dtype,
            "torch.float32");
}

// A dense dump's None top-k (Gemma4's provider) stays None: a dump writes it back, the check
// sees it, and `~` or a value clears it.
TEST(ConfigYaml, AnMoeOnlyNoneRoundTrips) {
  std::string text = read_config_text(std::string(EPX_TEST_DATA) + "/bridge_dump_qwen3_30b_a3b.yaml");
  const std::size_t at = text.find("moe_router_topk: 8");
  ASSERT_NE(at, std::string::npos);
  text.replace(at, 18, "moe_router_topk: null");
  const Config c = load_config_text(text, "d.yaml");
  EXPECT_EQ(c.none_moe_fields, StringList{"model.moe_router_topk"});
  EXPECT_EQ(c.model.moe_router_topk, 2);  // the default stands in
  EXPECT_EQ(field_text(c, "model.moe_router_topk"), "null");
  EXPECT_EQ(load_config_text(dump_yaml(c), "again.yaml").none_moe_fields, c.none_moe_fields);
  for (const char* clear : {"~model.moe_router_topk", "model.moe_router_topk=4"}) {
    Config set = c;
    apply_override(set, clear);
    EXPECT_TRUE(set.none_moe_fields.empty()) << clear;
    EXPECT_EQ(set.model.moe_router_topk, clear[0] == '~' ? 2 : 4);
  }
  Config none = load_config_text(dump_yaml(c), "again.yaml");
  apply_override(none, "model.moe_token_dispatcher_type=None");  // an override of the dump says None the same way
  EXPECT_EQ(none.none_moe_fields, (StringList{"model.moe_router_topk", "model.moe_token_dispatcher_type"}));
}

// A string that YAML 1.1 would read as a bool or a number is quoted in a dump, so Bridge reads a
// string back.
TEST(ConfigYaml, StringsThatLookLikeOtherTypesAreQuoted) {
  Config c;
  apply_override(c, "model.moe_router_load_balancing_type=[true,'42',aux_loss]");
  apply_override(c, "model.moe_router_dtype=off");
  const std::string text = dump_yaml(c);
  EXPECT_NE(text.find("moe_router_load_balancing_type: [\"true\", \"42\", aux_loss]"), std::string::npos) << text;
  EXPECT_NE(text.find("moe_router_dtype: \"off\""), std::string::npos) << text;
  EXPECT_EQ(load_config_text(text, "again.yaml").model.moe_router_load_balancing_type, c.model.moe_router_load_balancing_type);
}

TEST(ConfigYaml, BridgeDumpKeepsWhatItDoesNotModel) {
  const Config c = load_config_file(std::string(EPX_TEST_DATA) + "/bridge_dump_qwen3_30b_a3b.yaml");
  EXPECT_EQ(c.model.num_moe_experts, 128);
  EXPECT_EQ(c.model.expert_model_parallel_size, 16);
  EXPECT_EQ(c.model.cuda_graph_scope, (StringList{"moe_router", "moe_preprocess"}));
  ASSERT_TRUE(c.comm_overlap.has_value());
  EXPECT_EQ(c.comm_overlap->overlap_moe_expert_parallel_comm, true);
  EXPECT_EQ(c.train.global_batch_size, 1024);
  EXPECT_EQ(c.rng.seed, 1234);
  EXPECT_EQ(c.target.num_gpus, 16);  // DP 16 x TP 1 x PP 1 x CP 1 from the dump
  const std::string note = ignored_note(c);
  EXPECT_NE(note.find("sections dataset, logger"), std::string::npos) << note;
  EXPECT_NE(note.find("model.apply_rope_fusion"), std::string::npos) << note;
  EXPECT_EQ(note.find("_target_"), std::string::npos) << note;
  // Kept parts survive a dump and reload.
  const Config again = load_config_text(dump_yaml(c), "dump");
  EXPECT_EQ(dump_yaml(again), dump_yaml(c));
  EXPECT_EQ(ignored_note(again), note);
  // Kept sections take + additions and ~ deletions like Hydra.
  Config edited = c;
  apply_override(edited, "+dataset.num_workers=4");
  EXPECT_EQ(edited.extra_sections.node["dataset"]["num_workers"].as<int>(), 4);
  EXPECT_EQ(c.extra_sections.node["dataset"]["num_workers"].as<int>(), 8);  // copies are deep
  EXPECT_NE(error_of([&] { apply_override(edited, "dataset.nonexistent=1"); }).find("does not exist"),
            std::string::npos);
}

TEST(ConfigYaml, BridgeDumpsAsBridgeWritesThem) {
  // Fields a current ConfigContainer dump carries: the validation and optimizer-override groups,
  // train.eval_iters None, and the layout as the list of lists Bridge's DeepSeek recipes write.
  const std::string dump =
      "model:\n  _target_: megatron.bridge.models.deepseek.DeepSeekV3ModelProvider\n  num_layers: 3\n"
      "  pipeline_model_parallel_size: 2\n"
      "  pipeline_model_parallel_layout:\n  - [Embedding, decoder]\n  - [decoder, ' decoder ', loss]\n"
      "train:\n  _target_: megatron.bridge.training.config.TrainingConfig\n  eval_iters: null\n"
      "validation:\n  _target_: megatron.bridge.training.config.ValidationConfig\n  eval_iters: 32\n"
      "optimizer_config_override_provider:\n  _target_: megatron.bridge.training.config.OptimizerConfigOverrideProvider\n";
  const Config c = load_config_text(dump, "dump.yaml");
  EXPECT_EQ(c.model.pipeline_model_parallel_layout, "Et|ttL");
  EXPECT_EQ(c.train.eval_iters, std::nullopt);
  EXPECT_NE(ignored_note(c).find("validation"), std::string::npos) << ignored_note(c);
  const auto layout_error = [](const std::string& value) {
    return error_of([&] { load_config_text("model:\n  pipeline_model_parallel_layout: " + value + "\n", "l.yaml"); });
  };
  EXPECT_NE(layout_error("[[embedding], [encoder, loss]]").find("l.yaml:2:"), std::string::npos);
  EXPECT_NE(layout_error("[[embedding], [encoder, loss]]").find("encoder is not a layer epx builds"), std::string::npos)
      << layout_error("[[embedding], [encoder, loss]]");
  EXPECT_NE(layout_error("[embedding, loss]").find("must be a list of lists"), std::string::npos);
}

TEST(HarnessFlags, ShortcutsAndPrecedence) {
  Config c = load_with("qwen3_30b_a3b_proxy", {"model.expert_model_parallel_size=1"});
  HarnessFlags f;
  f.ep = 4;
  f.tp = 2;
  f.gb = 64;
  f.mb = 2;
  f.sl = 512;
  f.max_steps = 8;
  f.num_gpus = 8;
  f.gpu = "h100";
  f.gpus_per_node = 4;
  f.vp = "-1";  // keep
  apply_harness_flags(c, f);
  EXPECT_EQ(c.model.expert_model_parallel_size, 4);  // flag wins over the dotted override
  EXPECT_EQ(c.model.tensor_model_parallel_size, 2);
  EXPECT_EQ(c.train.global_batch_size, 64);
  EXPECT_EQ(c.train.micro_batch_size, 2);
  EXPECT_EQ(c.model.seq_length, 512);
  EXPECT_EQ(c.train.train_iters, 8);
  EXPECT_EQ(c.target.gpu, "h100");
  EXPECT_EQ(c.target.num_gpus, 8);
  EXPECT_EQ(c.target.gpus_per_node, 4);
  // -vp N sets VPP; -vp None unsets it (the harness reads "None" so).
  f.vp = "2";
  apply_harness_flags(c, f);
  EXPECT_EQ(c.model.virtual_pipeline_model_parallel_size, 2);
  f.vp = "None";
  apply_harness_flags(c, f);
  EXPECT_EQ(c.model.virtual_pipeline_model_parallel_size, std::nullopt);
  EXPECT_FALSE(c.model.virtual_pipeline_model_parallel_size.has_value());
}

TEST(HarnessFlags, MoeA2aOverlap) {
  Config c = load_with("qwen3_30b_a3b_proxy", {"~comm_overlap", "model.moe_shared_expert_overlap=true"});
  HarnessFlags off;
  off.moe_a2a_overlap = false;
  apply_harness_flags(c, off);  // false changes nothing
  EXPECT_FALSE(c.comm_overlap.has_value());
  EXPECT_TRUE(c.model.moe_shared_expert_overlap);
  HarnessFlags on;
  on.moe_a2a_overlap = true;
  apply_harness_flags(c, on);
  ASSERT_TRUE(c.comm_overlap.has_value());
  EXPECT_FALSE(c.comm_overlap->tp_comm_overlap);  // TP = 1
  EXPECT_EQ(c.comm_overlap->overlap_moe_expert_parallel_comm, true);
  EXPECT_EQ(c.comm_overlap->delay_wgrad_compute, true);
  EXPECT_FALSE(c.model.moe_shared_expert_overlap);

  Config tp2 = load_with("qwen3_30b_a3b_proxy", {"~comm_overlap", "model.tensor_model_parallel_size=2"});
  apply_harness_flags(tp2, on);
  EXPECT_TRUE(tp2.comm_overlap->tp_comm_overlap);
}

TEST(HarnessFlags, ConflictingRecomputeFlags) {
  Config c = load_with("qwen3_30b_a3b_proxy", {});
  HarnessFlags f;
  f.recompute_num_layers = 1;
  f.recompute_modules = "mlp";
  EXPECT_NE(error_of([&] { apply_harness_flags(c, f); }).find("conflict"), std::string::npos);
}

TEST(HarnessFlags, CudaGraphImplBringsTheTeRngTracker) {  // _set_cuda_graph_overrides
  Config c = load_with("qwen3_30b_a3b_proxy", {});
  HarnessFlags f;
  f.cuda_graph_impl = "transformer_engine";
  apply_harness_flags(c, f);
  EXPECT_TRUE(c.model.use_te_rng_tracker);
  EXPECT_TRUE(c.rng.te_rng_tracker);
  f.cuda_graph_impl = "none";
  apply_harness_flags(c, f);
  EXPECT_FALSE(c.model.use_te_rng_tracker);
  EXPECT_FALSE(c.rng.te_rng_tracker);
}

TEST(HarnessFlags, FlexBackendNoneSelectsAlltoall) {
  Config c = load_with("qwen3_30b_a3b", {});
  HarnessFlags f;
  f.moe_flex_dispatcher_backend = "None";
  apply_harness_flags(c, f);
  EXPECT_EQ(c.model.moe_token_dispatcher_type, "alltoall");
  EXPECT_FALSE(c.model.moe_flex_dispatcher_backend.has_value());
}

}  // namespace
}  // namespace epx

namespace epx {
namespace {

// A hostile or broken file is refused quickly with a message naming it, never parsed for long.
TEST(ConfigYaml, BoundsTheWorkABadFileCanCause) {
  const std::string deep = "model: " + std::string(100, '[') + std::string(100, ']') + "\n";
  EXPECT_NE(error_of([&] { load_config_text(deep, "deep.yaml"); }).find("deep.yaml:1:"),
            std::string::npos);
  std::string laughs = "dataset:\n  a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n";
  for (int i = 1; i < 9; ++i) {
    laughs += "  a" + std::to_string(i) + ": &a" + std::to_string(i) + " [";
    for (int k = 0; k < 10; ++k) laughs += (k ? ", *a" : "*a") + std::to_string(i - 1);
    laughs += "]\n";
  }
  EXPECT_NE(error_of([&] { load_config_text(laughs, "laughs.yaml"); })
                .find("aliases counted as the copies they make"),
            std::string::npos);
  const std::string big = "dataset:\n  blob: '" + std::string(3 << 20, 'x') + "'\n";
  EXPECT_EQ(error_of([&] { load_config_text(big, "big.yaml"); })
                .rfind("big.yaml: more than the 2 MiB a YAML input", 0),
            0u);
  EXPECT_EQ(error_of([&] { load_config_text("model:\n  ? [a, b]\n  : 1\n", "key.yaml"); })
                .rfind("key.yaml:2:5: a key that is a list or mapping", 0),
            0u);
  EXPECT_EQ(load_config_text("model:\n  num_layers: 2\n---\n", "trailing.yaml").model.num_layers, 2);  // nothing after it
  // A second document is refused, not dropped.
  EXPECT_EQ(error_of([&] { load_config_text("model:\n  num_layers: 2\n---\nmodel:\n  num_layers: 3\n", "two.yaml"); })
                .rfind("two.yaml:4: a second YAML document", 0),
            0u);
  Config c;
  EXPECT_NE(error_of([&] { apply_override(c, "model.num_layers=" + std::string(100000, '1')); })
                .find("at most 64 KiB"),
            std::string::npos);
  // A key far longer than any field gets no suggestions (edit distances would cost seconds).
  EXPECT_NE(error_of([&] { apply_override(c, std::string(20000, 'k') + "=1"); })
                .find("unknown key"),
            std::string::npos);
}

}  // namespace
}  // namespace epx
