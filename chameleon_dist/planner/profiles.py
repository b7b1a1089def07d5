"""Model, hardware and training-setup profiles for the planner, and their loaders.

Profiles are data (``configs/models/*.yaml``, ``configs/hardware/*.yaml``, shipped with the package: see
``chameleon_dist.config.shipped``); every number in a shipped profile carries its source in a comment.
Sizes and rates accept the project's size strings ("64GB", "25GB/s"). Loading problems are
:class:`~chameleon_dist.config.ConfigError` naming the setting.
"""

from __future__ import annotations

import difflib
import logging
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PositiveInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from chameleon_dist.config import ConfigError, read_mapping
from chameleon_dist.config.shipped import CONFIGS_DIR
from chameleon_dist.config.sizes import SizeError, parse_size_bytes
from chameleon_dist.models.shape import TransformerShape

logger = logging.getLogger(__name__)

MODELS_DIR = CONFIGS_DIR / "models"
HARDWARE_DIR = CONFIGS_DIR / "hardware"
CLUSTERS_DIR = CONFIGS_DIR / "clusters"  # cluster profiles (``chameleon_dist.planner.cluster``)

MODEL_KIND, HARDWARE_KIND = "model", "hardware"
DEFAULT_MEMORY_MARGIN = 0.05  # of usable device memory; why 5%: docs/planner.md, "Headroom and ties"
CLUSTER_KIND = "cluster"


def _parse_size(value: Any, per_second: bool) -> Any:
    """A size (or rate) string as bytes (per second); other values as they are."""
    if isinstance(value, str):
        try:
            return parse_size_bytes(value, per_second=per_second)
        except SizeError as exc:
            unit = 'a rate like "25GB/s"' if per_second else 'a size like "64GB"'
            raise ValueError(f"{exc}; use bytes{' per second' if per_second else ''} or {unit}") from None
    return value


def _size(per_second: bool):
    return BeforeValidator(lambda value: _parse_size(value, per_second))


Bytes = Annotated[int, _size(False), Field(gt=0)]
BytesPerS = Annotated[float, _size(True), Field(gt=0)]


class _Profile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: str
    name: str
    description: str = ""


