"""TRL's objective trainers (``DPOTrainer``, ``RewardTrainer``, ``GRPOTrainer``) under
``seqpar.parallelize_trainer``, with TRL's own losses: the sharded stand-in model (:mod:`.objectives`),
the mixins and the options refused by name (:mod:`.mixins`, :mod:`.grpo`), a dynamic schedule
(:mod:`.dynamic`)."""
