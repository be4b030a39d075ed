"""FSDP2: each decoder layer a unit and then the root, cut by compute dtype so mixed-dtype models shard; HSDP over
dp_replicate; the mixed-precision policy a Trainer precision flag means."""