class ModelProfile(_Profile):
    """A decoder-only transformer (dense or mixture-of-experts)."""

    kind: Literal["model"] = MODEL_KIND
    num_layers: PositiveInt
    hidden_size: PositiveInt
    num_attention_heads: PositiveInt
    num_query_groups: PositiveInt | None = None  # key/value heads (grouped-query attention); None: = heads
    ffn_hidden_size: PositiveInt
    vocab_size: PositiveInt
    seq_length: PositiveInt  # the training sequence length the profile is usually run at
    activation: Literal["gelu", "swiglu"] = "swiglu"
    normalization: Literal["layernorm", "rmsnorm"] = "rmsnorm"
    add_bias_linear: bool = False
    position_embedding: Literal["rope", "learned"] = "rope"
    tie_embeddings: bool = False
    num_experts: int = Field(0, ge=0)  # 0: dense MLP
    moe_router_topk: PositiveInt = 2
    dropout: float = Field(0.0, ge=0.0, lt=1.0)  # hidden and attention dropout

    @model_validator(mode="after")
    def _check(self) -> "ModelProfile":
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                             f"({self.num_attention_heads})")
        if self.num_attention_heads % self.query_groups:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                             f"num_query_groups ({self.query_groups})")
        if self.num_experts and self.moe_router_topk > self.num_experts:
            raise ValueError(f"moe_router_topk ({self.moe_router_topk}) exceeds num_experts ({self.num_experts})")
        return self

    # ---- shape ------------------------------------------------------------------------------
    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def kv_hidden_size(self) -> int:
        """Width of the key (and of the value) projection."""
        return self.hidden_size // self.num_attention_heads * self.query_groups

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def shape(self, micro_batch_size: int = 1) -> TransformerShape:
        """The dimensions, at the profile's ``seq_length``, with ``micro_batch_size`` sequences per micro-batch
        (the architecture fields, e.g. grouped-query attention or experts, stay here)."""
        return TransformerShape(
            num_layers=self.num_layers, hidden_size=self.hidden_size, num_attention_heads=self.num_attention_heads,
            ffn_hidden_size=self.ffn_hidden_size, vocab_size=self.vocab_size, seq_length=self.seq_length,
            micro_batch_size=micro_batch_size,
        )

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices of one MLP (expert): 2 for GeLU, 3 for SwiGLU (gate, up, down)."""
        return 3 if self.activation == "swiglu" else 2

    # ---- parameters -------------------------------------------------------------------------
    def attention_params(self) -> int:
        h, kv = self.hidden_size, self.kv_hidden_size
        bias = (h + 2 * kv + h) if self.add_bias_linear else 0
        return h * (h + 2 * kv) + h * h + bias

    def expert_params(self) -> int:
        """One MLP (one expert of an MoE layer)."""
        h, f = self.hidden_size, self.ffn_hidden_size
        bias = ((self.mlp_matrices - 1) * f + h) if self.add_bias_linear else 0
        return self.mlp_matrices * h * f + bias

    def norm_params(self) -> int:
        return self.hidden_size * (2 if self.normalization == "layernorm" else 1)

    def layer_dense_params(self) -> int:
        """Parameters of one layer outside the experts (attention, norms, router)."""
        router = self.hidden_size * self.num_experts if self.is_moe else 0
        mlp = 0 if self.is_moe else self.expert_params()
        return self.attention_params() + 2 * self.norm_params() + router + mlp

    def layer_expert_params(self) -> int:
        return self.num_experts * self.expert_params() if self.is_moe else 0

    def embedding_params(self, seq_length: int) -> int:
        positions = seq_length * self.hidden_size if self.position_embedding == "learned" else 0
        return self.vocab_size * self.hidden_size + positions

    def output_params(self) -> int:
        """Final norm and (unless tied) the output projection."""
        head = 0 if self.tie_embeddings else self.vocab_size * self.hidden_size
        return self.norm_params() + head

    def parameter_count(self, seq_length: int | None = None) -> int:
        seq = self.seq_length if seq_length is None else seq_length
        layer = self.layer_dense_params() + self.layer_expert_params()
        return self.num_layers * layer + self.embedding_params(seq) + self.output_params()


class HardwareProfile(_Profile):
    """One accelerator and the node it sits in."""

    kind: Literal["hardware"] = HARDWARE_KIND
    memory_bytes: Bytes  # device memory
    reserved_bytes: int = Field(0, ge=0)  # kept free for the runtime, allocator and fragmentation
    peak_flops_per_s: float = Field(gt=0)  # dense 16-bit peak
    efficiency: float = Field(gt=0, le=1)  # large-GEMM efficiency: the fraction of the peak a training GEMM reaches as it grows (planner/efficiency.py)
    # GEMM size (FLOPs of one kernel) at which a GEMM reaches half of ``efficiency`` (planner/efficiency.py);
    # 0: every GEMM runs at ``efficiency``
    gemm_half_efficiency_flops: float = Field(0.0, ge=0)
    # the fused (flash) attention kernel's fraction of the peak, forward and backward (planner/efficiency.py);
    # None: the attention core is priced as one batched GEMM on the GEMM curve
    attention_efficiency: float | None = Field(None, gt=0, le=1)
    memory_bytes_per_s: BytesPerS  # device memory (HBM) bandwidth, for the optimizer step
    h2d_bytes_per_s: BytesPerS  # host -> device, pinned memory
    d2h_bytes_per_s: BytesPerS  # device -> host, pinned memory
    h2d_concurrent_bytes_per_s: BytesPerS | None = None  # host -> device while device -> host also runs
    devices_per_node: PositiveInt = 8
    intra_node_bus_bytes_per_s: BytesPerS  # collective bus bandwidth inside a node (nccl-tests busbw)
    inter_node_bus_bytes_per_s: BytesPerS  # collective bus bandwidth per device across nodes
    host_memory_bytes: Bytes  # host RAM per node
    host_swap_fraction: float = Field(0.5, gt=0, le=1)  # of host RAM that swapped activations may use
    # Inputs with no source at hand: field -> (low, high), a plausible range around the profile's value, over
    # which ``chameleon-plan --sensitivity`` and the reproduction report their speedups.
    assumed: dict[str, tuple[float, float]] = Field(default_factory=dict)
    # Megatron's communication-overlap switches as this cluster runs them (None: Megatron's default,
    # MEGATRON_OVERLAP_DEFAULTS); the CLI's --[no-]overlap-... flags override them.
    overlap_grad_reduce: bool | None = None
    overlap_param_gather: bool | None = None
    tp_comm_overlap: bool | None = None
    overlap_p2p_comm: bool | None = None
    # compute-model calibration (``planner/calibration.py`` sets these from measured layer and head times)
    backward_to_forward: float = Field(2.0, gt=0)  # a layer's backward time over its forward time
    head_flops_per_s: float | None = Field(None, gt=0)  # the output layer's rate; None: the layers' effective rate
    head_backward_to_forward: float = Field(2.0, gt=0)  # the output layer's backward over its forward

    @model_validator(mode="before")
    @classmethod
    def _assumed_sizes(cls, data: Any) -> Any:
        """Ranges of byte or rate fields accept the same size strings as the fields ("1TB", "20GB/s")."""
        if not (isinstance(data, dict) and isinstance(data.get("assumed"), dict)):
            return data
        ranges = {}
        for name, bounds in data["assumed"].items():
            if name not in ASSUMABLE_INPUTS:
                raise ValueError(f"assumed: {name!r} is not a numeric hardware input; use one of "
                                 f"{', '.join(ASSUMABLE_INPUTS)}")
            if not (isinstance(bounds, (list, tuple)) and len(bounds) == 2):
                raise ValueError(f"assumed.{name}: give [low, high], got {bounds!r}")
            try:
                ranges[name] = tuple(_parse_size(bound, name.endswith("_per_s")) for bound in bounds)
            except ValueError as exc:
                raise ValueError(f"assumed.{name}: {exc}") from None
        return {**data, "assumed": ranges}

    @model_validator(mode="before")
    @classmethod
    def _reserved_size(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("reserved_bytes"), str):
            data = dict(data)
            data["reserved_bytes"] = parse_size_bytes(data["reserved_bytes"])
        return data

    @model_validator(mode="after")
    def _check(self) -> "HardwareProfile":
        if self.reserved_bytes >= self.memory_bytes:
            raise ValueError(f"reserved_bytes ({self.reserved_bytes}) must be below memory_bytes ({self.memory_bytes})")
        for name, (low, high) in self.assumed.items():
            value = getattr(self, name)
            if value is None or not 0 < low <= value <= high:
                raise ValueError(f"assumed.{name}: the range [{low:g}, {high:g}] must be positive and hold the "
                                 f"profile's {name} ({value})")
        return self

    @property
    def usable_bytes(self) -> int:
        """Device memory the job may fill: capacity minus the reserve."""
        return self.memory_bytes - self.reserved_bytes

    @property
    def effective_flops_per_s(self) -> float:
        return self.peak_flops_per_s * self.efficiency

    @property
    def swap_h2d_bytes_per_s(self) -> float:
        """Host -> device rate while swap-outs run at the same time (the 1F1B steady state)."""
        return self.h2d_concurrent_bytes_per_s or self.h2d_bytes_per_s

    def host_swap_budget_bytes(self) -> int:
        """Host memory one device may fill with swapped activations."""
        return int(self.host_memory_bytes * self.host_swap_fraction) // self.devices_per_node


ASSUMABLE_INPUTS = (
    "memory_bytes", "reserved_bytes", "peak_flops_per_s", "efficiency", "memory_bytes_per_s", "h2d_bytes_per_s",
    "d2h_bytes_per_s", "h2d_concurrent_bytes_per_s", "intra_node_bus_bytes_per_s", "inter_node_bus_bytes_per_s",
    "host_memory_bytes", "host_swap_fraction", "gemm_half_efficiency_flops", "attention_efficiency",
)  # the numeric HardwareProfile fields an ``assumed`` range may cover


class TrainingSetup(BaseModel):
    """How the job trains, beyond the layout the planner searches."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    global_batch_size: PositiveInt  # sequences per iteration
    seq_length: PositiveInt
    precision: Literal["bf16", "fp16", "fp32"] = "bf16"
    zero_stage: int = Field(1, ge=0, le=3)  # 1: Megatron's distributed optimizer / ZeRO-1
    attention: Literal["flash", "unfused"] = "flash"
    sequence_parallel: bool = True  # with TP > 1 (Megatron's recommendation)
    persistent_grads: bool = True  # a gradient buffer that lives all iteration (Megatron DDP)
    fused_swiglu: bool = True  # SwiGLU saves its input only (bias_swiglu_fusion)
    # Megatron's ``--tp-comm-overlap`` (a bool: each TP collective hidden under the GEMM it is paired with),
    # or, as before, a number: the fraction of the TP communication left after that hidden (superseded).
    tp_comm_overlap: bool | float = False
    dp_comm_overlap: float = Field(0.0, ge=0, le=1)  # extra fraction of the exposed gradient reduction hidden
    min_swap_bytes: int = Field(0, ge=0)
    # Of the usable device memory, what every plan must leave free (docs/planner.md, "Headroom"): allocator
    # fragmentation, communication buffers and what else a real job allocates that the model does not see.
    memory_margin: float = Field(DEFAULT_MEMORY_MARGIN, ge=0, lt=1)
    # Megatron's switches (megatron/training/arguments.py; defaults in MEGATRON_OVERLAP_DEFAULTS)
    overlap_grad_reduce: bool = False  # the gradient reduce-scatter/all-reduce under the last backward
    overlap_param_gather: bool = False  # the distributed optimizer's parameter all-gather under the first forward
    overlap_p2p_comm: bool = True  # interleaved schedule only: PP sends/receives under the next chunk's compute

    def budget_bytes(self, hardware: HardwareProfile) -> int:
        """Device bytes a plan may fill: the hardware's usable memory less the memory margin."""
        return int(hardware.usable_bytes * (1 - self.memory_margin))

    @field_validator("tp_comm_overlap", mode="before")
    @classmethod
    def _tp_overlap_kind(cls, value: Any, info: ValidationInfo) -> Any:
        """A bool stays Megatron's switch (which needs sequence parallelism: Megatron asserts it); any other
        number is the old hidden fraction, in [0, 1]."""
        if value is True and not info.data.get("sequence_parallel", True):
            raise ValueError("Megatron's TP communication overlap needs sequence parallelism; drop "
                             "--no-sequence-parallel or add --no-tp-comm-overlap")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return value
        if not 0 <= value <= 1:
            raise ValueError(f"a hidden fraction must be in [0, 1], got {value}; or true/false for Megatron's switch")
        return float(value)

    @field_validator("overlap_param_gather")
    @classmethod
    def _param_gather_needs(cls, value: bool, info: ValidationInfo) -> bool:
        """The combinations Megatron refuses (megatron/training/arguments.py asserts)."""
        if value and not info.data.get("overlap_grad_reduce", False):
            raise ValueError("Megatron needs --overlap-grad-reduce with --overlap-param-gather; add "
                             "--overlap-grad-reduce or --no-overlap-param-gather")
        if value and info.data.get("zero_stage", 1) < 1:
            raise ValueError("Megatron overlaps the parameter all-gather of the distributed optimizer only "
                             "(zero_stage >= 1); raise --zero-stage or add --no-overlap-param-gather")
        return value

    @property
    def tp_comm_hidden_fraction(self) -> float:
        """The old fraction of the (modelled) exposed TP communication hidden on top; 0 with the bool switch."""
        return 0.0 if isinstance(self.tp_comm_overlap, bool) else self.tp_comm_overlap

    @property
    def tp_comm_gemm_overlap(self) -> bool:
        """Megatron's --tp-comm-overlap: TP collectives hidden under their paired GEMMs."""
        return self.tp_comm_overlap is True

    @property
    def activation_bytes(self) -> int:
        """Bytes per activation element."""
        return 4 if self.precision == "fp32" else 2

    @property
    def param_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    @property
    def grad_bytes(self) -> int:
        """Gradient buffer element (mixed precision keeps fp32 main gradients)."""
        return 4

    @property
    def optimizer_bytes(self) -> int:
        """Adam state per parameter: m and v, plus an fp32 master copy in mixed precision."""
        return 8 if self.precision == "fp32" else 12


