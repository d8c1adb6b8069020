"""`untie.zero_tying` without DeepSpeed: the autograd tie that DeepSpeed's tied phase uses, on one process.

The DeepSpeed runs themselves (ZeRO 1-3, Trainer and Untier, 2 ranks) are in test_deepspeed.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from untie.surgery import untie_embeddings
from untie.testing import ToyLMDataset, tiny_model
from untie.zero_tying import ZeroTying, check_optimizer


def _loss(model) -> torch.Tensor:
    batch = ToyLMDataset(n=8)
    ids = torch.stack([batch[i]["input_ids"] for i in range(8)])
    return model(input_ids=ids, labels=ids).loss


def test_autograd_tying_gives_each_matrix_the_tied_gradient_over_sqrt2_and_the_tied_norm():
    tied = tiny_model("gpt2")
    tied.eval()
    emulated = tiny_model("gpt2")
    emulated.eval()
    untie_embeddings(emulated)
    tying = ZeroTying(emulated)
    loss_tied, loss_emulated = _loss(tied), _loss(emulated)
    loss_tied.backward()
    loss_emulated.backward()
    torch.testing.assert_close(loss_emulated, loss_tied, rtol=0, atol=0)
    shared = tied.get_input_embeddings().weight.grad
    embedding, head = emulated.get_input_embeddings().weight.grad, emulated.get_output_embeddings().weight.grad
    assert torch.equal(embedding, head)
    torch.testing.assert_close(embedding * math.sqrt(2.0), shared, rtol=1e-6, atol=1e-7)
    norm = torch.nn.utils.get_total_norm([p.grad for p in emulated.parameters() if p.grad is not None])
    tied_norm = torch.nn.utils.get_total_norm([p.grad for p in tied.parameters() if p.grad is not None])
    torch.testing.assert_close(norm, tied_norm, rtol=1e-6, atol=0)  # clipping sees the tied norm
    tying.release()  # no optimizer: only the forwards go back to each module's own parameter
    with torch.no_grad():
        emulated.get_output_embeddings().weight.mul_(2.0)
    assert not torch.allclose(_loss(emulated), loss_tied)  # the head now reads its own (changed) parameter


def test_autograd_tying_refuses_optimizers_whose_step_scales_with_the_gradient():
    model = tiny_model("gpt2")
    check_optimizer(torch.optim.AdamW(model.parameters()))
    with pytest.raises(ValueError, match="Adam-family optimizer.*SGD.*Use AdamW.*DDP or FSDP2"):
        check_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))


def test_autograd_tying_needs_a_head_of_its_own():
    with pytest.raises(ValueError, match="really tied.*untie_embeddings"):
        ZeroTying(tiny_model("gpt2"))
