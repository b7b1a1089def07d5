"""The executor: saved-tensor hooks that swap activations to the host and back."""

from chameleon_dist.executor.context import IterationContext, SwapCounters, SwapFigures
from chameleon_dist.executor.swap import SwapExecutor

__all__ = ["IterationContext", "SwapCounters", "SwapExecutor", "SwapFigures"]
