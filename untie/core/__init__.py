"""The run: `run.UntieRun`, the one run object every adapter drives through its three phases (attach, start, the
per-step events). What it decides from lives below it: the schedule `UntieConfig.policy` chooses from the model
(`untie.structure.policy.choose_plan`) and the structure a model needs at a start or a resume
(`untie.structure.plan.plan_structure`). Every install the run makes goes through its `untie.registry.Registry`."""
