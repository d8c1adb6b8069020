"""The model's structure, read and changed: find the input embedding and the LM head of 19 architectures, tie and
untie them (with the optimizer state), what the run reads off the model for the decision (`facts`, the policy's
reading of the weights in `policy`), the drawn head's first-batch check, a learning rate per role, and what is safe
on a PEFT model. The decisions themselves are `untie.decision`'s."""
