"""Measure the extra memory of an untie (parameters + AdamW state) for a GPT-2-sized 50257 x 768 embedding.

python benchmarks/untie_memory.py [--vocab 50257] [--hidden 768]
"""

from __future__ import annotations

import argparse
import json

import torch
import transformers as tf

import untie


def tensor_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes held by distinct parameter storages and by optimizer state tensors."""
    params = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    tensors = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    state = sum(v.untyped_storage().nbytes() for v in tensors)
    return {"parameters": sum(params.values()), "optimizer_state": state}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--hidden", type=int, default=768)
    args = parser.parse_args()
    config = tf.GPT2Config(vocab_size=args.vocab, n_embd=args.hidden, n_layer=1, n_head=12, n_positions=32)
    model = tf.GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, args.vocab, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    before = tensor_bytes(model, optimizer)
    untie.untie_embeddings(model, optimizer, optimizer_state="copy")
    after = tensor_bytes(model, optimizer)
    matrix = args.vocab * args.hidden * 4  # fp32
    step_bytes = optimizer.state[model.lm_head.weight]["step"].untyped_storage().nbytes()
    result = {
        "matrix": f"{args.vocab}x{args.hidden} fp32",
        "measured_extra_parameter_bytes": after["parameters"] - before["parameters"],
        "measured_extra_optimizer_state_bytes": after["optimizer_state"] - before["optimizer_state"],
        "theoretical_extra_parameter_bytes": matrix,
        "theoretical_extra_optimizer_state_bytes": 2 * matrix + step_bytes,
    }
    result["measured_total_mib"] = round(
        (result["measured_extra_parameter_bytes"] + result["measured_extra_optimizer_state_bytes"]) / 2**20, 1
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
