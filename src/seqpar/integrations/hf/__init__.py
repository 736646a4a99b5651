"""transformers models under seqpar: :mod:`.parallelize` (``seqpar.parallelize`` through
``AttentionInterface``), the attention function it registers (:mod:`.attention`, :mod:`.kernel`,
:mod:`.layer_spec`), MoE router losses, the forward's fault publishing, built-in tiny models,
``save_pretrained`` from any layout (:mod:`.export`) and the feature report of ``seqpar env``."""
