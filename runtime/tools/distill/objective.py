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


def draft_step_logits(model, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """The logits of each draft step the student trains: an EAGLE head student unrolled over
    N chained steps gives N (step ``s``, 0-based, aligned with the teacher's logits from ``s``
    on); any other draft gives its one :func:`next_token_logits`."""
    chain = getattr(model, "chain_logits", None)
    return chain(input_ids) if chain is not None else [next_token_logits(model, input_ids)]


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


def chain_distillation_loss(
    step_logits: list[torch.Tensor],
    teacher_logits: torch.Tensor,
    width: int,
    *,
    temperature: float,
    top_k: int | None,
) -> torch.Tensor:
    """:func:`distillation_loss` of each draft step against the teacher's logits at the
    positions it predicts (step ``s`` drops the first ``s``), averaged over the steps."""
    losses = [
        distillation_loss(logits, teacher_logits[:, s:], width, temperature=temperature, top_k=top_k)
        for s, logits in enumerate(step_logits)
    ]
    return torch.stack(losses).mean()


@dataclass(frozen=True)
class HeldOutScore:
    """The draft against the adapted target on held-out text (teacher-forced, every position)."""

    kl: float  # mean KL(teacher ‖ draft) per position, nats, T = 1
    agreement: float  # share of positions where the draft's argmax is the teacher's
    positions: int
    # An unrolled head's agreement at each chained draft step (the first is ``agreement``);
    # empty for one step.
    step_agreement: tuple[float, ...] = ()


@torch.no_grad()
def score(
    teacher, student, sequences: torch.Tensor, width: int, *, batch_size: int, device: str, steps: int = 1
) -> HeldOutScore:
    """KL and top-1 agreement of ``student`` with ``teacher`` over ``sequences`` ``[n, seq]``;
    with ``steps`` > 1 (an EAGLE head student), also the agreement of each chained draft step."""
    was_training = student.training
    student.eval()
    kl_sum, positions = 0.0, 0
    agree, scored = [0] * steps, [0] * steps
    for start in range(0, sequences.shape[0], batch_size):
        ids = sequences[start : start + batch_size].to(device)
        teacher_logits = next_token_logits(teacher, ids)
        step_logits = student.chain_logits(ids, steps) if steps > 1 else [next_token_logits(student, ids)]
        kl_sum += float(kl_per_position(step_logits[0], teacher_logits, width).sum())
        positions += teacher_logits.shape[0] * teacher_logits.shape[1]  # the positions scored
        for s, logits in enumerate(step_logits):
            # The teacher's argmax over its whole vocabulary: a token the draft cannot score is a miss.
            want = teacher_logits[:, s:].argmax(-1)
            agree[s] += int((logits[..., :width].argmax(-1) == want).sum())
            scored[s] += want.numel()
    student.train(was_training)
    shares = tuple(a / max(n, 1) for a, n in zip(agree, scored, strict=True))
    return HeldOutScore(
        kl=kl_sum / max(positions, 1),
        agreement=shares[0],
        positions=positions,
        step_agreement=shares if steps > 1 else (),
    )
