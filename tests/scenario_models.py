"""Training loops whose operator sequence changes, for the sequence-change scenario tests.

Each ``Scenario`` builds a small model and runs one whole training iteration per call of ``step``
(micro-batches, backward, optional validation, loss scaling, optimizer step). ``run`` drives a scenario
with or without a ``Chameleon`` runtime and records, per iteration, the loss, every gradient, the
runtime's report and the profiler's comparison, so that tests can check detection and bit-identity.

``python -m tests.scenario_models`` prints the measured table used in ``docs/sequence-changes.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from chameleon_dist import Chameleon, EmulatedDevice
from chameleon_dist.profiler.signature import cosine_similarity
from tests.models import TinyAttentionBlock, TinyLM, lm_batch, lm_loss

VOCAB, HIDDEN, HEADS = 64, 32, 4
EVENT = 10  # first iteration of each scenario's event: the runtime is Stable by then (2 + 5 iterations)


# ---- models -----------------------------------------------------------------------------------------
class BranchyLM(TinyLM):
    """TinyLM with a data-dependent branch: when the batch's mean token id crosses ``threshold`` an extra
    attention block (``branch="block"``) or a single extra op (``branch="op"``, a tanh) runs."""

    def __init__(self, branch: str = "block", threshold: float = VOCAB / 2, **kwargs) -> None:
        super().__init__(**kwargs)
        self.branch = branch
        self.threshold = threshold
        self.refine = TinyAttentionBlock(kwargs.get("hidden", HIDDEN), kwargs.get("heads", HEADS), kwargs.get("dropout", 0.1))
        self.branch_taken = False

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        self.branch_taken = bool(tokens.float().mean() > self.threshold)
        if self.branch_taken:
            x = self.refine(x) if self.branch == "block" else torch.tanh(x)
        return F.linear(self.norm(x), self.embed.weight)


class TinyMoE(nn.Module):
    """Top-1 routing over ``experts`` small MLPs with index_select / gather / index_add: every expert runs
    every iteration (possibly on zero tokens), so the op sequence stays while the token counts vary."""

    def __init__(self, hidden: int, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden)) for _ in range(experts)
        )
        self.counts: tuple[int, ...] = ()
        self.blocked: tuple[int, ...] = ()  # experts the router may not pick (e.g. dropped for capacity)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        flat = x.reshape(b * s, h)
        # the same ops whether or not an expert is blocked: only the values of the penalty differ
        penalty = torch.tensor([float("-inf") if e in self.blocked else 0.0 for e in range(len(self.experts))])
        gate, choice = (self.router(flat) + penalty).softmax(dim=-1).max(dim=-1)
        out = torch.zeros_like(flat)
        counts = []
        for e, expert in enumerate(self.experts):
            index = (choice == e).nonzero().squeeze(1)
            counts.append(index.numel())
            y = expert(flat.index_select(0, index)) * gate.gather(0, index).unsqueeze(1)
            out = out.index_add(0, index, y)
        self.counts = tuple(counts)
        return out.reshape(b, s, h)


class MoELM(nn.Module):
    def __init__(self, vocab: int = VOCAB, hidden: int = HIDDEN, heads: int = HEADS, layers: int = 2, experts: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(TinyAttentionBlock(hidden, heads, 0.0) for _ in range(layers))
        self.moes = nn.ModuleList(TinyMoE(hidden, experts) for _ in range(layers))
        self.norms = nn.ModuleList(nn.LayerNorm(hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block, moe, norm in zip(self.blocks, self.moes, self.norms):
            x = block(x)
            x = x + moe(norm(x))
        return F.linear(self.norm(x), self.embed.weight)

    @property
    def counts(self) -> tuple[tuple[int, ...], ...]:
        return tuple(moe.counts for moe in self.moes)


# ---- the loss scaler --------------------------------------------------------------------------------
class LossScaler:
    """fp16-style dynamic loss scaling: scale the loss, unscale the gradients, skip the step and halve the
    scale when a gradient is not finite, double the scale after ``growth_interval`` good steps. The scale
    is a Python float, so growing or halving it runs no op."""

    def __init__(self, scale: float = 2.0**16, growth_interval: int = 4) -> None:
        self.scale = scale
        self.growth_interval = growth_interval
        self.good_steps = 0

    def scaled(self, loss: torch.Tensor, overflow: bool = False) -> torch.Tensor:
        # An injected overflow uses the same aten op (a multiply by a Python number) with an infinite factor.
        return loss * (float("inf") if overflow else self.scale)

    def step(self, optimizer: torch.optim.Optimizer, parameters: list[nn.Parameter]) -> bool:
        """Unscale, check, step or skip. Returns True when the step was skipped."""
        grads = [p.grad for p in parameters if p.grad is not None]
        with torch.no_grad():
            found = torch.zeros((), dtype=torch.bool)
            for grad in grads:
                grad.mul_(1.0 / self.scale)
                found = found | ~torch.isfinite(grad).all()
            overflow = bool(found.item())
        if overflow:
            self.scale /= 2
            self.good_steps = 0
            return True
        optimizer.step()
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= 2
            self.good_steps = 0
        return False


# ---- scenarios -----------------------------------------------------------------------------------------
@dataclasses.dataclass
class Scenario:
    """A model and one training iteration ``step(i, model, optimizer, state)`` (``i`` is 1-based; ``state``
    keeps what the loop wants to remember, e.g. the loss scaler); returns the iteration's loss."""

    name: str
    make_model: Callable[[], nn.Module]
    step: Callable[[int, nn.Module, torch.optim.Optimizer, dict], torch.Tensor]
    what_changes: str = ""
    momentum: float = 0.0
    lr: float = 0.05


