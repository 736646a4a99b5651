"""Mixture-of-experts models: expert parallelism folded over the dp x sp ranks (:mod:`.expert_parallel`)."""
