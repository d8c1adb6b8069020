"""The model's structure: find the input embedding and the LM head of 19 architectures, tie and untie them (with the
optimizer state), and what is safe on a PEFT model."""
