"""The decision layer, importable without torch (`tests/test_decision.py` imports it with torch blocked): the settings
as data (`settings.UntieConfig`), the schedule's rules (`triggers`: the deadline and the divergence trigger's rule),
the per-pair metric keys, the structure plans (`plan`), what a policy chooses from what was read (`policy_rules`), and
the run's one decision (`decide.decide(facts, settings, saved, step)`). The layers below read the model and act;
they decide nothing this package does not."""
