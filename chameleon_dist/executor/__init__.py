"""The executor: saved-tensor hooks that swap activations to the host and back."""

from chameleon_dist.executor.swap import SwapCounters, SwapExecutor

__all__ = ["SwapCounters", "SwapExecutor"]
