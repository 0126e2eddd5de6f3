// The optimizer's state dtypes and epx's own gradient reduction.
#include "epx/base/edit_distance.hpp"
#include "epx/base/to_lower.hpp"
#include "rule_helpers.hpp"

namespace epx::rule_helpers {

void add_optimizer_rules(RuleTable& add) {
  add("optimizer.precision_aware_dtypes", E,
      {"optimizer.use_precision_aware_optimizer", "optimizer.main_grads_dtype", "optimizer.main_params_dtype",
       "optimizer.exp_avg_dtype", "optimizer.exp_avg_sq_dtype", "optimizer.optimizer", "ddp.use_distributed_optimizer"},
      kMcoreOptimizer,
      "lower-precision optimizer state needs the precision-aware (TE FusedAdam) optimizer, which needs Adam and the "
      "distributed optimizer",
      [](const CheckContext& c) {
        const OptimizerConfig& o = c.cfg.optimizer;
        if (o.use_precision_aware_optimizer) {
          if (o.optimizer != "adam")
            return fail("--use-precision-aware-optimizer only supported with adam", "optimizer.use_precision_aware_optimizer=false");
          return fail_if(!c.cfg.ddp.use_distributed_optimizer,
                         "--use-precision-aware-optimizer only supported with distributed optimizer",
                         "ddp.use_distributed_optimizer=true optimizer.use_distributed_optimizer=true");
        }
        for (const auto& [name, dtype] : {std::pair{"main_grads_dtype", &o.main_grads_dtype},
                                          std::pair{"main_params_dtype", &o.main_params_dtype},
                                          std::pair{"exp_avg_dtype", &o.exp_avg_dtype},
                                          std::pair{"exp_avg_sq_dtype", &o.exp_avg_sq_dtype}})
          if (*dtype != "fp32")
            return fail(fmt::format("{} can only be fp32 when not using precision-aware optimizer", name),
                        o.optimizer != "adam" ? fmt::format("optimizer.{}=fp32", name)
                        : c.cfg.ddp.use_distributed_optimizer
                            ? "optimizer.use_precision_aware_optimizer=true"
                            : "optimizer.use_precision_aware_optimizer=true ddp.use_distributed_optimizer=true "
                              "optimizer.use_distributed_optimizer=true");
        return pass();
      });
  // torch's Adam takes eps >= 0, but at 0 its step m / (sqrt(v) + eps) is 0 / 0 for every weight
  // whose gradient has been 0 in every step so far: an expert no token reached yet, an embedding
  // row of a token not seen. One NaN weight makes the next loss NaN, which stops the run.
  add("optimizer.adam_eps_zero", W, {"optimizer.adam_eps", "optimizer.optimizer"}, "torch.optim.Adam",
      "Adam's eps above 0", [](const CheckContext& c) {
        const OptimizerConfig& o = c.cfg.optimizer;
        return fail_if(o.optimizer == "adam" && o.adam_eps == 0,
                       "adam_eps=0: Adam's step m / (sqrt(v) + eps) is 0 / 0 = NaN for every weight whose gradient "
                       "has been 0 so far (an expert no token reached, the embedding row of a token not seen), and "
                       "the next loss is NaN",
                       "optimizer.adam_eps=1e-08");
      });

  // ---- epx's own gradient reduction ----------------------------------------------------------
  add("ddp.embedding_rows", E,
      {"ddp.reduce_embedding_rows", "ddp.overlap_grad_reduce", "model.share_embeddings_and_output_weights",
       "model.pipeline_model_parallel_size"},
      "epx train/grad_reducer.hpp", "reduce_embedding_rows splits the overlapped reduction of an untied embedding",
      [](const CheckContext& c) {
        const auto& d = c.cfg.ddp;
        if (!d.reduce_embedding_rows) return pass();
        // With the distributed optimizer a comm_overlap section sets ddp's from its own (Bridge's
        // CommOverlapConfig), so the fix goes there.
        if (!d.overlap_grad_reduce)
          return fail_if(true, "reduce_embedding_rows splits the overlapped reduction of the embedding's gradient, "
                               "and overlap_grad_reduce is off",
                         c.user.comm_overlap && d.use_distributed_optimizer ? "comm_overlap.overlap_grad_reduce=true"
                                                                            : "ddp.overlap_grad_reduce=true");
        // Over pipeline stages the head's part is the last stage's copy's: the first stage's is rows.
        return fail_if(c.cfg.model.share_embeddings_and_output_weights && c.cfg.model.pipeline_model_parallel_size == 1,
                       "with share_embeddings_and_output_weights on one pipeline stage the embedding's gradient also "
                       "holds the LM head's, which is not a set of token rows",
                       "ddp.reduce_embedding_rows=false");
      });
  add("optimizer.known_optimizer", W, {"optimizer.optimizer"}, "Megatron-Core optimizer/__init__.py",
      "an optimizer Megatron builds and epx plans: adam, sgd, lion, muon, adaptive_muon (or dist_ of one)",
      [](const CheckContext& c) {
        static const std::vector<std::string> kKnown = {"adam", "sgd", "lion", "muon", "adaptive_muon"};
        const std::string& name = c.cfg.optimizer.optimizer;
        const std::string bare = name.starts_with("dist_") ? name.substr(5) : name;
        // dist_ names go to the emerging-optimizer path, which has no adam or sgd of its own.
        if (contains(kKnown, bare) && !(bare != name && (bare == "adam" || bare == "sgd"))) return pass();
        const std::string nearest = nearest_name(kKnown, to_lower(bare));
        return fail(fmt::format("optimizer '{}' is not one of {}: Megatron builds any other name only from the "
                                "emerging-optimizers package's registry, and epx plans its state as Adam's",
                                name, fmt::join(kKnown, ", ")),
                    nearest.empty() ? "" : "optimizer.optimizer=" + nearest);
      });
}

}  // namespace epx::rule_helpers