OVERLAP_SWITCHES = ("overlap_grad_reduce", "overlap_param_gather", "tp_comm_overlap", "overlap_p2p_comm")
MEGATRON_OVERLAP_DEFAULTS = MappingProxyType({
    # megatron/training/arguments.py: --overlap-grad-reduce, --overlap-param-gather and (from
    # ModelParallelConfig) --tp-comm-overlap are off unless given; --no-overlap-p2p-communication
    # (dest overlap_p2p_comm) is store_false, so it is on, and Megatron turns it off without interleaving.
    "overlap_grad_reduce": False, "overlap_param_gather": False, "tp_comm_overlap": False, "overlap_p2p_comm": True,
})


def overlap_settings(hardware: HardwareProfile, **given: bool | None) -> dict[str, bool]:
    """Megatron's overlap switches for a setup: each the given value (the CLI's), else the hardware
    profile's, else Megatron's default."""
    unknown = set(given) - set(OVERLAP_SWITCHES)
    if unknown:
        raise ConfigError([f"{name}: not an overlap switch; use one of {', '.join(OVERLAP_SWITCHES)}"
                           for name in sorted(unknown)])
    out = {}
    for name in OVERLAP_SWITCHES:
        for value in (given.get(name), getattr(hardware, name), MEGATRON_OVERLAP_DEFAULTS[name]):
            if value is not None:
                out[name] = value
                break
    return out


