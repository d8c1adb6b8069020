"""The model's structure: find the input embedding and the LM head of 19 architectures, tie and untie them (with the
optimizer state), which structure a run needs (`plan`), the untie policy that decides whether a run starts untied
(`policy`), and what is safe on a PEFT model."""
