"""Engine integrations: `deepspeed` (ZeRO 1/2/3, checkpoints, the JSON registry), `fsdp`
(FSDP2/FSDP1, DCP) and `engine_setup` (the optimizer and batch settings a DeepSpeed JSON gives
either engine). Each imports its engine lazily, so importing coat_ds never needs DeepSpeed."""
