"""The python blocks of the README and the guides, run as a user would.

Every block of README.md and docs/guides/*.md runs here, or is marked a fragment (`<!-- fragment -->`, alone on the
line before its fence: it must still parse). A block runs on its own, in a namespace that holds only the placeholders
(`_placeholders`: a tiny tied Llama `model`, its `optimizer`, `args` for two Trainer steps, ...), with the checkpoint
names it loads (`CHECKPOINT_NAMES`) replaced by tiny saved checkpoints: so it imports what it uses.

The tied-checkpoint guide's blocks run in order in one namespace, on two tiny tied checkpoints saved in place of the
one it names: a Qwen3 whose matrix is padded past its tokenizer (as Qwen3's and Gemma 3's are) and a Llama 3.2-shaped
model whose matrix has one row per token."""

from __future__ import annotations

import json
import re
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import transformers as tf
from accelerate import Accelerator

import untie
from untie.testing import VOCAB, ToyLMDataset, tiny_model, tiny_tokenizer

pytestmark = pytest.mark.recipes  # examples/ and the docs' code blocks, not the library

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "guides" / "tied-checkpoints.md"
CHECKPOINT = '"Qwen/Qwen3-0.6B"'
PADDED_ROWS = 64  # a matrix padded past the tokenizer's VOCAB tokens, to a multiple of 64 as Qwen3's is

#: vocabulary layout -> a tiny tied checkpoint's config (the tokenizer has VOCAB tokens in both)
CHECKPOINTS = {
    "padded": lambda: tf.Qwen3Config(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                     hidden_size=16, intermediate_size=32, head_dim=8, vocab_size=PADDED_ROWS,
                                     tie_word_embeddings=True, pad_token_id=0, bos_token_id=2, eos_token_id=3),
    "exact": lambda: tf.LlamaConfig(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                    hidden_size=16, intermediate_size=32, head_dim=8, vocab_size=VOCAB,
                                    tie_word_embeddings=True, pad_token_id=0, bos_token_id=2, eos_token_id=3),
}  # fmt: skip


FRAGMENT = "<!-- fragment -->"
#: The pages whose blocks run here each on its own; the tied-checkpoint guide's run in order, in their own test.
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs" / "guides").glob("*.md") if p != GUIDE)]
#: The checkpoint names a block may load: a tiny tied Llama and an untied one, saved with their tokenizer.
CHECKPOINT_NAMES = {'"a/tied-checkpoint"': "tied", '"an/untied-checkpoint"': "untied"}


def blocks(page: Path) -> list[tuple[int, str, bool]]:
    """Each ```python block of `page`: its fence's line number, its code (dedented, as in a list item), and whether the
    line before the fence marks it a fragment."""
    lines, found = page.read_text().splitlines(), []
    for number, line in enumerate(lines):
        if line.strip() == "```python":
            end = next(i for i in range(number + 1, len(lines)) if lines[i].strip() == "```")
            before = next((lines[i].strip() for i in range(number - 1, -1, -1) if lines[i].strip()), "")
            code = textwrap.dedent("\n".join(lines[number + 1 : end])) + "\n"
            found.append((number + 1, code, before == FRAGMENT))
    return found


def snippets(page: Path) -> list[str]:
    return [code for _, code, _ in blocks(page)]


DOC_BLOCKS = [(page, line, code, fragment) for page in PAGES for line, code, fragment in blocks(page)]


@pytest.fixture(scope="module")
def saved_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """A tiny tied Llama and an untied one, each saved with the tiny tokenizer."""
    folders = {}
    for kind in ("tied", "untied"):
        folder = folders[kind] = tmp_path_factory.mktemp(f"{kind}-checkpoint")
        model = tiny_model("llama")
        if kind == "untied":
            untie.untie_embeddings(model)
        model.save_pretrained(folder)
        tiny_tokenizer().save_pretrained(folder)
    return folders


