"""Checkpoints: the run state's one format and the weights' fingerprint, the resume guard and `prepare_for_resume`,
loading a saved model, converting a checkpoint between tied and untied, and inspecting one (the CLI's commands)."""
