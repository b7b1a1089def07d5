"""``install``: Chameleon on one rank of a megatron-core job, driven by Megatron's own pipeline schedule.

A training script adds, after building its model chunks (and optimizer)::

    chameleon = install(model_chunks, config, process_groups=pg_collection, optimizer=optimizer)
    forward_backward = chameleon.wrap(get_forward_backward_func())

and calls ``forward_backward(...)`` exactly as before. Each call is one iteration of the rank's runtime: it
opens when the call begins and closes when ``optimizer.step()`` returns (or when the call returns, if no
optimizer was given). The schedule's forward and backward steps name each micro-batch and model chunk
(``schedule.py``); Megatron's parameters, DDP gradient (and, under the distributed optimizer, parameter)
buffers, ``GlobalMemoryBuffer`` workspaces (sequence-parallel all-gathers, MoE token dispatch) and the optimizer's
main parameters and state are never swapped, nor is anything packed while Megatron recomputes a layer inside
backward.

Failure (NOTE [One rank cannot retry alone]): a multi-rank job never retries an iteration. The error a rank
raises names its coordinates; the launcher (torchrun) then ends the other ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import warnings
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from chameleon_dist.config import ChameleonConfig
from chameleon_dist.config.errors import ConfigError
from chameleon_dist.config.loaders import load_config
from chameleon_dist.config.megatron_args import config_from_megatron_args
from chameleon_dist.device.base import Device
from chameleon_dist.integrations.megatron.cuda_on_cpu import CudaLiteralsToCpu
from chameleon_dist.integrations.megatron.schedule import ScheduleTracker, schedule_patches
from chameleon_dist.integrations.held_runtime import HeldRuntime
from chameleon_dist.integrations.open_iteration import SettingNames
from chameleon_dist.integrations.rank_agreement import SETTINGS_WAIT_S, Peers, agree_on_settings
from chameleon_dist.patching import PatchSet, apply_patches
from chameleon_dist.ranks import RankCoordinates, RankLogPrefix, RankOutOfMemoryError  # noqa: F401 (re-exported)
from chameleon_dist.runtime import Chameleon

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

logger = logging.getLogger(__name__)

MEGATRON_SETTINGS = SettingNames(capacity="device.capacity, --chameleon-device-capacity", budget="memory_budget",
                                 min_swap="min_swap_bytes", enable="--chameleon")

# NOTE [One rank cannot retry alone]
# A single-rank runtime retries an iteration that ran out of memory (``Chameleon.run_iteration``). In a
# Megatron job that is impossible: when one rank fails inside its forward or backward, its pipeline peers
# already wait on its sends and its tensor- and data-parallel peers on its collectives, and none of them
# can take back what they did. So on every rank: relief inside the op that allocates absorbs pressure (the
# dispatch layer, on a GPU and on the emulated device alike: NOTE [Relief inside the op] in
# device/dispatch.py; the executor releases held sources, evicts prefetches and swaps kept activations out
# synchronously), and the op runs once more; if the rank still cannot go on, the iteration
# is closed as failed and the rank raises ``RankOutOfMemoryError`` naming its coordinates. The process
# exits; torchrun sees a failed worker and stops the others, so the job ends instead of hanging in a
# collective (spawned ranks: the parent must stop the rest, as ``torch.multiprocessing.spawn`` does).


def coordinates_of(model_chunks: Sequence[nn.Module], process_groups: Any = None) -> RankCoordinates:
    """The rank's place from Megatron's ``ProcessGroupCollection`` (its ``tp``, ``pp`` and ``dp`` groups), or
    from ``parallel_state`` when None; ``vpp_size`` is the number of model chunks."""
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if process_groups is None:
        if not parallel_state.model_parallel_is_initialized():
            return RankCoordinates(rank=rank, world_size=world_size, vpp_size=len(model_chunks))
        sizes = {
            "tp": (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()),
            "pp": (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_world_size()),
            "dp": (parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()),
        }
    else:
        sizes = {}
        for name in ("tp", "pp", "dp"):
            group = getattr(process_groups, name, None)
            sizes[name] = (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))
    return RankCoordinates(
        rank=rank, world_size=world_size, tp_rank=sizes["tp"][0], tp_size=sizes["tp"][1], pp_rank=sizes["pp"][0],
        pp_size=sizes["pp"][1], dp_rank=sizes["dp"][0], dp_size=sizes["dp"][1], vpp_size=len(model_chunks),
    )


def _unwrapped(chunk: nn.Module) -> nn.Module:
    """The model inside Megatron's wrappers (``DistributedDataParallel`` keeps its gradient buffers in an
    attribute named ``buffers``, which hides ``nn.Module.buffers()``: the runtime attaches the inner model)."""
    while isinstance(chunk, (DistributedDataParallel, Float16Module)):
        chunk = chunk.module
    return chunk


def _gradient_buffers(model_chunks: Iterable[nn.Module]) -> list[torch.Tensor]:
    """The contiguous buffers of Megatron's ``DistributedDataParallel`` chunks (gradients, and parameters
    under the distributed optimizer)."""
    found = []
    for chunk in model_chunks:
        if not isinstance(chunk, DistributedDataParallel):
            continue
        for buffer in [*chunk.buffers, *chunk.expert_parallel_buffers]:
            found += [t for t in (buffer.grad_data, buffer.param_data) if t is not None]
    return found


def _optimizer_tensors(optimizer: Any) -> list[torch.Tensor]:
    """What an optimizer holds besides the model's parameters (none for a torch optimizer over them): a Megatron
    optimizer's fp32 main parameters (this rank's shards under the distributed optimizer; views of the parameter
    buffer for fp32 parameters) and the state of the torch optimizers inside it (made by the first step)."""
    found: list[torch.Tensor] = []
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        stepped = getattr(inner, "optimizer", None)  # a Megatron optimizer wraps a torch one
        if not isinstance(stepped, torch.optim.Optimizer):
            continue  # (a torch optimizer steps the model's own parameters: protected with the model)
        for group in stepped.param_groups:
            found += [p for p in group["params"] if isinstance(p, torch.Tensor)]
        for state in stepped.state.values():
            found += [t for t in state.values() if isinstance(t, torch.Tensor)]
    return found


def _workspaces() -> list[torch.Tensor]:
    if not parallel_state.model_parallel_is_initialized():
        return []
    return list(parallel_state.get_global_memory_buffer().buffer.values())


class MegatronChameleon(HeldRuntime):
    """The rank's runtime (``runtime``, a ``Chameleon``) and what a Megatron job needs around it: ``wrap`` for the
    schedule's ``forward_backward_func``, ``watch_step`` for the optimizer, the schedule's ``tracker``, and
    ``close``. Each call of the wrapped schedule opens one iteration of the runtime (``open_iteration``) that
    the optimizer step closes. Made by ``install``."""

    def __init__(self, runtime: Chameleon, cuda_literals_on_cpu: bool = False, peers: Peers | None = None) -> None:
        super().__init__(runtime, MEGATRON_SETTINGS)
        self.peers = peers  # where the job's ranks run (``agree_on_settings``): a failure names a dead peer
        self.tracker = ScheduleTracker(runtime.profiler.micro_batches, runtime.executor.protect_now)
        self._patches: PatchSet = apply_patches(schedule_patches(self.tracker))
        self._log_prefix = RankLogPrefix(runtime.coordinates)
        self._cuda_literals_on_cpu = cuda_literals_on_cpu
        self._steps_closing = False

    def start(self) -> "MegatronChameleon":
        self._log_prefix.install()
        self._patches.apply()
        return self

    def close(self) -> None:
        """Close an open iteration, take the schedule patches and the log prefix off (idempotent)."""
        self.open_iteration.finish()
        if self._patches.active:
            self._patches.restore()
        self._log_prefix.remove()

    # ---- the iteration ----------------------------------------------------------------------
    def wrap(self, forward_backward_func: Callable[..., Any]) -> Callable[..., Any]:
        """``forward_backward_func`` (from ``get_forward_backward_func()``) as one iteration per call; same
        arguments and result. A ``forward_only=True`` call (evaluation) is passed through untouched."""
        opened = self.open_iteration

        @functools.wraps(forward_backward_func)
        def forward_backward(*args: Any, **kwargs: Any) -> Any:
            literals = CudaLiteralsToCpu() if self._cuda_literals_on_cpu else contextlib.nullcontext()
            if kwargs.get("forward_only", False):
                with literals:
                    return forward_backward_func(*args, **kwargs)
            opened.begin()  # (closes the previous call's iteration if its optimizer step never came)
            self.tracker.begin()
            try:
                with literals:
                    result = forward_backward_func(*args, **kwargs)
            except Exception as exc:
                self._fail(exc)
            finally:
                self.tracker.end()
            if not self._steps_closing:
                opened.finish()
            return result

        return forward_backward

    def _fail(self, exc: Exception) -> None:
        """Close the iteration as failed and raise (``OpenIteration.fail``), first logging which peers of this
        host are gone: a survivor of a killed rank sees only a closed connection."""
        gone = self.peers.describe_gone() if self.peers is not None else None
        if gone is not None:
            logger.error("%s", gone)
        self.open_iteration.fail(exc)

    def watch_step(self, optimizer: Any) -> Any:
        """Make ``optimizer.step()`` (a torch or a Megatron optimizer) the end of the open iteration: it runs
        inside it, marked as the optimizer's ops, and closes it. Returns ``optimizer``."""
        original = optimizer.step
        opened = self.open_iteration

        @functools.wraps(original)
        def step(*args: Any, **kwargs: Any) -> Any:
            if not opened.active:
                return original(*args, **kwargs)
            try:
                with self.runtime.optimizer_phase():
                    result = original(*args, **kwargs)
            except Exception as exc:
                self._fail(exc)
            opened.finish()
            return result

        optimizer.step = step
        self._steps_closing = True
        return optimizer