def _lm(dropout: float = 0.0) -> Callable[[], nn.Module]:
    return lambda: TinyLM(vocab=VOCAB, hidden=HIDDEN, heads=HEADS, layers=2, dropout=dropout)


def _accumulate(model, i, micro_batches, seq=16, batch=4, batch_fn=lm_batch) -> torch.Tensor:
    """Forward and backward of ``micro_batches`` micro-batches (gradient accumulation)."""
    total = torch.zeros(())
    for micro in range(micro_batches):
        tokens, labels = batch_fn(i * 8 + micro, batch=batch, seq=seq, vocab=VOCAB)
        loss = lm_loss(model, tokens, labels) / micro_batches
        loss.backward()
        total += loss.detach()
    return total


def _plain(micro_batches=lambda i: 1, seq=lambda i: 16, batch_fn=lm_batch, before=None, after=None):
    def step(i, model, optimizer, state):
        if before is not None:
            before(i, model, state)
        optimizer.zero_grad()
        loss = _accumulate(model, i, micro_batches(i), seq=seq(i), batch_fn=batch_fn)
        if after is not None:
            after(i, model, state)
        optimizer.step()
        return loss

    return step


def steady() -> Scenario:
    return Scenario("steady (2 micro-batches, dropout)", _lm(dropout=0.1), _plain(micro_batches=lambda i: 2))


def loss_scaling(overflow_at: tuple[int, ...] = (EVENT,)) -> Scenario:
    """(a) A dynamic loss scaler; at ``overflow_at`` the scaled loss overflows, so the step is skipped."""

    def step(i, model, optimizer, state):
        scaler = state.setdefault("scaler", LossScaler())
        optimizer.zero_grad()
        tokens, labels = lm_batch(i, vocab=VOCAB)
        loss = lm_loss(model, tokens, labels)
        scaler.scaled(loss, overflow=i in overflow_at).backward()
        state.setdefault("skipped", []).append(scaler.step(optimizer, list(model.parameters())))
        state.setdefault("scale", []).append(scaler.scale)
        return loss.detach()

    return Scenario("a: loss-scale overflow, step skipped", _lm(), step,
                    "the optimizer step's ops are missing (all outside autograd)", momentum=0.9)


def validation(every: int = 5) -> Scenario:
    """(b) Every ``every`` iterations a validation forward pass under no_grad, inside the iteration."""

    def validate(i, model, state):
        if i % every == 0:
            model.eval()
            with torch.no_grad():
                tokens, labels = lm_batch(10_000 + i, batch=8, vocab=VOCAB)
                state.setdefault("val", []).append(lm_loss(model, tokens, labels))
            model.train()

    return Scenario("b: validation under no_grad", _lm(dropout=0.1), _plain(after=validate),
                    "a whole forward pass is added, outside autograd")


