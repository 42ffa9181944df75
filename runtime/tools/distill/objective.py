"""What the draft LoRA is trained on and measured by.

Training minimises the forward KL from the teacher (the adapted target) to the student
(the draft with its LoRA) over every position's next-token distribution, both softened by a
temperature T (scaled by T², so the gradient's size does not depend on T). Forward KL, the
teacher's expectation, is what a speculative draft wants: it puts probability wherever the
target does, which is where proposals get accepted.

Optionally the teacher is truncated to its top k tokens (renormalised): the KL then runs
over those k tokens only, and the teacher's softmax over a 128k vocabulary is never
materialised in float32. The tail the truncation drops is where the teacher puts little
mass; the draft's own softmax stays full, so it is still pushed off tokens the teacher
does not rank.

Measures, on held-out sequences, always at T = 1 and over the full vocabulary: the mean
KL per position and the top-1 agreement (the draft's argmax equals the teacher's), which
is what a greedy draft's accept rate follows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def next_token_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """``[batch, seq, vocab]`` logits of a causal LM for every position."""
    return model(input_ids=input_ids, use_cache=False).logits


def kl_per_position(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    width: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
) -> torch.Tensor:
    """KL(teacher ‖ student) at each position, ``[batch, seq]`` float32, over the first ``width`` logits."""
    log_q = F.log_softmax(student_logits[..., :width].float() / temperature, dim=-1)
    teacher = teacher_logits[..., :width]
    if top_k is None or top_k >= width:
        log_p = F.log_softmax(teacher.float() / temperature, dim=-1)
        return (log_p.exp() * (log_p - log_q)).sum(-1)
    values, index = teacher.topk(top_k, dim=-1)
    log_p = F.log_softmax(values.float() / temperature, dim=-1)
    return (log_p.exp() * (log_p - log_q.gather(-1, index))).sum(-1)


def distillation_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    width: int,
    *,
    temperature: float,
    top_k: int | None,
) -> torch.Tensor:
    """The scalar training loss: mean KL over positions, times T²."""
    kl = kl_per_position(student_logits, teacher_logits, width, temperature=temperature, top_k=top_k)
    return kl.mean() * temperature**2


@dataclass(frozen=True)
class HeldOutScore:
    """The draft against the adapted target on held-out text (teacher-forced, every position)."""

    kl: float  # mean KL(teacher ‖ draft) per position, nats, T = 1
    agreement: float  # share of positions where the draft's argmax is the teacher's
    positions: int


@torch.no_grad()
def score(
    teacher, student, sequences: torch.Tensor, width: int, *, batch_size: int, device: str
) -> HeldOutScore:
    """KL and top-1 agreement of ``student`` with ``teacher`` over ``sequences`` ``[n, seq]``."""
    was_training = student.training
    student.eval()
    kl_sum, agree, positions = 0.0, 0, 0
    for start in range(0, sequences.shape[0], batch_size):
        ids = sequences[start : start + batch_size].to(device)
        teacher_logits = next_token_logits(teacher, ids)
        student_logits = next_token_logits(student, ids)
        kl_sum += float(kl_per_position(student_logits, teacher_logits, width).sum())
        # The teacher's argmax over its whole vocabulary: a token the draft cannot score is a miss.
        agree += int((student_logits[..., :width].argmax(-1) == teacher_logits.argmax(-1)).sum())
        positions += teacher_logits.shape[0] * teacher_logits.shape[1]  # the positions scored
    student.train(was_training)
    return HeldOutScore(
        kl=kl_sum / max(positions, 1), agreement=agree / max(positions, 1), positions=positions
    )