def unsupported_features(model_chunks: Sequence[nn.Module], args: Any = None) -> list[str]:
    """What Chameleon refuses in these chunks' Megatron configs (or the parsed ``args``), one line per problem naming
    the Megatron-LM flag: context parallelism (megatron-core runs it only in Transformer Engine's attention; untested
    with Chameleon) and CUDA graphs (nothing can be swapped inside a capture)."""
    configs = [getattr(_unwrapped(chunk), "config", None) for chunk in model_chunks]
    sources = [c for c in [*configs, args] if c is not None]
    problems = []
    cp = max([int(getattr(c, "context_parallel_size", 1) or 1) for c in sources] + [1])
    if cp > 1:
        problems.append(f"--context-parallel-size {cp} (context_parallel_size) is not supported with Chameleon: "
                        "megatron-core's context parallelism runs only in Transformer Engine's attention and is "
                        "untested with swapping; use --context-parallel-size 1 (or --no-chameleon without install)")
    if any(getattr(c, "enable_cuda_graph", False) or getattr(c, "external_cuda_graph", False)
           or getattr(c, "cuda_graph_impl", "none") not in (None, "none") for c in sources):
        problems.append("CUDA graphs (--cuda-graph-impl, --enable-cuda-graph, --external-cuda-graph) are not "
                        "supported with Chameleon: nothing can be swapped inside a graph capture; turn them off")
    return problems