def branch(kind: str = "block", taken: tuple[int, ...] = (EVENT, EVENT + 1, EVENT + 2)) -> Scenario:
    """(c) BranchyLM; the batches of the ``taken`` iterations cross its threshold."""

    def batch_fn(index, batch, seq, vocab):
        tokens, labels = lm_batch(index, batch, seq, vocab // 2)
        if index // 8 in taken:  # tokens from the upper half of the vocabulary: the mean crosses vocab / 2
            return tokens + vocab // 2, labels + vocab // 2
        return tokens, labels

    def record(i, model, state):
        state.setdefault("taken", []).append(model.branch_taken)

    what = "an attention block (forward + backward) is added" if kind == "block" else "one tanh (forward + backward) is inserted"
    return Scenario(f"c: data-dependent branch ({'extra block' if kind == 'block' else 'one extra op'})",
                    lambda: BranchyLM(kind, vocab=VOCAB, hidden=HIDDEN, heads=HEADS, layers=2, dropout=0.0),
                    _plain(batch_fn=batch_fn, after=record), what)


def moe(blocked_at: tuple[int, ...] = (), lr: float = 0.002) -> Scenario:
    """(d) Top-1 MoE; at ``blocked_at`` iterations expert 2 of every layer is blocked (gets no token)."""

    def block(i, model, state):
        for layer in model.moes:
            layer.blocked = (2,) if i in blocked_at else ()

    def record(i, model, state):
        state.setdefault("counts", []).append(model.counts)

    if blocked_at:
        return Scenario("d: MoE routing, an expert gets no token", MoELM, _plain(before=block, after=record),
                        "same ops; one expert's tensors are empty", lr=lr)
    return Scenario("d: MoE routing, token counts vary", MoELM, _plain(before=block, after=record),
                    "same ops; per-expert tensor sizes change, their total does not", lr=lr)


def sequence_lengths(before: int = 16, after: int = 24) -> Scenario:
    """(e) Sequence length ``before`` until EVENT, then ``after``."""
    return Scenario(f"e: sequence length {before} -> {after}", _lm(), _plain(seq=lambda i: before if i < EVENT else after),
                    "same ops; every activation's size changes")


def micro_batches(before: int = 2, after: int = 3) -> Scenario:
    """(f) Gradient accumulation over ``before`` micro-batches until EVENT, then ``after``."""
    return Scenario(f"f: micro-batches {before} -> {after}", _lm(), _plain(micro_batches=lambda i: before if i < EVENT else after),
                    "a whole forward + backward is added")


@contextlib.contextmanager
def one_thread():
    """The models are tiny: intra-op threads only add stalls when other processes share the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# ---- the runner ------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Run:
    losses: list[torch.Tensor]
    grads: list[dict[str, torch.Tensor | None]]
    parameters: dict[str, torch.Tensor]
    reports: list = dataclasses.field(default_factory=list)  # IterationReport per iteration (with Chameleon)
    comparisons: list = dataclasses.field(default_factory=list)  # the profiler's Comparison per iteration
    signatures: list = dataclasses.field(default_factory=list)  # the profiler's Signature per iteration
    state: dict = dataclasses.field(default_factory=dict)

    @property
    def stages(self) -> list[str]:
        return [r.stage for r in self.reports]

    @property
    def differs(self) -> list[bool]:
        """Per iteration: the sequence differs at all from the reference (``sequence_differs``)."""
        return [r.sequence_differs for r in self.reports]

    @property
    def major(self) -> list[bool]:
        """Per iteration: the paper's test failed, a new policy is needed (``sequence_changed``)."""
        return [r.sequence_changed for r in self.reports]

    def reference_index(self, iteration: int) -> int:
        """Index (into ``signatures``) of the reference that ``iteration`` was compared with: the last WarmUp
        iteration before it."""
        return max(i for i in range(1, iteration) if self.stages[i - 1] == "warmup") - 1


def run(scenario: Scenario, iterations: int, chameleon: bool = True, config: dict | None = None, optimizer: str = "sgd",
        capacity_bytes: int = 10**9) -> Run:
    torch.manual_seed(0)
    model = scenario.make_model()
    if optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=scenario.lr, momentum=scenario.momentum)
    result = Run([], [], {})
    runtime = None
    if chameleon:
        runtime = Chameleon({"min_swap_bytes": 0, **(config or {})}, device=EmulatedDevice(capacity_bytes=capacity_bytes, host_op_s=1e-6))
        runtime.attach(model)
        runtime.watch_optimizer(opt)
        conclude = runtime.profiler.conclude

        def capture(*args, **kwargs):
            profile = conclude(*args, **kwargs)
            result.comparisons.append(profile.comparison)
            result.signatures.append(profile.signature)
            return profile

        runtime.profiler.conclude = capture  # observe the comparison's figures (the report has a subset)
    for i in range(1, iterations + 1):
        with runtime.iteration() if runtime is not None else contextlib.nullcontext():
            loss = scenario.step(i, model, opt, result.state)
        result.losses.append(loss.detach().clone())
        result.grads.append({n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()})
        if runtime is not None:
            assert runtime.last_report.iteration == i
            result.reports.append(runtime.last_report)
    result.parameters = {n: p.detach().clone() for n, p in model.named_parameters()}
    return result


