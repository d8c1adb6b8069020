"""The training engines: which one trains (DDP, FSDP2, DeepSpeed), their collectives, and the tied phase where a live
shared parameter cannot be used (`emulation.EmulatedTying` for FSDP2, `zero_tying.ZeroTying` for DeepSpeed ZeRO)."""