def _config(config: ChameleonConfig | dict | str | argparse.Namespace | None) -> ChameleonConfig | dict | str | None:
    return config_from_megatron_args(config) if isinstance(config, argparse.Namespace) else config


def install(
    model_chunks: nn.Module | Sequence[nn.Module],
    config: ChameleonConfig | dict | str | argparse.Namespace | None = None,
    process_groups: Any = None,
    *,
    optimizer: Any = None,
    device: Device | None = None,
    cuda_literals_on_cpu: bool = False,
    settings_wait_s: float = SETTINGS_WAIT_S,
) -> MegatronChameleon:
    """Install Chameleon on this rank and return its runtime.

    Args:
        model_chunks: the rank's model chunks as Megatron builds them (one per virtual pipeline stage),
            plain or wrapped in Megatron's ``DistributedDataParallel`` / ``Float16Module``.
        config: a ``ChameleonConfig``, dict, YAML/JSON path, None (defaults), or the parsed Megatron
            arguments (``add_megatron_args``: ``--chameleon-config`` plus the ``--chameleon-*`` overrides).
        process_groups: Megatron's ``ProcessGroupCollection`` (its ``tp``, ``pp``, ``dp`` groups), or None
            to read ``parallel_state``. Only read: the runtime never creates a group or a collective.
        optimizer: when given, its ``step()`` ends each iteration (``MegatronChameleon.watch_step``).
        device: the device to meter and swap on (default: made from ``config.device``).
        cuda_literals_on_cpu: run each schedule call under ``CudaLiteralsToCpu`` (megatron-core on a machine
            without CUDA; with the CPU patches of ``cuda_on_cpu`` applied).
        settings_wait_s: how long this rank waits for the others at the settings check (``rank_agreement``).

    Every rank of a multi-rank job must call ``install`` (``enabled: false`` where Chameleon only measures),
    with the same settings: each rank compares its config with every other rank's first.

    Raises:
        ConfigError: the config cannot be meant as written, a chunk does not fit the device, the chunks use
            what Chameleon does not support (``unsupported_features``: context parallelism, CUDA graphs), or
            the ranks' settings differ (naming each setting and the ranks) or some rank did not install within
            ``settings_wait_s``.
    """
    chunks = [model_chunks] if isinstance(model_chunks, nn.Module) else list(model_chunks)
    problems = unsupported_features(chunks, config if isinstance(config, argparse.Namespace) else None)
    if problems:
        raise ConfigError(problems)
    coordinates = coordinates_of(chunks, process_groups)
    settings = load_config(_config(config))
    peers = agree_on_settings(settings, wait_s=settings_wait_s)  # (every rank, before anything is built)
    runtime = Chameleon(settings, device=device, coordinates=coordinates)
    track = getattr(runtime.device, "track", None)  # the emulated device counts what it did not see made
    if track is not None:
        for buffer in [*_gradient_buffers(chunks), *_optimizer_tensors(optimizer)]:
            track(buffer)
    runtime.executor.protect(lambda: [*_gradient_buffers(chunks), *_workspaces(), *_optimizer_tensors(optimizer)])
    for chunk in chunks:
        runtime.attach(_unwrapped(chunk))
    integration = MegatronChameleon(runtime, cuda_literals_on_cpu=cuda_literals_on_cpu, peers=peers)
    if optimizer is not None:
        integration.watch_step(optimizer)
    integration.start()
    logger.info("installed on %s (%d model chunk%s)", coordinates.label, len(chunks), "" if len(chunks) == 1 else "s")
    return integration


@contextlib.contextmanager
def installed(*args: Any, **kwargs: Any) -> Iterator[MegatronChameleon]:
    """``install`` as a context manager: ``close`` on exit."""
    runtime = install(*args, **kwargs)
    try:
        yield runtime
    finally:
        runtime.close()