def _placeholders(folder: Path, checkpoints: dict[str, Path]) -> dict:
    """What a block may use without defining it, made fresh for each block."""
    model = tiny_model("llama")
    args = tf.TrainingArguments(output_dir=str(folder / "out"), max_steps=2, per_device_train_batch_size=4,
                                report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True)  # fmt: skip
    return {
        "model": model,
        "args": args,
        "ds": ToyLMDataset(n=16),
        "tokenizer": tiny_tokenizer(),
        "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3),
        "accelerator": Accelerator(cpu=True),
        "loader": torch.utils.data.DataLoader(ToyLMDataset(n=8), batch_size=4),
        "checkpoint_dir": str(checkpoints["tied"]),
        "resume_from": None,
    }


def _command_line(code: str) -> list[str]:
    """The command line a block that parses one documents (`# python train.py --flag value ...`), else a minimal one."""
    shown = re.search(r"# python (\S+\.py)((?: --?\S+(?: [^-\s(]\S*)?)*)", code)
    return [shown[1], *shown[2].split()] if shown else ["train.py", "--output_dir", "out"]


@pytest.mark.parametrize(
    ("page", "line", "code", "fragment"),
    DOC_BLOCKS,
    ids=[f"{page.relative_to(ROOT)}:{line}" for page, line, *_ in DOC_BLOCKS],
)
def test_every_python_block_of_the_readme_and_the_guides_runs(page, line, code, fragment, saved_checkpoints, tmp_path,
                                                              monkeypatch):  # fmt: skip
    """Issue 78: the fine-tuning guide's PEFT block was a SyntaxError and its other blocks imported nothing. A fragment
    must parse; any other block runs on the placeholders alone. A block that resumes (`resume_from`) runs again from
    the folder its first run saved."""
    compiled = compile(code, f"{page.name}:{line}", "exec")
    if fragment:
        return
    for name, kind in CHECKPOINT_NAMES.items():
        code = code.replace(name, repr(str(saved_checkpoints[kind])))
    monkeypatch.chdir(tmp_path)  # a block writes its folders where it runs
    monkeypatch.setattr(sys, "argv", _command_line(code))
    compiled = compile(code, f"{page.name}:{line}", "exec")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compiled, _placeholders(tmp_path, saved_checkpoints))  # noqa: S102
        if "resume_from" in code:
            assert (tmp_path / "checkpoint").is_dir(), "a block that resumes saves the folder it resumes from"
            exec(compiled, {**_placeholders(tmp_path, saved_checkpoints), "resume_from": "checkpoint"})  # noqa: S102


def _tiny_checkpoint(vocabulary: str, folder: Path) -> torch.Tensor:
    """Save a tiny tied checkpoint and its tokenizer in `folder`; return its matrix."""
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(CHECKPOINTS[vocabulary]())
    with torch.no_grad():  # padding rows hold what pretraining left there: values no token's row has
        model.get_input_embeddings().weight[VOCAB:] = 5.0
    model.save_pretrained(folder)
    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens({"eos_token": "[SEP]"})  # an LM tokenizer's end of text (TRL appends it)
    tokenizer.save_pretrained(folder)
    return model.get_input_embeddings().weight.detach().clone()


def _write_training_text(folder: Path, new_tokens: list[str]) -> None:
    """Eight rows of text in which the guide's new tokens occur, as in data a user adds tokens for."""
    words = ["the", "The", "and", "of", "to", "in", "is"]
    rows = [{"text": " ".join([new_tokens[0], *words[i % 7 :], new_tokens[1]] * 2)} for i in range(8)]
    (folder / "train.jsonl").write_text("\n".join(json.dumps(row) for row in rows))


