"""Per-rank memory of one pipeline stage: model state, activations in flight, and the transients on top.

Activations follow Korthikanti et al. (arXiv 2205.05198) tensor by tensor, so that the same accounting
covers their GPT-3 layer (16-bit, dropout, GeLU, unfused attention: ``s b h (34 + 5 a s / h)`` bytes) and
the variants the planner meets: fp32, no dropout, SwiGLU (fused or not), grouped-query attention, MoE
experts, flash attention (no ``a s^2`` terms: what selective recomputation achieves). With sequence
parallelism every activation is divided by the TP degree; without it the norm inputs, the inputs of the
column-parallel linears and the dropout masks are replicated (``10 + 24 / t`` in the paper's terms).
With context parallelism each of the ``cp`` ranks holds ``s / cp`` tokens of every activation (flash
attention: no ``s x s`` tensor), and the model state is replicated across CP ranks, sharded by ZeRO over
the ``dp x cp`` ranks (Megatron's distributed optimizer uses the dp_cp group).
Selective recomputation drops the attention core; full recomputation keeps only each layer's input and
rebuilds one layer at a time in backward.

The peak is the largest of a few points in the iteration, each the model state plus what is alive there:
the start of backward (every activation in flight; on the last stage the head's and its backward
buffers), the forward of a layer (plus the score tensor of unfused attention), the backward of a layer
(the incoming gradient and the gradients being produced: its MLP half runs first, and once its saved
tensors are gone the attention half runs, which with unfused attention holds three score-sized tensors;
under recomputation the rebuilt activations of one layer), and the end of backward when gradients are
not a persistent buffer (every gradient exists, little else). ``python -m launch.reproduce_paper --validate``
checks these against the emulated device's measured peaks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from chameleon_dist.planner.layout import Layout, RecomputeMode, in_flight_chunks
from chameleon_dist.planner.profiles import ModelProfile, TrainingSetup

FP32_BYTES = 4
MASK_BYTES = 1  # a dropout mask element
INPUT_BYTES_PER_TOKEN = 8 + 8 + 8 + 4  # tokens, position ids, labels (int64), loss mask (fp32)


@dataclasses.dataclass(frozen=True)
class SavedTensor:
    """One activation autograd keeps for backward, per micro-batch, per rank."""

    name: str
    nbytes: int
    core: bool = False  # part of the attention core (dropped by selective recomputation)
    layer_input: bool = False  # the layer's input (what full recomputation keeps)
    mlp: bool = False  # saved by the MLP half of the layer (its backward runs first)


@dataclasses.dataclass(frozen=True)
class LayerActivations:
    """One transformer layer, one micro-batch, one rank."""

    tensors: tuple[SavedTensor, ...]
    recompute: RecomputeMode

    @property
    def full_bytes(self) -> int:
        """Saved without recomputation."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def core_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors if t.core)

    @property
    def input_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors if t.layer_input)

    @property
    def stored_bytes(self) -> int:
        """Kept from forward to backward by a layer that is not fully recomputed."""
        if self.recompute == RecomputeMode.SELECTIVE:
            return self.full_bytes - self.core_bytes
        return self.full_bytes

    @property
    def largest_bytes(self) -> int:
        return max(t.nbytes for t in self.tensors)

    @property
    def mlp_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors if t.mlp)

    def backward_gradient_bytes(self, unfused_attention: bool) -> tuple[int, int]:
        """Gradients a layer's backward holds at once beside its saved tensors, in its MLP half and in its
        attention half: the gradient of the largest tensor; for unfused attention, three score-sized
        tensors (the softmax gradient, and a clone and a masked copy in Megatron's unfused softmax
        backward, as measured on the CPU GPT)."""
        mlp = max((t.nbytes for t in self.tensors if t.mlp), default=0)
        attention = max((t.nbytes for t in self.tensors if not t.mlp and not t.core), default=0)
        if unfused_attention:
            attention = max(attention, 3 * max((t.nbytes for t in self.tensors if t.core), default=0))
        return mlp, attention

    def small_bytes(self, min_swap_bytes: int) -> int:
        """Stored tensors too small to be swapped."""
        return sum(t.nbytes for t in self.tensors if t.nbytes < max(1, min_swap_bytes))


