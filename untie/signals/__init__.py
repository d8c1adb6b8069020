"""What a run measures and decides from: the role-gradient probe, the role and drift metrics, the tokenizer's
semantically equivalent pairs, and the trigger policies (the deadline and the divergence trigger)."""