def bits_equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Bit-for-bit equality (NaN payloads included), so overflowed gradients compare too."""
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        width = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(width), b.contiguous().view(width))
    return torch.equal(a, b)


def assert_bit_identical(with_chameleon: Run, without: Run) -> None:
    assert len(with_chameleon.losses) == len(without.losses)
    for i, (x, y) in enumerate(zip(with_chameleon.losses, without.losses), start=1):
        assert bits_equal(x, y), f"loss differs in iteration {i}: {x} vs {y}"
    for i, (gx, gy) in enumerate(zip(with_chameleon.grads, without.grads), start=1):
        assert gx.keys() == gy.keys()
        for name in gx:
            assert bits_equal(gx[name], gy[name]), f"gradient of {name} differs in iteration {i}"
    for name, p in with_chameleon.parameters.items():
        assert bits_equal(p, without.parameters[name]), f"parameter {name} differs after training"


SCENARIOS: dict[str, Callable[[], Scenario]] = {
    "a": loss_scaling,
    "b": validation,
    "c-block": lambda: branch("block"),
    "c-op": lambda: branch("op"),
    "d": moe,
    "d-empty-expert": lambda: moe(blocked_at=(EVENT,)),
    "e": sequence_lengths,
    "e-small": lambda: sequence_lengths(64, 65),
    "f": micro_batches,
}


def _table(iterations: int = 24) -> None:
    """The numbers of docs/sequence-changes.md: the profiler's comparison in iteration EVENT, and how many
    iterations after the last major change the runtime runs in Stable again."""
    torch.set_num_threads(1)
    print("| scenario | ops at EVENT (reference) | length change | op-pair cosine | positional cosine (the paper's) "
          "| saved-bytes change | differs | kind | Stable again |")
    print("|---|---|---|---|---|---|---|---|---|")
    for scenario in (make() for make in SCENARIOS.values()):
        result = run(scenario, iterations)
        c, r = result.comparisons[EVENT - 1], result.reports[EVENT - 1]
        majors = [i for i in range(1, iterations + 1) if result.major[i - 1]]
        again = "-"
        if majors:
            last = majors[-1]
            stable = next(i for i in range(last + 1, iterations + 1) if result.stages[i - 1] == "stable")
            again = f"{stable - last - 1} iterations after {', '.join(map(str, majors))}"
        reference = result.signatures[result.reference_index(EVENT)].relevant()
        positional = cosine_similarity(result.signatures[EVENT - 1].relevant(), reference)
        print(
            f"| {scenario.name} | {c.num_ops} ({c.reference_num_ops}) | {c.length_change:.1%} | {c.cosine:.3f} "
            f"| {positional:.3f} | {c.saved_bytes_change:.1%} | {r.sequence_differs} | {c.kind} | {again} |"
        )


if __name__ == "__main__":
    _table()
