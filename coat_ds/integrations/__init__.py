"""Engine integrations: `deepspeed` (ZeRO 1/2/3, checkpoints, the JSON registry and reader),
`fsdp` (FSDP2/FSDP1, DCP) and `process_group` (ending the process group either engine ran in).
Each imports its engine lazily, so importing coat_ds never needs DeepSpeed."""
