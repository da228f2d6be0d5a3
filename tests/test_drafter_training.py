"""Drafter training: the CFG-paired loss scores the distribution drafts are drawn from."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lantern_rt.models.drafter import Drafter, DrafterConfig
from lantern_rt.training.drafter import DrafterTraining, drafter_batch, eagle_loss, train_drafter
from tests.conftest import tiny_gpt
from tests.test_speculative import pattern_codes


def paired_batch(target, codes: torch.Tensor, labels: torch.Tensor):
    """Every image as a conditional row, then again as an unconditional row."""
    uncond = torch.arange(2 * len(codes)) >= len(codes)
    return drafter_batch(target, codes.repeat(2, 1), labels.repeat(2), uncond)


def test_paired_loss_is_cross_entropy_of_mixed_logits():
    """Mixing the two rows' logits by hand (u + s (c - u)) gives the loss's classification term."""
    target = tiny_gpt(3).eval()
    cfg = target.config
    drafter = Drafter(DrafterConfig.for_target(cfg), cfg).eval()
    codes, labels = pattern_codes(4, cfg.vocab_size, cfg.block_size, cfg.num_classes)
    batch = paired_batch(target, codes, labels)
    scale = 2.5
    with torch.no_grad():
        loss, vloss, ploss = eagle_loss(drafter, target.output, batch, 0.0, 0.1, cfg_scale=scale)
        tokens, h_in, positions, h_target = batch
        pred = drafter(tokens, h_in, positions)

        def mixed(h):
            logits = target.output(h).float()
            cond, uncond = logits[:4], logits[4:]
            return uncond + scale * (cond - uncond)

        expected_p = -(mixed(h_target).softmax(-1) * mixed(pred).log_softmax(-1)).sum(-1).mean()
        single_p = eagle_loss(drafter, target.output, batch, 0.0, 0.1)[2]
    torch.testing.assert_close(ploss, expected_p)
    torch.testing.assert_close(vloss, F.smooth_l1_loss(pred, h_target))
    torch.testing.assert_close(loss, vloss + 0.1 * expected_p)
    assert not torch.allclose(ploss, single_p)  # the per-row loss is another quantity


def test_paired_training_lowers_the_mixed_loss():
    target = tiny_gpt(5).eval()
    cfg = target.config
    codes, labels = pattern_codes(64, cfg.vocab_size, cfg.block_size, cfg.num_classes)
    drafter = Drafter(DrafterConfig.for_target(cfg), cfg)
    held_out = paired_batch(
        target, *pattern_codes(8, cfg.vocab_size, cfg.block_size, cfg.num_classes, seed=1)
    )

    with torch.no_grad():  # the cross-entropy's floor: the mixed target's own entropy
        logits = target.output(held_out[3]).float()
        p = (logits[8:] + 3.0 * (logits[:8] - logits[8:])).softmax(-1)
        entropy = -(p * p.log()).sum(-1).mean().item()

    def mixed_kl() -> float:
        with torch.no_grad():
            ce = eagle_loss(drafter.eval(), target.output, held_out, 0.0, 0.1, cfg_scale=3.0)[2].item()
        return ce - entropy

    before = mixed_kl()
    train_drafter(
        target,
        drafter,
        codes.numpy(),
        labels.numpy(),
        DrafterTraining(steps=80, batch=8, lr=3e-3, cfg_scale=3.0),
        progress=False,
    )
    after = mixed_kl()
    assert 0 < after < 0.6 * before
