"""TRL's trainers under ``seqpar.parallelize_trainer``: which are exact and which are refused, with the
reason (:mod:`.registry`); TRL's own losses over the sharded stand-in model (:mod:`.objectives`); the
mixins and the options they refuse by name (:mod:`.mixins`: DPO, reward; :mod:`.kto`; :mod:`.grpo`:
GRPO and RLOO); a dynamic schedule for DPO and reward (:mod:`.dynamic`)."""