def _norm_stats_bytes(model: ModelProfile) -> int:
    """Per token: mean and reciprocal std (LayerNorm) or the reciprocal RMS (RMSNorm), fp32."""
    return FP32_BYTES * (2 if model.normalization == "layernorm" else 1)


def layer_activations(model: ModelProfile, setup: TrainingSetup, tp: int, micro_batch: int,
                      recompute: RecomputeMode = RecomputeMode.NONE, cp: int = 1) -> LayerActivations:
    """What one layer saves for backward (see the module docstring), in bytes per rank (of ``cp`` context-
    parallel ranks, each holding ``seq_length / cp`` tokens)."""
    e = setup.activation_bytes
    tokens = setup.seq_length * micro_batch // cp
    sp = setup.sequence_parallel and tp > 1
    rep = tp if sp else 1  # divisor of the parts that sequence parallelism shards
    h, kv, f, a, s = model.hidden_size, model.kv_hidden_size, model.ffn_hidden_size, model.num_attention_heads, setup.seq_length
    drop = model.dropout > 0

    def t(name: str, per_token_bytes: float, divisor: int, **flags: bool) -> SavedTensor:
        return SavedTensor(name, int(per_token_bytes * tokens) // divisor, **flags)

    out = [
        t("norm1 input", h * e, rep, layer_input=True),
        t("norm1 statistics", _norm_stats_bytes(model), rep),
        t("qkv input", h * e, rep),
        t("query, key, value", (h + 2 * kv) * e, tp),
    ]
    if setup.attention == "unfused":
        out.append(t("attention probabilities", a * s * e, tp, core=True))
        if drop:
            out.append(t("attention dropout mask", a * s * MASK_BYTES, tp, core=True))
            out.append(t("attention dropout output", a * s * e, tp, core=True))
    else:
        out.append(t("attention log-sum-exp", a * FP32_BYTES, tp, core=True))
    out.append(t("projection input", h * e, tp))
    if drop:
        out.append(t("attention residual dropout mask", h * MASK_BYTES, rep))
    def m(name: str, per_token_bytes: float, divisor: int) -> SavedTensor:
        return t(name, per_token_bytes, divisor, mlp=True)

    out += [m("norm2 input", h * e, rep), m("norm2 statistics", _norm_stats_bytes(model), rep)]
    k = model.moe_router_topk if model.is_moe else 1
    if model.is_moe:
        out.append(m("router input", h * e, rep))
        out.append(m("router probabilities", model.num_experts * FP32_BYTES, rep))
        out.append(m("expert inputs", k * h * e, tp))
    else:
        out.append(m("fc1 input", h * e, rep))
    if model.activation == "gelu":
        out += [m("gelu input", k * f * e, tp), m("fc2 input", k * f * e, tp)]
    else:
        out.append(m("fc1 output (gate, up)", k * 2 * f * e, tp))
        if not setup.fused_swiglu:
            out.append(m("silu output", k * f * e, tp))
        out.append(m("fc2 input", k * f * e, tp))
    if drop:
        out.append(m("mlp dropout mask", h * MASK_BYTES, rep))
    return LayerActivations(tuple(t_ for t_ in out if t_.nbytes > 0), recompute)


def head_activations(model: ModelProfile, setup: TrainingSetup, tp: int, micro_batch: int,
                     cp: int = 1) -> tuple[SavedTensor, ...]:
    """The last stage's extras per micro-batch: final norm, output-layer input, fp32 softmax of the logits
    (vocab-parallel cross-entropy keeps it for backward)."""
    e, tokens = setup.activation_bytes, setup.seq_length * micro_batch // cp
    rep = tp if setup.sequence_parallel and tp > 1 else 1
    h, v = model.hidden_size, model.vocab_size
    return (
        SavedTensor("final norm input", h * e * tokens // rep),
        SavedTensor("final norm statistics", _norm_stats_bytes(model) * tokens // rep),
        SavedTensor("output layer input", h * e * tokens // rep),
        SavedTensor("logits softmax (fp32)", v * FP32_BYTES * tokens // tp),
    )


# ---- model state --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StageParams:
    """Parameters one rank of a stage holds (before ZeRO sharding)."""

    dense: int  # replicated over the data-parallel group
    experts: int  # replicated over the expert-data-parallel group (dp / ep)

    @property
    def total(self) -> int:
        return self.dense + self.experts


def stage_layers(model: ModelProfile, layout: Layout) -> int:
    return model.num_layers // layout.pp


def stage_params(model: ModelProfile, setup: TrainingSetup, layout: Layout, stage: int) -> StageParams:
    tp, layers = layout.tp, stage_layers(model, layout)
    norms = 2 * model.norm_params() + (model.hidden_size * model.num_experts if model.is_moe else 0)
    per_layer = (model.layer_dense_params() - norms) // tp + norms
    dense = layers * per_layer
    experts = layers * model.layer_expert_params() // (tp * layout.ep)
    if layout.holds_embedding(stage):
        dense += model.embedding_params(setup.seq_length) // tp
    if layout.holds_head(stage):
        dense += model.norm_params()
        # a tied output layer keeps its own copy where the embedding is not
        if not model.tie_embeddings or not layout.holds_embedding(stage):
            dense += model.vocab_size * model.hidden_size // tp
    return StageParams(dense, experts)


@dataclasses.dataclass(frozen=True)
class ModelState:
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


def model_state(params: StageParams, setup: TrainingSetup, layout: Layout) -> ModelState:
    """Bytes of parameters, gradients and optimizer state on one rank (ZeRO stage ``setup.zero_stage``;
    stage 1 is Megatron's distributed optimizer)."""
    dp, edp = layout.dp_cp, layout.dp_cp // layout.ep  # ZeRO shards over the dp x cp ranks
    zero = setup.zero_stage

    def sharded(count_bytes: float, dense: bool, from_stage: int) -> int:
        group = dp if dense else edp
        return int(count_bytes / group) if zero >= from_stage else int(count_bytes)

    param = sharded(params.dense * setup.param_bytes, True, 3) + sharded(params.experts * setup.param_bytes, False, 3)
    grad = sharded(params.dense * setup.grad_bytes, True, 2) + sharded(params.experts * setup.grad_bytes, False, 2)
    opt = (sharded(params.dense * setup.optimizer_bytes, True, 1)
           + sharded(params.experts * setup.optimizer_bytes, False, 1))
    return ModelState(param, grad, opt)


# ---- the stage's peak ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StageMemory:
    stage: int
    in_flight_chunks: int
    layers_in_flight: int  # layer activations stored at the start of backward
    state: ModelState
    workspace_bytes: int  # framework buffers and the micro-batch's inputs
    layer_full_bytes: int  # one layer, no recomputation
    layer_stored_bytes: int  # one layer that is not fully recomputed (what the swap policy may move)
    head_bytes: int  # last stage only
    activation_bytes: int  # stored activations at the start of backward
    transient_bytes: int  # the most that lives on top of the stored activations at any point
    peak_bytes: int
    peak_point: str
    grads_transient: bool  # gradients are not in ``state`` but appear during backward
    # what lives beside the stored activations during one op (the swap model's per-op curve)
    forward_extra_bytes: int = 0  # a layer's forward
    backward_extra_bytes: int = 0  # a (not recomputed) layer's backward, gradients of parameters excluded
    head_extra_bytes: int = 0  # the head's backward
    transient_grads_bytes: int = 0  # every gradient, when they are not a persistent buffer

    @property
    def static_bytes(self) -> int:
        """Model state and workspace: what swapping activations can never move."""
        return self.state.total_bytes + self.workspace_bytes

    def describe(self) -> str:
        gb = 1e9
        return (f"stage {self.stage}: peak {self.peak_bytes / gb:.1f} GB at {self.peak_point} = state "
                f"{self.state.total_bytes / gb:.1f} + workspace {self.workspace_bytes / gb:.2f} + activations "
                f"{self.activation_bytes / gb:.1f} ({self.layers_in_flight} layers in flight) + transient "
                f"{self.transient_bytes / gb:.2f} GB")


def workspace_bytes(model: ModelProfile, setup: TrainingSetup, layout: Layout) -> int:
    """Unfused attention in Megatron keeps a global buffer for the ``b (a/t) s s`` scores and the
    ``s x s`` boolean mask; every stage holds one micro-batch's inputs."""
    s, b = setup.seq_length, layout.micro_batch
    inputs = INPUT_BYTES_PER_TOKEN * s * b // layout.cp
    if setup.attention != "unfused":
        return inputs
    heads = model.num_attention_heads // layout.tp
    return inputs + b * heads * s * s * setup.activation_bytes + s * s


@dataclasses.dataclass(frozen=True)
class _StageLayers:
    """The stage's layer activations at the start of backward, as each residency rule reads them."""

    acts: LayerActivations  # one layer, one micro-batch
    chunks: int  # model chunks in flight
    per_chunk: int  # layers per chunk
    recomputed: int  # layers of each chunk rebuilt in backward
    mlp_grads_bytes: int  # gradients a layer's backward holds in its MLP half
    attention_grads_bytes: int  # ... and in its attention half

    @property
    def layers(self) -> int:
        return self.chunks * self.per_chunk


@dataclasses.dataclass(frozen=True)
class _Resident:
    """What of the stage's layer activations is on the device at the points the peak is taken at."""

    stored_bytes: int  # held from forward to backward (the head's excluded)
    active_bytes: int  # brought back ahead of use, on top of ``stored_bytes``
    layer_extra_bytes: int  # beside ``stored_bytes`` during a layer's backward, gradients included
    first_layer_bytes: int  # the first layer's, still there when the last gradients appear


def _kept(layers: _StageLayers, recompute: RecomputeMode) -> _Resident:
    """No swapping: every stored activation stays; a layer's backward holds its gradients, and under
    selective recomputation the rebuilt attention core, while its MLP half's tensors are already gone."""
    acts = layers.acts
    kept_layers = layers.per_chunk - layers.recomputed
    stored = layers.chunks * (layers.recomputed * acts.input_bytes + kept_layers * acts.stored_bytes)
    rebuilt_core = acts.core_bytes if recompute == RecomputeMode.SELECTIVE else 0
    layer_extra = max(layers.mlp_grads_bytes, rebuilt_core + layers.attention_grads_bytes - acts.mlp_bytes)
    return _Resident(stored, 0, layer_extra, acts.input_bytes if layers.recomputed else acts.stored_bytes)


def _swapped_everything(layers: _StageLayers, min_swap_bytes: int, prefetch_depth: int) -> _Resident:
    """The baseline executor: only tensors below ``min_swap_bytes`` stay; of the half being processed, what
    is in use or prefetched (``1 + prefetch_depth`` tensors at most) is back on the device."""
    acts = layers.acts
    small = acts.small_bytes(min_swap_bytes)
    active = min(acts.full_bytes, (1 + prefetch_depth) * acts.largest_bytes)
    largest_attention = max(t.nbytes for t in acts.tensors if not t.mlp)
    layer_extra = max(active + layers.mlp_grads_bytes,
                      min(acts.full_bytes - acts.mlp_bytes, (1 + prefetch_depth) * largest_attention)
                      + layers.attention_grads_bytes)
    return _Resident(layers.layers * small, active, layer_extra, small)


def stage_memory(model: ModelProfile, setup: TrainingSetup, layout: Layout, stage: int) -> StageMemory:
    """The per-rank peak of ``stage`` without swapping."""
    return _stage_memory(model, setup, layout, stage, lambda layers: _kept(layers, layout.recompute))


def stage_memory_swapping_everything(model: ModelProfile, setup: TrainingSetup, layout: Layout, stage: int,
                                     prefetch_depth: int = 2) -> StageMemory:
    """The per-rank peak of ``stage`` with the baseline executor that swaps every saved activation of at
    least ``setup.min_swap_bytes`` and brings back the next ``prefetch_depth`` ahead of use, so that at
    most one layer's, or ``1 + prefetch_depth`` tensors' worth, is on the device."""
    return _stage_memory(model, setup, layout, stage,
                         lambda layers: _swapped_everything(layers, setup.min_swap_bytes, prefetch_depth))


def _stage_memory(model: ModelProfile, setup: TrainingSetup, layout: Layout, stage: int,
                  resident: Callable[[_StageLayers], _Resident]) -> StageMemory:
    """The peak over the points of the module docstring; ``resident`` says what of the layer activations
    is on the device (the one thing swapping changes)."""
    m = layout.num_micro_batches(setup.global_batch_size)
    if m < 1:
        raise ValueError(f"global_batch_size {setup.global_batch_size} is smaller than dp x micro_batch "
                         f"({layout.dp} x {layout.micro_batch}); raise global_batch_size")
    last = layout.holds_head(stage)
    tp, b = layout.tp, layout.micro_batch
    acts = layer_activations(model, setup, tp, b, layout.recompute, cp=layout.cp)
    chunks = in_flight_chunks(stage, layout.pp, layout.vpp, m)
    per_chunk = stage_layers(model, layout) // layout.vpp
    layers = chunks * per_chunk
    recomputed = layout.recomputed_layers(per_chunk)
    head = sum(x.nbytes for x in head_activations(model, setup, tp, b, cp=layout.cp)) if last else 0
    params = stage_params(model, setup, layout, stage)
    state = model_state(params, setup, layout)
    grads_transient = not setup.persistent_grads and m == 1
    if grads_transient:
        state = dataclasses.replace(state, grad_bytes=0)
    all_grads = model_state(params, setup, layout).grad_bytes if grads_transient else 0
    one_layer_grads = all_grads // max(1, stage_layers(model, layout)) if grads_transient else 0
    e = setup.activation_bytes
    rep = tp if setup.sequence_parallel and tp > 1 else 1
    hidden_grad = model.hidden_size * e * setup.seq_length * b // rep // layout.cp
    output_grads = model.vocab_size * model.hidden_size * setup.grad_bytes // tp if grads_transient and last else 0
    core = acts.core_bytes if setup.attention == "unfused" else 0

    # On top of what is stored, a layer's backward holds the incoming gradient and the gradients it is
    # producing; the MLP half runs first and its saved tensors die before the attention half runs.
    mlp_grads, attention_grads = acts.backward_gradient_bytes(setup.attention == "unfused")
    stored_layer = acts.stored_bytes
    on_device = resident(_StageLayers(acts, chunks, per_chunk, recomputed, mlp_grads, attention_grads))
    stored, active, layer_extra = on_device.stored_bytes, on_device.active_bytes, on_device.layer_extra_bytes
    rebuilt_extra = 0
    if recomputed:  # the layer's activations are rebuilt from its input, then consumed as above
        rebuilt = acts.full_bytes - acts.input_bytes
        rebuilt_extra = max(rebuilt + mlp_grads, rebuilt - acts.mlp_bytes + attention_grads)
    head_extra = hidden_grad + output_grads if last else 0
    if last and setup.activation_bytes < FP32_BYTES:  # the logits in the model's dtype beside the fp32 copy
        head_extra += model.vocab_size * e * setup.seq_length * b // tp // layout.cp
    layer_grads = output_grads + one_layer_grads
    points = {  # (stored activations, transient on top of them)
        "the start of backward": (stored + head + active, head_extra),
        "the forward of a layer": (stored + active, core),
    }
    if recomputed < per_chunk:
        points["the backward of a layer"] = (stored, hidden_grad + layer_extra + layer_grads)
    if recomputed:  # block: the stored layers of this chunk are gone when its first layers rebuild
        points["the backward of a recomputed layer"] = (
            stored - (per_chunk - recomputed) * stored_layer, hidden_grad + rebuilt_extra + layer_grads)
    if grads_transient:
        points["the end of backward"] = (on_device.first_layer_bytes,
                                         hidden_grad + (rebuilt_extra if recomputed else layer_extra) + all_grads)
    point, (held, extra) = max(points.items(), key=lambda kv: sum(kv[1]))
    work = workspace_bytes(model, setup, layout)
    return StageMemory(
        stage=stage, in_flight_chunks=chunks, layers_in_flight=layers, state=state, workspace_bytes=work,
        layer_full_bytes=acts.full_bytes, layer_stored_bytes=stored_layer, head_bytes=head,
        activation_bytes=stored + head, transient_bytes=max(x for _, x in points.values()),
        peak_bytes=state.total_bytes + work + held + extra, peak_point=point, grads_transient=grads_transient,
        forward_extra_bytes=core, backward_extra_bytes=hidden_grad + layer_extra, head_extra_bytes=head_extra,
        transient_grads_bytes=all_grads,
    )


def rank_peaks(model: ModelProfile, setup: TrainingSetup, layout: Layout) -> list[StageMemory]:
    """The first and the last stage's memory. The stages between hold the same layers as the first, fewer
    micro-batches in flight and no embedding, so their peak is below the first stage's."""
    stages = sorted({0, layout.pp - 1})
    return [stage_memory(model, setup, layout, stage) for stage in stages]