def make_setup(**settings: Any) -> TrainingSetup:
    """A ``TrainingSetup``; problems are one ConfigError naming each setting."""
    try:
        return TrainingSetup(**settings)
    except ValidationError as exc:
        raise ConfigError.from_validation_error(exc, model=TrainingSetup) from None


# ---- loading ---------------------------------------------------------------------------------
_KINDS = MappingProxyType({MODEL_KIND: ModelProfile, HARDWARE_KIND: HardwareProfile})
_DIRS = MappingProxyType({MODEL_KIND: MODELS_DIR, HARDWARE_KIND: HARDWARE_DIR, CLUSTER_KIND: CLUSTERS_DIR})
_OPTIONS = MappingProxyType({MODEL_KIND: "--model", HARDWARE_KIND: "--hardware", CLUSTER_KIND: "--cluster"})


def _profile_class(kind: Any) -> type[_Profile] | None:
    """The class of a profile kind; a cluster's lives in ``cluster.py``, which builds on this module."""
    if kind == CLUSTER_KIND:
        from chameleon_dist.planner.cluster import ClusterProfile

        return ClusterProfile
    return _KINDS.get(kind)


def _validate(data: dict[str, Any], cls: type[_Profile], source: str) -> _Profile:
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise ConfigError.from_validation_error(exc, source=source, model=cls) from None


