"""Layer 3, batch and loss: causal-LM targets, shard_batch (every SP rank's slice of a full batch),
and the exact token-weighted loss with its gradient contract."""
