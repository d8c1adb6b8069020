"""The run: `run.UntieRun`, the one run object every adapter drives through its three phases (attach, start, the
per-step events), `policy.choose_plan`, the schedule `UntieConfig.policy` chooses from the model, and
`plan.plan_structure`, the structure a model needs at a start or a resume. Every install the
run makes goes through its `untie.registry.Registry`."""
