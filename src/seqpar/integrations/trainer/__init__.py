"""transformers' ``Trainer`` (and TRL's ``SFTTrainer``) under sequence parallelism: the mixin and
``parallelize_trainer`` (:mod:`.mixin`), its loaders and batches (:mod:`.data`), a dynamic SP
schedule inside it (:mod:`.dynamic`)."""
