"""What a run measures: the role-gradient probe, the role and drift metrics, and the tokenizer's semantically
equivalent pairs. The trigger's rules that read these measurements are `untie.decision.triggers`."""