def load_profile(path: str | Path) -> _Profile:
    """A profile file; its ``kind`` (model, hardware or cluster) says which."""
    data = read_mapping(path, what="planner profile")
    kind = data.get("kind")
    cls = _profile_class(kind)
    if cls is None:
        raise ConfigError([f"kind: {kind!r} is not a planner profile kind; use one of {', '.join(_DIRS)}"],
                          source=str(path))
    return _validate(data, cls, str(path))


def shipped_names(kind: str) -> list[str]:
    return sorted(p.stem for p in _DIRS[kind].glob("*.yaml"))


def _load_named(name_or_path: str | Path, kind: str) -> _Profile:
    path = Path(name_or_path)
    if path.suffix.lower() not in (".yaml", ".yml", ".json"):
        path = _DIRS[kind] / f"{name_or_path}.yaml"
        if not path.is_file():
            names = shipped_names(kind)
            close = difflib.get_close_matches(str(name_or_path), names, n=1, cutoff=0.5)
            hint = f"did you mean {close[0]!r}? " if close else ""
            option = _OPTIONS[kind]
            raise ConfigError([f"{option}: no {kind} profile {str(name_or_path)!r}; {hint}shipped: "
                               f"{', '.join(names)}, or pass a path to a .yaml file"])
    profile = load_profile(path)
    if profile.kind != kind:
        raise ConfigError([f"kind: this is a {profile.kind} profile, expected a {kind} profile"], source=str(path))
    return profile


def load_model(name_or_path: str | Path) -> ModelProfile:
    """A shipped model (``llama2-7b``) or a profile file."""
    return _load_named(name_or_path, MODEL_KIND)  # type: ignore[return-value]


def load_hardware(name_or_path: str | Path) -> HardwareProfile:
    """A shipped accelerator (``ascend-910b``) or a profile file."""
    return _load_named(name_or_path, HARDWARE_KIND)  # type: ignore[return-value]
