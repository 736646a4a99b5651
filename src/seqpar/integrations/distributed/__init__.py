"""torch.distributed's own parallel wrappers over seqpar's mesh: FSDP2 / DDP over the dp x sp ranks
(:mod:`.fsdp`) and sharded initialisation from the meta device (:mod:`.materialize`)."""
