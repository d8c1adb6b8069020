"""The adapters that translate a training loop's events into the run's phases: `callback.UntieCallback` (Trainer) and
`untier.Untier` (a custom PyTorch or accelerate loop)."""
