"""Layer 4, integrations: transformers models (parallelize through AttentionInterface, the model's own
kernel, built-in tiny configs and checkpoints), FSDP2 / DDP over the dp x sp ranks, and transformers'
Trainer / TRL's SFTTrainer (parallelize_trainer)."""
