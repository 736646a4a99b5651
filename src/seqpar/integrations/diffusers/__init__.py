"""diffusers transformers (DiTs) under seqpar: ``seqpar.parallelize(transformer, mesh)`` on a
``diffusers.ModelMixin`` (:mod:`.parallelize`), by small pieces -- where each class's sequences are
split and leave (:mod:`.plan`, :mod:`.families`), one forward's shard lengths and SeqShards
(:mod:`.sequences`), the attention modules' SDPA calls routed through the strategy (:mod:`.routing`),
the same inputs on every rank (:mod:`.inputs`), the output's token layout (:mod:`.layouts`) -- and
the rectified-flow objective on sharded outputs (:mod:`.flow`).
"""

from .flow import euler_sample, flow_matching_loss, logit_normal_timesteps, noisy_latents, velocity_target
from .parallelize import parallelize_diffusers, shard_output

__all__ = ["euler_sample", "flow_matching_loss", "logit_normal_timesteps", "noisy_latents", "parallelize_diffusers",
           "shard_output", "velocity_target"]
