"""What the installed PEFT does with `modules_to_save` on a tied model, in a process that never imports `untie`:
the measurement behind `untie.decision.plan.MERGE_RECORDS_THE_SPLIT` (issue 69).

    python scripts/peft_tied_merge.py

A tiny tied Qwen3 (saved, reloaded) is wrapped with LoRA on q_proj/v_proj and the `modules_to_save` of each line,
trained 5 AdamW steps, merged; one line per case: whether the two roles train as separate parameters, the merged
config's `tie_word_embeddings`, whether `tie_weights()` after the merge keeps the trained head, and the largest logit
difference from the trained adapter model after a save and a plain reload (+ `tie_weights()`), and after loading the
saved adapter onto a fresh tied base, merging, saving and reloading. Run it under each PEFT to compare.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import peft
import torch
import transformers as tf
from peft import LoraConfig, PeftModel, get_peft_model

CASES = (["embed_tokens", "lm_head"], ["lm_head"], ["embed_tokens"])


def _tiny(folder: Path) -> None:
    config = tf.Qwen3Config(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, hidden_size=16,
                            intermediate_size=32, head_dim=8, vocab_size=48, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    tf.Qwen3ForCausalLM(config).save_pretrained(folder)


def _weight(module) -> torch.Tensor:
    return module.modules_to_save["default"].weight if hasattr(module, "modules_to_save") else module.weight


def _difference(model, ids, logits) -> float:
    with torch.no_grad():
        return (model(input_ids=ids).logits - logits).abs().max().item()


def case(modules: list[str], root: Path) -> str:
    _tiny(root / "tied")
    model = get_peft_model(
        tf.AutoModelForCausalLM.from_pretrained(root / "tied"),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=modules),
    )
    inner = model.base_model.model
    separate = _weight(inner.get_input_embeddings()) is not _weight(inner.get_output_embeddings())
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    torch.manual_seed(1)
    ids = torch.randint(0, 48, (4, 12))
    for _ in range(5):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    head = _weight(inner.get_output_embeddings()).detach().clone()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    model.save_pretrained(root / "adapter")
    merged = model.merge_and_unload()
    flag = merged.config.tie_word_embeddings
    merged.tie_weights()
    kept = torch.equal(merged.get_output_embeddings().weight, head)
    merged.save_pretrained(root / "merged")
    reloaded = tf.AutoModelForCausalLM.from_pretrained(root / "merged")
    reloaded.tie_weights()
    again = PeftModel.from_pretrained(tf.AutoModelForCausalLM.from_pretrained(root / "tied"), root / "adapter")
    again.merge_and_unload().save_pretrained(root / "merged-again")
    reloaded_again = tf.AutoModelForCausalLM.from_pretrained(root / "merged-again")
    reloaded_again.tie_weights()
    return (
        f"modules_to_save={modules}: separate parameters in training {separate}; merged tie_word_embeddings={flag}; "
        f"tie_weights() keeps the trained head {kept}; reloaded: max logit difference "
        f"{_difference(reloaded, ids, logits):.3g}; adapter onto a fresh tied base, merged, reloaded: "
        f"{_difference(reloaded_again, ids, logits):.3g}"
    )


def main() -> None:
    warnings.simplefilter("ignore")
    tf.logging.set_verbosity_error()
    tf.utils.logging.disable_progress_bar()
    print(f"peft {peft.__version__}, transformers {tf.__version__}, torch {torch.__version__}")
    for modules in CASES:
        with tempfile.TemporaryDirectory() as folder:
            print("-", case(list(modules), Path(folder)))


if __name__ == "__main__":
    main()
