"""The run: `run.UntieRun`, the one run object every adapter drives, in the order of `phases` (one table of
transitions). It holds the run's state and executes what `untie.decision.decide.decide` decides; what it says is
`messages`', what it measures `measuring`'s. Every install the run makes goes through its `untie.registry.Registry`."""
