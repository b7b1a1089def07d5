"""``HeldRuntime``: what an integration's object (Megatron's ``install``, DeepSpeed's ``engine.chameleon``) holds
and shows of the rank's runtime.

An integration object is not a ``Chameleon``: it holds one (``runtime``) and the ``OpenIteration`` that its
framework's calls open and close (``open_iteration``), and it drives them only through their public methods
(``iteration``, ``retry_out_of_memory``, ``optimizer_phase``, ``attach``). What a user reads of the runtime
(``last_report``, ``last_trace``, ``stage``, ``config``, ``coordinates``, ``device``, ``executor``, ``profiler``,
``controller``) reads through to it.
"""

from __future__ import annotations

from typing import Any

from chameleon_dist.config import ChameleonConfig
from chameleon_dist.device.base import Device
from chameleon_dist.executor import SwapExecutor
from chameleon_dist.integrations.open_iteration import OpenIteration, SettingNames
from chameleon_dist.policy.selection import PolicyController
from chameleon_dist.profiler.online import OnlineProfiler
from chameleon_dist.ranks import RankCoordinates
from chameleon_dist.report import IterationReport
from chameleon_dist.runtime import Chameleon
from chameleon_dist.trace.stages import Stage


class HeldRuntime:
    """A rank's runtime held by an integration, with the iteration its framework's calls keep open."""

    def __init__(self, runtime: Chameleon, names: SettingNames) -> None:
        self.runtime = runtime
        self.open_iteration = OpenIteration(runtime, names)

    @property
    def last_report(self) -> IterationReport | None:
        return self.runtime.last_report

    @property
    def last_trace(self) -> Any:
        return self.runtime.last_trace

    @property
    def stage(self) -> Stage:
        return self.runtime.stage

    @property
    def config(self) -> ChameleonConfig:
        return self.runtime.config

    @property
    def coordinates(self) -> RankCoordinates:
        return self.runtime.coordinates

    @property
    def device(self) -> Device:
        return self.runtime.device

    @property
    def executor(self) -> SwapExecutor:
        return self.runtime.executor

    @property
    def profiler(self) -> OnlineProfiler:
        return self.runtime.profiler

    @property
    def controller(self) -> PolicyController:
        return self.runtime.controller