def _check_the_new_rows(model: tf.PreTrainedModel, matrix: torch.Tensor, new_ids: list[int]) -> None:
    """The matrix keeps every row it had (a padded one is not shrunk) and grows to fit the new ids where it must (the
    guide pads to a multiple of 64; any size that fits does); the new ids' rows start at the mean of the known tokens'
    rows in both roles, untied (not from old padding rows)."""
    rows = matrix.shape[0]
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert embedding.shape[0] >= max(rows, VOCAB + len(new_ids)), f"{rows} rows became {embedding.shape[0]}"
    assert torch.equal(embedding[:VOCAB], matrix[:VOCAB]) and not untie.is_tied(model)
    mean = matrix[:VOCAB].mean(dim=0).expand(len(new_ids), -1)
    for weight in (embedding, head):
        # mean_resizing draws within about 1e-6 of the mean; old padding rows hold 5.0
        assert torch.allclose(weight[new_ids], mean, atol=1e-4), f"the new rows start at {weight[new_ids]}"


@pytest.mark.parametrize("vocabulary", list(CHECKPOINTS))
def test_the_tied_checkpoint_guide_runs_and_does_what_it_says(vocabulary, tmp_path, monkeypatch):
    """Issue 69: resizing to len(tokenizer) shrank a padded matrix (the new ids then start from old padding rows), and
    the TRL snippet trained a model that was never resized (IndexError on an exact vocabulary) and saved no
    tokenizer."""
    pytest.importorskip("peft")
    pytest.importorskip("trl")
    code = snippets(GUIDE)
    assert len(code) == 4 and CHECKPOINT in code[0]
    matrix = _tiny_checkpoint(vocabulary, tmp_path / "checkpoint")
    monkeypatch.chdir(tmp_path)  # the snippets write my-model, sft, ... where they run
    namespace: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i, snippet in enumerate(code):
            exec(snippet.replace(CHECKPOINT, repr(str(tmp_path / "checkpoint"))), namespace)  # noqa: S102
            if i == 0:  # the tokens the guide added, found in its tokenizer whatever it calls them
                tokenizer = namespace["tokenizer"]
                new_tokens = [t for t in tokenizer.get_added_vocab() if t not in tiny_tokenizer().get_added_vocab()]
                new_tokens = [t for t in new_tokens if t != "[SEP]"]
                new_ids = tokenizer.convert_tokens_to_ids(new_tokens)
                assert len(new_tokens) == 2 and new_ids == [VOCAB, VOCAB + 1], (new_tokens, new_ids)
                _check_the_new_rows(namespace["model"], matrix, new_ids)
                _write_training_text(tmp_path, new_tokens)

    untied = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "my-checkpoint-untied")  # what the TRL route loads
    _check_the_new_rows(untied, matrix, new_ids)
    expected_rows = untied.get_input_embeddings().weight.shape[0]
    mean = matrix[:VOCAB].mean(dim=0)
    reloaded = namespace["reloaded"]
    assert reloaded.config.vocab_size == expected_rows and not untie.is_tied(reloaded)
    for folder in ("my-model", "my-model-sft"):  # each saved model comes with the tokenizer that has the new tokens
        assert tf.AutoTokenizer.from_pretrained(tmp_path / folder).convert_tokens_to_ids(new_tokens) == new_ids
    sft = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "my-model-sft")
    assert not untie.is_tied(sft) and sft.config.get_text_config().tie_word_embeddings is False
    assert sft.get_input_embeddings().weight.shape[0] == expected_rows
    trained = sft.get_output_embeddings().weight[new_ids]
    assert not torch.allclose(trained, mean.expand(2, -1)), "TRL trained the new tokens' head rows"


def test_the_fragment_marker_is_the_line_before_the_fence(tmp_path):
    """`<!-- fragment -->` on the nearest non-blank line before the fence marks a block (indented in a list item too);
    anywhere else it marks nothing."""
    page = tmp_path / "page.md"
    page.write_text(
        f"{FRAGMENT}\n\n```python\nx = 1\n```\n\n- item\n\n  {FRAGMENT}\n  ```python\n  y(...)\n  ```\n\n"
        f"{FRAGMENT}\n\ntext\n\n```python\nimport untie\n```\n"
    )
    assert [(code, fragment) for _, code, fragment in blocks(page)] == [
        ("x = 1\n", True),
        ("y(...)\n", True),
        ("import untie\n", False),
    ]
