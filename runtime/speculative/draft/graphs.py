"""What every draft's CUDA-graph runner shares beyond the target's :class:`GraphRunner`."""

from __future__ import annotations

from ...runner.graph_runner import GraphRunner


class DraftGraphRunner(GraphRunner):
    """Pads a draft's uniform forwards into static buffers and replays captured graphs.

    ``use_graphs=False`` runs the same padded static path eagerly (the CPU tests use it).
    A capture that fails turns graphs off for this runner (logged); forwards then run eagerly.
    """

    @property
    def disabled(self) -> bool:
        """A capture failed: :meth:`can_run` refuses every batch (the runner runs them eagerly)."""
        return self.capture_failures > 0

    def can_run(self, batch_size: int) -> bool:
        """Whether a forward of ``batch_size`` requests goes through the static path."""
        return not self.disabled and 0 < batch_size <= self.max_bs
