// The layout's rules: the world, TP / CP / PP / EP and their groups, the pipeline split, the
// batch, the training length and the scheduler.
#include "rule_helpers.hpp"

namespace epx::rule_helpers {

void add_layout_rules(RuleTable& add) {
  add("parallel.world_divisible", E,
      {"target.num_gpus", "model.tensor_model_parallel_size", "model.pipeline_model_parallel_size",
       "model.context_parallel_size"},
      kBridgeConfig, "world size divisible by TP*PP*CP (data-parallel size)",
      [](const CheckContext& c) {
        if (!c.world()) return world_not_given(c);
        const auto& m = c.cfg.model;
        const Int mp = m.tensor_model_parallel_size * m.pipeline_model_parallel_size *
                       m.context_parallel_size;
        return fail_if(data_parallel_size(c.cfg) == 0,
                       fmt::format("world size {} is not divisible by TP*PP*CP = {}", *c.world(),
                                   mp),
                       world_fix(c.cfg, *c.world()));
      });
  add("parallel.expert_world_divisible", E,
      {"target.num_gpus", "model.expert_tensor_parallel_size", "model.expert_model_parallel_size",
       "model.pipeline_model_parallel_size"},
      kMcore, "world size divisible by ETP*EP*PP (expert data-parallel size)",
      [](const CheckContext& c) {
        if (!c.world()) return world_not_given(c);
        const auto& m = c.cfg.model;
        const Int emp = effective_etp(m) * m.expert_model_parallel_size *
                        m.pipeline_model_parallel_size;
        return fail_if(emp <= 0 || *c.world() % emp != 0,
                       fmt::format("world size {} is not divisible by ETP*EP*PP = {}: the expert "
                                   "side cannot be folded onto the ranks",
                                   *c.world(), emp),
                       world_fix(c.cfg, *c.world()));
      });
  add("parallel.ep_needs_experts", E,
      {"model.expert_model_parallel_size", "model.num_moe_experts"}, kMcore,
      "expert parallelism needs an MoE model", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        return fail_if(m.expert_model_parallel_size > 1 && !m.num_moe_experts,
                       "num_moe_experts must be non None to use expert-parallel.",
                       "model.expert_model_parallel_size=1");
      });
  // The harness asks Slurm (or Kubeflow) for -(num_gpus // -gpus_per_node) nodes of
  // gpus_per_node tasks each (setup_experiment.py, utils/executors.py): a world that does not
  // fill its nodes runs on more ranks than -ng says. On cpu a world within one node is one
  // machine's ranks; over several, the emulated cluster's nodes are whole too.
  add("target.world_fills_nodes", W, {"target.num_gpus", "target.gpus_per_node", "target.gpu"},
      "Megatron-Bridge scripts/performance/setup_experiment.py", "the world is whole nodes, as the harness launches it", [](const CheckContext& c) {
        const OptInt gpn = gpus_per_node(c.cfg);
        if (!c.world() || !gpn || *gpn < 1 || *c.world() % *gpn == 0) return pass();
        const Int world = *c.world(), nodes = (world + *gpn - 1) / *gpn;
        Int fits = *gpn;  // the most GPUs per node that the world fills
        while (world % fits != 0) --fits;
        const std::string fix = fmt::format("target.gpus_per_node={}", fits);
        if (!c.gpu.cuda())  // one machine's ranks, or the emulated cluster's nodes of --ranks-per-node
          return fail_if(world > *gpn,
                         fmt::format("num_gpus {} over nodes of {}: the plan's last node holds {} rank(s), which the "
                                     "emulated cluster (epx launch --cluster, --nodes x --ranks-per-node) cannot run",
                                     world, *gpn, world - (nodes - 1) * *gpn),
                         fix);
        return fail(fmt::format("num_gpus {} is not a multiple of {} GPUs per node: the harness launches -(num_gpus // "
                                "-gpus_per_node) = {} node(s) of {} tasks, a world of {} ranks, not {}",
                                world, *gpn, nodes, *gpn, nodes * *gpn, world),
                    fix);
      });
  add("parallel.experts_divisible_by_ep", E,
      {"model.num_moe_experts", "model.expert_model_parallel_size"}, kMcore,
      "experts split evenly over EP ranks", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (!m.num_moe_experts || m.expert_model_parallel_size <= 0) return pass();
        const Int experts = *m.num_moe_experts, ep = m.expert_model_parallel_size;
        if (experts % ep == 0) return pass();
        Int nearest = 1;  // the divisor of the expert count nearest EP, the larger on a tie
        for (Int d = 1; d <= experts && d <= 2 * ep; ++d)
          if (experts % d == 0 && std::abs(d - ep) <= std::abs(nearest - ep)) nearest = d;
        return fail(fmt::format("num_moe_experts ({}) must be divisible by expert_model_parallel_size ({})", experts, ep),
                    fmt::format("model.expert_model_parallel_size={}", nearest));
      });
  // Megatron-Core's divide() (core/utils.py) asserts each linear's split: the experts' fc2 takes
  // moe_ffn_hidden_size / ETP inputs, a dense or shared-expert MLP's ffn / TP. The fix keeps the
  // split a divisor of the one set, so the world still divides.
  add("parallel.ffn_divisible", E,
      {"model.moe_ffn_hidden_size", "model.expert_tensor_parallel_size", "model.ffn_hidden_size",
       "model.moe_shared_expert_intermediate_size", "model.tensor_model_parallel_size", "model.num_moe_experts",
       "model.moe_layer_freq"},
      kMcore, "each MLP's hidden size splits evenly over its TP ranks (the experts' over ETP)", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        const Int tp = m.tensor_model_parallel_size, etp = effective_etp(m);
        const auto refuse = [&](const char* size, Int n, const char* split, Int ranks) {
          const Int fits = std::gcd(n, ranks);
          return fail(fmt::format("{} is not divisible by {}: {} over {}", n, ranks, size, split),
                      fmt::format("model.{}={}{}", split, fits,
                                  std::string(split) == "tensor_model_parallel_size" && fits == 1 && m.sequence_parallel
                                      ? " model.sequence_parallel=false"
                                      : ""));
        };
        if (m.num_moe_experts && m.moe_ffn_hidden_size && etp > 0 && *m.moe_ffn_hidden_size % etp != 0)
          return refuse("moe_ffn_hidden_size", *m.moe_ffn_hidden_size, "expert_tensor_parallel_size", etp);
        if (tp <= 0) return pass();
        if (m.num_moe_experts && m.moe_shared_expert_intermediate_size && *m.moe_shared_expert_intermediate_size % tp != 0)
          return refuse("moe_shared_expert_intermediate_size", *m.moe_shared_expert_intermediate_size,
                        "tensor_model_parallel_size", tp);
        const bool dense = !m.num_moe_experts || m.moe_layer_freq.has_dense();
        if (dense && m.ffn_hidden_size && *m.ffn_hidden_size % tp != 0)
          return refuse("ffn_hidden_size", *m.ffn_hidden_size, "tensor_model_parallel_size", tp);
        return pass();
      });
  add("parallel.heads_divisible_by_tp", E,
      {"model.num_attention_heads", "model.num_query_groups", "model.tensor_model_parallel_size"},
      kMcore, "attention heads split evenly over TP ranks, query groups too or each replicated over TP ranks",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        const Int tp = m.tensor_model_parallel_size;
        if (tp <= 0 || m.num_attention_heads == 0) return pass();
        // TP 1 also takes sequence parallelism off (parallel.sp_needs_tp).
        const std::string no_tp = m.sequence_parallel
                                      ? "model.tensor_model_parallel_size=1 model.sequence_parallel=false"
                                      : "model.tensor_model_parallel_size=1";
        if (m.num_attention_heads % tp != 0)
          return fail(fmt::format("num_attention_heads ({}) must be a multiple of "
                                  "tensor_model_parallel_size ({}).",
                                  m.num_attention_heads, tp),
                      no_tp);
        // Fewer groups than TP ranks: Megatron-Core (since December 2025) sub-shards each one.
        const Int groups = m.num_query_groups.value_or(m.num_attention_heads);
        return fail_if(groups % tp != 0 && tp % groups != 0,
                       fmt::format("num_query_groups ({}) must be a multiple or divisor of "
                                   "tensor_model_parallel_size ({}).",
                                   groups, tp),
                       no_tp);
      });
  // Megatron-Core refuses it ("Cannot use sequence parallelism without tensor parallelism"), but
  // Bridge's model config turns it off first (models/transformer_config.py finalize).
  add("parallel.sp_needs_tp", W, {"model.sequence_parallel", "model.tensor_model_parallel_size"},
      kBridgeModel, "sequence parallelism without TP > 1 is turned off", [](const CheckContext& c) {
        return fail_if(c.user.model.sequence_parallel && c.cfg.model.tensor_model_parallel_size <= 1,
                       "sequence_parallel=true with tensor_model_parallel_size=1: Bridge turns it off (Megatron-Core "
                       "alone would refuse: Cannot use sequence parallelism without tensor parallelism)",
                       "model.sequence_parallel=false");
      });
  add("attention.query_groups_divide_heads", E, {"model.num_attention_heads", "model.num_query_groups"},
      kTeAttention, "each query group serves a whole number of attention heads",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (!m.num_query_groups || *m.num_query_groups <= 0 || m.num_attention_heads <= 0) return pass();
        // The nearest divisor of the heads below, that TP also splits or replicates.
        const Int tp = std::max<Int>(1, m.tensor_model_parallel_size);
        Int groups = std::min(*m.num_query_groups, m.num_attention_heads);
        while (groups > 1 && (m.num_attention_heads % groups != 0 || (groups % tp != 0 && tp % groups != 0))) --groups;
        return fail_if(m.num_attention_heads % *m.num_query_groups != 0,
                       "The number of attention heads must be divisible by the number of GQA groups!",
                       fmt::format("model.num_query_groups={}", groups));
      });
  add("pipeline.layout", E,
      {"model.pipeline_model_parallel_layout", "model.pipeline_model_parallel_size",
       "model.virtual_pipeline_model_parallel_size", "model.num_layers", "model.mtp_num_layers",
       "model.num_layers_in_first_pipeline_stage", "model.num_layers_in_last_pipeline_stage",
       "model.account_for_embedding_in_pipeline_split", "model.account_for_loss_in_pipeline_split"},
      kMcore, "a pipeline layout places the embedding first, the loss last, every layer once, in PP x VPP stages",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (!m.pipeline_model_parallel_layout) return pass();
        // No layout if the layers split without one, else the split fix's (a layout it generates).
        ModelConfig unlaid = m;
        unlaid.pipeline_model_parallel_layout.reset();
        std::vector<std::string> split_fix;
        if (!layers_split(unlaid)) split_fix = pipeline_split_fix(unlaid);
        if (split_fix.empty() || split_fix.front().find("pipeline_model_parallel_layout") == std::string::npos)
          split_fix.insert(split_fix.begin(), "model.pipeline_model_parallel_layout=null");
        const std::string fix = fmt::format("{}", fmt::join(split_fix, " "));
        const auto py = [](bool b) { return b ? "True" : "False"; };
        const auto py_int = [](const OptInt& v) { return v ? std::to_string(*v) : std::string("None"); };
        if (m.num_layers_in_first_pipeline_stage || m.num_layers_in_last_pipeline_stage ||
            m.account_for_embedding_in_pipeline_split || m.account_for_loss_in_pipeline_split)
          return fail(fmt::format("pipeline_model_parallel_layout cannot be set with other pipeline layout arguments. "
                                  "self.num_layers_in_first_pipeline_stage={}, self.num_layers_in_last_pipeline_stage={}, "
                                  "self.account_for_embedding_in_pipeline_split={}, "
                                  "self.account_for_loss_in_pipeline_split={}.",
                                  py_int(m.num_layers_in_first_pipeline_stage),
                                  py_int(m.num_layers_in_last_pipeline_stage),
                                  py(m.account_for_embedding_in_pipeline_split), py(m.account_for_loss_in_pipeline_split)),
                      "model.pipeline_model_parallel_layout=null");
        std::vector<std::string> stages;
        try {
          stages = parse_pipeline_layout(*m.pipeline_model_parallel_layout);
        } catch (const ConfigError& e) {
          return fail(e.what(), fix);
        }
        const Int pp = m.pipeline_model_parallel_size, count = static_cast<Int>(stages.size());
        if (count % pp != 0)
          return fail(fmt::format("pipeline_model_parallel_layout must be divisible by pipeline_model_parallel_size "
                                  "(len(layout)={}, pipeline_model_parallel_size={})",
                                  count, pp),
                      fix);
        if (m.virtual_pipeline_model_parallel_size && *m.virtual_pipeline_model_parallel_size != count / pp)
          return fail(fmt::format("virtual_pipeline_model_parallel_size conflicts with pipeline_model_parallel_layout, "
                                  "(self.virtual_pipeline_model_parallel_size={},  detected_vpp_size={})",
                                  *m.virtual_pipeline_model_parallel_size, count / pp),
                      count / pp > 1 ? fmt::format("model.virtual_pipeline_model_parallel_size={}", count / pp)
                                     : "model.virtual_pipeline_model_parallel_size=null");
        std::string layers;  // in layer order
        for (const std::string& stage : stages) layers += stage;
        const auto type = [](char ch) {
          return fmt::format("LayerType.{}", ch == 'E' ? "embedding" : ch == 'L' ? "loss" : ch == 't' ? "decoder" : "mtp");
        };
        if (layers.empty() || layers.front() != 'E')
          return fail(fmt::format("The first layer must be embedding, but got {}", layers.empty() ? "nothing" : type(layers.front())), fix);
        if (layers.back() != 'L') return fail(fmt::format("The last layer must be loss, but got {}", type(layers.back())), fix);
        const auto n = [&](char ch) { return static_cast<Int>(std::count(layers.begin(), layers.end(), ch)); };
        if (n('E') != 1) return fail("Embedding must be specified exactly once", fix);
        if (n('L') != 1) return fail("Loss must be specified exactly once", fix);
        if (n('t') != m.num_layers)
          return fail(fmt::format("Number of decoder layers {}must match num_layers {}", n('t'), m.num_layers), fix);
        // Where the layout's m sit, in Megatron's order of checks: after the decoder, then (virtual
        // stage v * PP + p is chunk v of rank p) only in a rank's last chunk, all of them there.
        const auto misplaced = [&]() -> std::string {
          const auto first_mtp = layers.find('m');
          if (first_mtp != std::string::npos && layers.find('t', first_mtp) != std::string::npos)
            return "decoder layers must be placed before MTP layers";
          for (Int k = 0; k < count; ++k) {
            const std::string& stage = stages[static_cast<std::size_t>(k)];
            const auto mtp = static_cast<Int>(std::count(stage.begin(), stage.end(), 'm'));
            if (mtp == 0) continue;
            if (k / pp < count / pp - 1)
              return fmt::format("Currently we restrict that the MTP should be always in the last virtual pipeline "
                                 "stage of that rank. But got {}",
                                 stage);
            if (mtp != n('m')) return "All of the MTP layers must be in the same one virtual pipeline stage";
          }
          return "";
        }();
        // The layout's m are the user's placement: where the rule takes it, the fix for a count
        // that misses it is the layout's count, else the layout's fix.
        if (n('m') != m.mtp_num_layers.value_or(0))
          return fail("Number of mtp layers in layout must match mtp_num_layers",
                      !misplaced.empty() ? fix
                      : n('m')           ? fmt::format("model.mtp_num_layers={}", n('m'))
                                         : "model.mtp_num_layers=null");
        if (!misplaced.empty()) return fail(misplaced, fix);
        return pass();
      });
  // Megatron-Core builds the embedding where pre_process holds (the first chunk of the first
  // stage) and the loss where post_process does (the last of the last), wherever the layout's E
  // and L sit (training.py build_model); validate_layer_layout only asks that E come first and L
  // last in the flattened layout, so '|EttL' passes there.
  add("pipeline.layout_embedding_loss_stages", W,
      {"model.pipeline_model_parallel_layout", "model.pipeline_model_parallel_size"}, kMcore,
      "a layout's E sits in the first stage and its L in the last, where Megatron builds them",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (!m.pipeline_model_parallel_layout || !layers_split(m)) return pass();
        const PipelineSplit split = pipeline_split(m);
        return fail_if(split.embedding_stage != 0 || split.loss_stage != split.virtual_stages() - 1,
                       fmt::format("the layout puts the embedding in virtual stage {} and the loss in {} of {}: "
                                   "Megatron-Core builds them on the first model chunk of the first stage and the "
                                   "last of the last (pre_process / post_process) wherever E and L sit, so the "
                                   "stages' layer counts are not the ones the layout shows (and epx run refuses "
                                   "it); move E into the layout's first stage and L into its last",
                                   split.embedding_stage, split.loss_stage, split.virtual_stages()));
      });
  // A standalone MTP stage builds its own embedding, zeroed and then synced over the embedding
  // group (language_module.py setup_embeddings_and_output_layer), whose ranks are the first, the
  // last where tied, and the MTP's (pretrain_gpt / Bridge get_embedding_ranks), each once. In a
  // later chunk of the first rank, the MTP's copy shares its rank with chunk 0's embedding:
  // untied the group is that rank alone, so the copy stays zero, and finalize_model_grads sums
  // only model[0]'s gradient on the first stage; tied, the first rank all-reduces twice at build
  // against the last rank's once.
  add("pipeline.mtp_first_rank_chunk", E,
      {"model.pipeline_model_parallel_layout", "model.pipeline_model_parallel_size", "model.mtp_num_layers"},
      "epx, from Megatron-Core language_module.py / finalize_model_grads.py",
      "a standalone MTP stage is not a later model chunk of the first pipeline rank",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (!m.pipeline_model_parallel_layout || m.mtp_num_layers.value_or(0) == 0 || !layers_split(m)) return pass();
        const PipelineSplit split = pipeline_split(m);
        if (!split.mtp_beside_first_chunk()) return pass();
        std::vector<std::string> stages = parse_pipeline_layout(*m.pipeline_model_parallel_layout);
        std::erase(stages[static_cast<std::size_t>(split.mtp_stage)], 'm');
        stages.back().insert(stages.back().size() - 1, static_cast<std::size_t>(*m.mtp_num_layers), 'm');
        return fail(fmt::format("the layout puts the MTP layers in model chunk {} of the first pipeline rank, whose "
                                "chunk 0 holds the embedding: Megatron-Core's embedding group holds that rank once, "
                                "so the MTP chunk's own embedding copy (zeroed at build) is never synced with it: "
                                "untied it stays zero and trains apart (finalize_model_grads sums model[0]'s), "
                                "tied the first rank's two all-reduces at build meet the last rank's one (and epx "
                                "run refuses it); put the m in another rank's last chunk or beside the L",
                                split.mtp_stage / split.stages),
                    fmt::format("{}", fmt::join(layout_overrides(m, fmt::format("{}", fmt::join(stages, "|"))), " ")));
      });
  add("parallel.layers_divisible_by_pp", E,
      {"model.num_layers", "model.pipeline_model_parallel_size",
       "model.virtual_pipeline_model_parallel_size", "model.pipeline_model_parallel_layout",
       "model.account_for_embedding_in_pipeline_split", "model.account_for_loss_in_pipeline_split",
       "model.num_layers_in_first_pipeline_stage", "model.num_layers_in_last_pipeline_stage"},
      kMcore, "layers split evenly over pipeline (and virtual pipeline) stages",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (m.pipeline_model_parallel_layout || m.num_layers == 0) return pass();  // pipeline.layout's
        try {
          pipeline_split(m);
          return pass();
        } catch (const ConfigError& e) {
          const std::vector<std::string> fix = pipeline_split_fix(m);
          return fail(e.what(), fix.empty() ? "model.pipeline_model_parallel_layout=<layout>"
                                            : fmt::format("{}", fmt::join(fix, " ")));
        }
      });
  add("pipeline.defer_embedding_wgrad", E,
      {"model.defer_embedding_wgrad_compute", "model.pipeline_model_parallel_size",
       "model.gradient_accumulation_fusion", "model.wgrad_deferral_limit"},
      kMcoreParallel, "deferring the embedding's wgrad needs PP, gradient accumulation fusion and a limit >= 0",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (!m.defer_embedding_wgrad_compute) return pass();
        const std::string section = c.cfg.comm_overlap ? "comm_overlap" : "model";  // where finalize took it from
        const std::string off = section + ".defer_embedding_wgrad_compute=false";
        if (m.pipeline_model_parallel_size == 1)
          return fail("Cannot defer embedding wgrad compute when pipeline model parallel is not used", off);
        const std::string limit = section + ".wgrad_deferral_limit=0";
        if (!m.gradient_accumulation_fusion)
          return fail("Cannot defer embedding wgrad compute when gradient accumulation fusion is not used",
                      "model.gradient_accumulation_fusion=true" + (m.wgrad_deferral_limit < 0 ? " " + limit : ""));
        return fail_if(m.wgrad_deferral_limit < 0,
                       "Wgrad deferral limit should be greater than or equal to 0 when it is enabled!", limit);
      });
  add("parallel.vpp_needs_pp", E,
      {"model.pipeline_model_parallel_size", "model.virtual_pipeline_model_parallel_size",
       "model.pipeline_model_parallel_layout"},
      "Megatron-Core parallel_state.py", "the interleaved schedule (VPP, given or a layout's) needs PP > 1",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        if (m.pipeline_model_parallel_size == 1 && !m.virtual_pipeline_model_parallel_size && virtual_pipeline_size(m))
          return fail(fmt::format("pipeline_model_parallel_layout has {} stages, so virtual_pipeline_model_parallel_size "
                                  "= {}, with pipeline_model_parallel_size = 1: pipeline-model-parallel size should be "
                                  "greater than 1 with interleaved schedule",
                                  *virtual_pipeline_size(m), *virtual_pipeline_size(m)),
                      "model.pipeline_model_parallel_layout=null");
        return fail_if(m.pipeline_model_parallel_size == 1 && m.virtual_pipeline_model_parallel_size.has_value(),
                       "virtual_pipeline_model_parallel_size is set with pipeline_model_parallel_size = 1: the "
                       "interleaved schedule needs pipeline parallelism",
                       "model.virtual_pipeline_model_parallel_size=null");
      });
  add("pipeline.interleaved_microbatches", E,
      {"model.pipeline_model_parallel_size", "model.virtual_pipeline_model_parallel_size",
       "model.pipeline_model_parallel_layout", "model.microbatch_group_size_per_vp_stage", "train.global_batch_size",
       "train.micro_batch_size", "target.num_gpus"},
      "Megatron-Core pipeline_parallel/schedules.py",
      "the interleaved schedule runs micro-batches in groups of N (PP by default): PP <= N <= M, M mod N 0 or >= PP",
      [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        const Int pp = m.pipeline_model_parallel_size;
        if (pp <= 1 || !virtual_pipeline_size(m)) return pass();  // a layout's VPP too
        if (!c.world()) return world_not_given(c);
        const Int M = microbatches(c.cfg), N = m.microbatch_group_size_per_vp_stage.value_or(pp);
        if (M <= 0) return pass();
        // The smallest group size both of Megatron-Core's checks accept keeps the batch (M itself
        // always does once M >= PP); else a batch of whole groups, at least one (as the batch
        // rule's fix where the batch does not divide).
        const Int per_step = c.cfg.train.micro_batch_size.value_or(1) * data_parallel_size(c.cfg);
        const bool divides = c.cfg.train.global_batch_size.value_or(0) % per_step == 0;
        Int group = 0;
        for (Int n = pp; divides && n <= M && group == 0; ++n)
          if (M % n == 0 || M % n >= pp) group = n;
        const std::string fix =
            group > 0 ? fmt::format("model.microbatch_group_size_per_vp_stage={}", group)
                      : fmt::format("train.global_batch_size={}",
                                    round_up(std::max<Int>(1, c.cfg.train.global_batch_size.value_or(1)),
                                             per_step * std::max(N, pp)));
        if (const auto why = interleaved_micro_batch_error(pp, N, M)) return fail(*why, fix);
        return pass();
      });
  // The MoE layer's forward raises in training (moe/moe_layer.py), whatever the EP size.
  add("parallel.ep_tp_needs_sp", E,
      {"model.num_moe_experts", "model.tensor_model_parallel_size", "model.sequence_parallel"},
      "Megatron-Core moe/moe_layer.py", "MoE with TP needs sequence parallelism", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        return fail_if(m.num_moe_experts.value_or(0) > 0 && m.tensor_model_parallel_size > 1 && !m.sequence_parallel,
                       "During training, performance may degrade if MoE and tensor parallelismare enabled without "
                       "also enabling sequence parallelism.",
                       "model.sequence_parallel=true");
      });
  add("parallel.cp_seq_length", E, {"model.context_parallel_size", "model.seq_length"}, kBridgeConfig,
      "context parallelism splits the sequence into 2 x CP chunks", [](const CheckContext& c) {
        const auto& m = c.cfg.model;
        const Int cp = m.context_parallel_size;
        if (cp <= 1 || m.seq_length % (2 * cp) == 0) return pass();
        // The largest smaller CP that splits the sequence and still folds the world and divides the
        // batch, else a longer sequence.
        std::string fix = fmt::format("model.seq_length={}", round_up(m.seq_length, 2 * cp));
        const auto& t = c.cfg.train;
        for (Int smaller = cp - 1; smaller >= 1; --smaller) {
          const Int mp = m.tensor_model_parallel_size * m.pipeline_model_parallel_size * smaller;
          const bool folds = !c.world() || (*c.world() % mp == 0 &&
                                            (!t.global_batch_size || !t.micro_batch_size ||
                                             *t.global_batch_size % (*t.micro_batch_size * (*c.world() / mp)) == 0));
          if ((smaller == 1 || m.seq_length % (2 * smaller) == 0) && folds) {
            fix = fmt::format("model.context_parallel_size={}", smaller);
            break;
          }
        }
        return fail("Sequence length must be divisible by 2 * context parallel size if context parallel is used.", fix);
      });
  add("scheduler.lr_order", E, {"optimizer.lr", "optimizer.min_lr", "scheduler.lr_warmup_init"},
      kMcoreScheduler, "min_lr and the warmup's start at most the learning rate",
      [](const CheckContext& c) {
        const auto& o = c.cfg.optimizer;
        if (!o.lr) return pass();  // a config without its optimizer section (epx run asks for it)
        if (o.min_lr.value_or(0) > *o.lr)
          return fail(fmt::format("min_lr ({}) is above lr ({}): the scheduler asserts max_lr >= min_lr", *o.min_lr, *o.lr),
                      fmt::format("optimizer.min_lr={}", *o.lr));
        return fail_if(c.cfg.scheduler.lr_warmup_init > *o.lr,
                       fmt::format("lr_warmup_init ({}) is above lr ({}): the scheduler asserts init_lr <= max_lr",
                                   c.cfg.scheduler.lr_warmup_init, *o.lr),
                       "scheduler.lr_warmup_init=0.0");
      });
  add("train.mode", E, {"train.train_iters", "train.train_samples"}, kBridgeConfig,
      "exactly one of train_iters, train_samples (or num_epochs) sets the run's length", [](const CheckContext& c) {
        const auto& t = c.cfg.train;
        // num_epochs (SFT datasets) is not modelled; a Bridge dump keeps it among its other fields.
        const YAML::Node& kept = c.cfg.extra_fields.node;
        const auto kept_train = [&](const char* name) {  // set and not null
          return kept.IsMap() && kept["train"].IsDefined() && kept["train"].IsMap() && kept["train"][name].IsDefined() &&
                 !kept["train"][name].IsNull();
        };
        const bool epochs = kept_train("num_epochs");
        const int modes = (t.train_iters ? 1 : 0) + (t.train_samples ? 1 : 0) + (epochs ? 1 : 0);
        if (modes == 0)
          return fail("One of train_iters, train_samples, or num_epochs must be provided", "train.train_iters=<n>");
        if (modes > 1)
          return fail("Cannot specify more than one of train_iters, train_samples, or num_epochs",
                      t.train_iters ? "train.train_samples=null" : "train.train_iters=null");
        return fail_if(kept_train("rampup_batch_size") && (t.train_samples || epochs),
                       epochs ? "Batch size rampup not supported with epoch-based training"
                              : "Batch size rampup not supported with sample-based training yet",
                       "train.rampup_batch_size=null");
      });
  add("scheduler.iteration_or_sample_fields", E,
      {"scheduler.lr_decay_iters", "scheduler.lr_warmup_iters", "scheduler.lr_decay_samples",
       "scheduler.lr_warmup_samples", "scheduler.lr_warmup_fraction"},
      kBridgeConfig, "the scheduler counts in iterations or in samples, and one warmup field at most",
      [](const CheckContext& c) {
        const auto& s = c.cfg.scheduler;
        const auto none = [](const OptInt& v) { return v ? std::to_string(*v) : std::string("None"); };
        if ((s.lr_decay_iters || s.lr_warmup_iters != 0) && (s.lr_decay_samples || s.lr_warmup_samples != 0))
          return fail(fmt::format("Cannot mix iteration-based and sample-based scheduler fields. Found iteration fields: "
                                  "lr_decay_iters={}, lr_warmup_iters={}, lr_wsd_decay_iters=None. Found sample fields: "
                                  "lr_decay_samples={}, lr_warmup_samples={}, lr_wsd_decay_samples=None. Use either "
                                  "iteration fields OR sample fields, not both.",
                                  none(s.lr_decay_iters), s.lr_warmup_iters, none(s.lr_decay_samples), s.lr_warmup_samples),
                      c.cfg.train.train_samples ? "scheduler.lr_decay_iters=null scheduler.lr_warmup_iters=0"
                                                : "scheduler.lr_decay_samples=null scheduler.lr_warmup_samples=0");
        return fail_if(s.lr_warmup_fraction && (s.lr_warmup_iters != 0 || s.lr_warmup_samples != 0),
                       fmt::format("Cannot specify lr_warmup_fraction={} with lr_warmup_iters={} or lr_warmup_samples={}. "
                                   "Use either lr_warmup_fraction OR lr_warmup_iters OR lr_warmup_samples.",
                                   s.lr_warmup_fraction.value_or(0), s.lr_warmup_iters, s.lr_warmup_samples),
                       "scheduler.lr_warmup_fraction=null");
      });
  add("scheduler.matches_training", E,
      {"train.train_samples", "train.train_iters", "scheduler.max_steps", "scheduler.lr_decay_iters",
       "scheduler.lr_warmup_iters", "scheduler.lr_decay_samples", "scheduler.lr_warmup_samples"},
      kBridgeConfig, "sample-based training takes the sample fields, iteration-based the iteration fields",
      [](const CheckContext& c) {
        const auto& s = c.cfg.scheduler;
        const auto& t = c.cfg.train;
        if (t.train_samples) {
          if (s.max_steps)
            return fail("scheduler.max_steps is only supported for iteration-based training; use sample-based scheduler "
                        "fields with train_samples",
                        "scheduler.max_steps=null");
          if (s.lr_decay_iters)
            return fail("Use lr_decay_samples for sample-based training, not lr_decay_iters", "scheduler.lr_decay_iters=null");
          return fail_if(s.lr_warmup_iters != 0, "Use lr_warmup_samples for sample-based training, not lr_warmup_iters",
                         "scheduler.lr_warmup_iters=0");
        }
        if (s.lr_decay_samples)
          return fail("Use lr_decay_iters for iteration-based training, not lr_decay_samples", "scheduler.lr_decay_samples=null");
        if (s.lr_warmup_samples != 0)
          return fail("Use lr_warmup_iters for iteration-based training, not lr_warmup_samples", "scheduler.lr_warmup_samples=0");
        return fail_if(s.max_steps && t.train_iters && *s.max_steps < *t.train_iters,
                       fmt::format("scheduler.max_steps ({}) must be greater than or equal to train.train_iters ({}).",
                                   s.max_steps.value_or(0), t.train_iters.value_or(0)),
                       fmt::format("scheduler.max_steps={}", t.train_iters.value_or(0)));
      });
  // Bridge: train_iters = train_samples // global_batch_size; under one batch, no iteration runs.
  add("train.samples_below_one_batch", W, {"train.train_samples", "train.global_batch_size"}, kBridgeConfig,
      "sample-based training has samples for at least one global batch", [](const CheckContext& c) {
        const auto& t = c.cfg.train;
        if (!t.train_samples || !t.global_batch_size || *t.train_samples >= *t.global_batch_size) return pass();
        return fail(fmt::format("train_samples ({}) is below one global batch ({}): train_iters = train_samples // "
                                "global_batch_size = 0, and the run trains no iteration (epx run refuses it)",
                                *t.train_samples, *t.global_batch_size),
                    fmt::format("train.train_samples={}", *t.global_batch_size));
      });
  add("scheduler.warmup_capped", W,
      {"scheduler.lr_warmup_iters", "scheduler.lr_decay_iters", "scheduler.lr_warmup_samples",
       "scheduler.lr_decay_samples", "scheduler.lr_warmup_fraction", "scheduler.max_steps", "train.train_iters",
       "train.train_samples", "train.global_batch_size"},
      kBridgeConfig, "a warmup as long as the decay is capped one sample short of it", [](const CheckContext& c) {
        const std::optional<SchedulerSteps> steps = scheduler_steps(c.cfg);
        if (!steps || !steps->capped()) return pass();
        const auto& s = c.cfg.scheduler;
        const Int gbs = c.cfg.train.global_batch_size.value_or(1);
        const std::string fix = s.lr_warmup_fraction ? "scheduler.lr_warmup_fraction=<below 1>"
                                : steps->sample_based ? fmt::format("scheduler.lr_warmup_samples={}", steps->decay - 1)
                                                      : fmt::format("scheduler.lr_warmup_iters={}", steps->decay / gbs - 1);
        return fail(fmt::format("lr_warmup_steps ({}) >= lr_decay_steps ({}); capping lr_warmup_steps to {}. Reduce "
                                "lr_warmup_iters (or lr_warmup_samples) for short training runs.",
                                steps->uncapped_warmup, steps->decay, steps->decay - 1),
                    fix);
      });
  add("train.batch_divisible", E,
      {"train.global_batch_size", "train.micro_batch_size", "comm_overlap.data_parallel_size",
       "target.num_gpus"},
      kBridgeConfig, "global batch = micro batch x DP x micro-batches", [](const CheckContext& c) {
        const auto& t = c.cfg.train;
        // ConfigContainer.validate() takes the evaluation's batch from the training's (epx keeps
        // Bridge's validation section unread, so its eval sizes count as unset).
        if (!t.global_batch_size)  // asserted first, then the micro-batch
          return fail("train.global_batch_size must be set when eval_global_batch_size is not explicitly configured",
                      fmt::format("train.global_batch_size={}",
                                  t.micro_batch_size.value_or(1) * std::max<Int>(1, data_parallel_size(c.cfg))));
        if (!t.micro_batch_size)
          return fail("train.micro_batch_size must be set when eval_micro_batch_size is not explicitly configured",
                      "train.micro_batch_size=1");
        if (!c.world() && t.global_batch_size && t.micro_batch_size) {
          // Whatever the world, DP >= 1: a batch the micro-batch does not divide never fits.
          if (*t.micro_batch_size <= 0 || *t.global_batch_size % *t.micro_batch_size != 0)
            return fail(fmt::format("global_batch_size ({}) is not divisible by "
                                    "micro_batch_size ({}), so by no micro_batch_size x "
                                    "data_parallel_size",
                                    *t.global_batch_size, *t.micro_batch_size),
                        fmt::format("train.global_batch_size={}",
                                    round_up(*t.global_batch_size,
                                             std::max<Int>(*t.micro_batch_size, 1))));
          return world_not_given(c);
        }
        const Int dp = data_parallel_size(c.cfg);
        if (!t.global_batch_size || !t.micro_batch_size || dp == 0) return pass();
        const Int step = *t.micro_batch_size * dp;
        // Where the world does not fold the expert side either, the world's fix (a world that
        // folds both sides and divides the batch where one does) is this one's too: two fixes
        // that each assume the other is not applied would not pass together.
        // Likewise the interleaved schedule's groups: a batch of whole groups passes both rules.
        const auto& m = c.cfg.model;
        const Int emp = effective_etp(m) * m.expert_model_parallel_size * m.pipeline_model_parallel_size;
        const Int group = m.pipeline_model_parallel_size > 1 && virtual_pipeline_size(m)
                              ? m.microbatch_group_size_per_vp_stage.value_or(m.pipeline_model_parallel_size)
                              : 1;
        const std::string fix = emp > 0 && *c.world() % emp != 0
                                    ? world_fix(c.cfg, *c.world())
                                    : fmt::format("train.global_batch_size={}",
                                                  round_up(*t.global_batch_size, std::max<Int>(step * group, 1)));
        return fail_if(*t.micro_batch_size <= 0 || *t.global_batch_size % step != 0,
                       fmt::format("global_batch_size ({}) is not divisible by micro_batch_size x "
                                   "data_parallel_size = {} x {}",
                                   *t.global_batch_size, *t.micro_batch_size, dp),
                       fix);
      });
}

}  // namespace epx::rule_helpers
