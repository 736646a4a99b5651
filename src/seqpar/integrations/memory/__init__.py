"""The memory switches (``seqpar.reduce_memory``, :mod:`.switches`): the tiled loss (:mod:`.tiled_head`),
tiled per-token MLPs and per-layer checkpoints with host offload (:mod:`.tiling`)."""
