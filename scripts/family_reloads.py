"""Per tied family (the tiny builds of `tests/test_families.py`), the largest logit difference after each reload a
user makes, as a Markdown table: what those tests bound by 1e-5, measured.

    python scripts/family_reloads.py

Columns: `untie convert SRC OUT --untie` then a plain reload (against the tied model); Trainer with `UntieCallback`
untying at step 2 of 4, saved, reloaded and `tie_weights()` (against the trained model); LoRA on an attention
projection with the untied head in `modules_to_save`, three AdamW steps, `merge_and_unload`, saved, reloaded (against
the adapter model). Each reload is plain transformers; the tie is read from the saved config's text sub-config.
"""

from __future__ import annotations

import sys
import tempfile
import warnings
from pathlib import Path

import torch
import transformers as tf

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import test_families as families  # noqa: E402  (the tiny builds the tests check)

import untie  # noqa: E402
from untie.cli import main as cli  # noqa: E402
from untie.testing import ToyLMDataset  # noqa: E402


def _max_difference(first, second) -> float:
    return (families.logits(first, families.IDS) - families.logits(second, families.IDS)).abs().max().item()


def convert_difference(family: str, folder: Path) -> float:
    model = families.build(family)
    model.save_pretrained(folder / "tied")
    assert cli(["convert", str(folder / "tied"), str(folder / "untied"), "--untie"]) == 0
    assert not families.served_as_tied(folder / "untied")
    return _max_difference(type(model).from_pretrained(folder / "untied"), model)


def trainer_difference(family: str, folder: Path) -> float:
    model = families.build(family)
    args = tf.TrainingArguments(output_dir=str(folder / "run"), max_steps=4, learning_rate=1e-2, report_to=[],
                                save_strategy="no", disable_tqdm=True, use_cpu=True)  # fmt: skip
    callback = untie.UntieCallback(untie_at=2, untie_when=None, policy="off")
    tf.Trainer(model=model, args=args, train_dataset=ToyLMDataset(n=16, vocab=families.TEXT_IDS),
               callbacks=[callback]).train()  # fmt: skip
    model.save_pretrained(folder / "trained")
    assert callback.untie_step == 2 and not families.served_as_tied(folder / "trained")
    reloaded = type(model).from_pretrained(folder / "trained")
    reloaded.tie_weights()
    return _max_difference(reloaded, model)


def lora_difference(family: str, folder: Path) -> float:
    model = families.build(family)
    untie.untie_embeddings(model)
    attention = "qkv_proj" if family == "phi-4-mini" else "q_proj"
    config = families.peft.LoraConfig(r=4, lora_alpha=8, target_modules=[attention], modules_to_save=["lm_head"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = families.peft.get_peft_model(model, config)
    optimizer = torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        wrapped(input_ids=families.IDS, labels=families.IDS).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    merged = wrapped.merge_and_unload()
    merged.save_pretrained(folder / "merged")
    assert not families.served_as_tied(folder / "merged")
    return _max_difference(type(merged).from_pretrained(folder / "merged"), merged)


def main() -> str:
    rows = ["| family | convert --untie, reload | Trainer untie at step 2, reload | LoRA + head, merge, reload |",
            "|---|---|---|---|"]  # fmt: skip
    for family in sorted(families.FAMILIES):
        with tempfile.TemporaryDirectory() as folder:
            cells = [f(family, Path(folder) / f.__name__) for f in (convert_difference, trainer_difference,
                                                                     lora_difference)]  # fmt: skip
        rows.append(f"| {family} | " + " | ".join(f"{c:.3g}" for c in cells) + " |")
    table = "\n".join(rows)
    print(table)
    return table


if __name__ == "__main__":
    main()
