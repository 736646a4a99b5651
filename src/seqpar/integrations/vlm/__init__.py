"""Vision-language models under seqpar: images encoded once over the SP ranks and routed to the
shards that hold their placeholders (:mod:`.encoder`, the routing plan in :mod:`.routing`), every
image-text-to-text family declared by mechanism (:mod:`.families`), M-RoPE positions and
bidirectional image spans computed on the whole rows."""
