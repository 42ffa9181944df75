"""``bench/speculative``'s DFLASH training: which block labels count, and where blocks go."""

from __future__ import annotations

import torch

from bench.speculative.dflash_training import block_targets, sample_anchors


def test_a_label_counts_only_after_the_targets_own_greedy_tokens():
    """Block position ``j`` of anchor ``a`` is judged by serving only when tokens ``a + 1 ..
    a + j - 1`` were the target's greedy choices: labels after any other token are masked."""
    length, vocab, block = 12, 7, 5
    greedy = torch.tensor([(3 * i) % vocab for i in range(length)])  # the target's choice after token i
    logits = torch.nn.functional.one_hot(greedy, vocab).float()[None] * 5.0
    window = torch.zeros(1, length, dtype=torch.long)
    for i in range(length - 1):
        window[0, i + 1] = greedy[i]  # the target's own continuation ...
    window[0, 5] = (greedy[4] + 1) % vocab  # ... but token 5 is not its choice
    teacher, counts = block_targets(window, logits, torch.tensor([[1, 3, 5, 8]]), block)
    assert teacher.shape == (1, 4, block - 1, vocab)
    # anchor 1, position 1: the target's distribution after token 1
    assert torch.allclose(teacher[0, 0, 0].exp(), torch.softmax(logits[0, 1], -1))
    assert counts[0].tolist() == [
        [True, True, True, True],  # tokens 2..4 are the target's
        [True, True, False, False],  # token 5 is not: anchor 3's positions 3, 4 are never verified after it
        [True, True, True, True],  # anchor 5: its drafts follow token 5, whatever it was
        [True, True, True, True],  # the last anchor: its last label is the window's last row
    ]


def test_anchors_are_distinct_and_leave_room_for_the_labels():
    gen = torch.Generator().manual_seed(0)
    anchors = sample_anchors(64, 20, 4, 10, gen, first=3)
    assert anchors.min() >= 3 and anchors.max() <= 20 - 4 + 1  # the last label row is the window's last token
    assert all(len(set(row.tolist())) == 10 for row in anchors)
