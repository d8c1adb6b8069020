"""Pre-train with the defaults, in a dozen lines: the model is built fresh (its embedding matches a fresh draw of its
initialiser) and holds 83% of its parameters in the embedding, so `UntieCallback()` trains it untied from the first
step, its head drawn (policy "by-share": the study's choice for that share; a log line at train begin says so, and
why). `UntieCallback(untie_at=0.3)` (the schedule, set) would train it tied and untie
when the divergence trigger fires, at 30% of the run at the latest.

Offline; 50 s wall on the 2-core development machine (`python examples/pretrain_minimal.py`, CPU)."""

import torch
import transformers as tf

from untie import UntieCallback
from untie_recipes.offline import shakespeare_blocks  # the shipped Shakespeare text, as 64-token blocks
from untie_recipes.tasks.bookcorpus.data import load_tokenizer  # the shipped Shakespeare WordPiece vocabulary

tokenizer = load_tokenizer("offline")
model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=len(tokenizer), n_embd=64, n_layer=2, n_head=4, n_positions=64))
args = tf.TrainingArguments(
    "runs/pretrain_minimal",
    max_steps=200,
    learning_rate=2e-3,
    per_device_train_batch_size=16,
    logging_steps=20,
    report_to=[],
    use_cpu=not torch.cuda.is_available(),
)
trainer = tf.Trainer(model=model, args=args, train_dataset=shakespeare_blocks(tokenizer), callbacks=[UntieCallback()])
trainer.train()
trainer.save_model("runs/pretrain_minimal/final")  # reloads untied with plain from_pretrained
