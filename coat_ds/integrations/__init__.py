"""Engine integrations. Each submodule imports its engine lazily, so importing coat_ds never
needs DeepSpeed: `coat_ds.integrations.deepspeed` (ZeRO 1/2/3, checkpoints)."""
