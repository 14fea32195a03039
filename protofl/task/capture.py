"""Training steps captured as CUDA graphs (run-config ``cuda-graphs``), and what such a step may
record: sums kept on the device, which a replay updates without the host."""

from __future__ import annotations

import collections
import contextlib
import threading
import warnings
from typing import Any, Callable, Hashable, Iterator, Literal, Protocol, Sequence, get_args

import torch

from protofl.task.losses import at_least_float32
from protofl.task.weights import copy_tensors

# the full-batch training step captured as a CUDA graph and replayed ("auto": on CUDA; never on a
# CPU), or every step launched eagerly ("off"); "static" runs the captured step's code with its
# static buffers but without a graph, on any device (tests compare it with the plain loop)
CudaGraphs = Literal["auto", "off", "static"]
CUDA_GRAPHS = get_args(CudaGraphs)
CAPTURE_WARMUP_STEPS = 2  # eager steps on a side stream before the capture (lazy CUDA and optimizer state)
KEPT_STEPS = 4  # captured steps a thread keeps for the next clients (one per kind of step it trained)


def resolve_cuda_graphs(cuda_graphs: CudaGraphs, device: torch.device) -> Literal["off", "captured", "static"]:
    """What ``cuda_graphs`` means on ``device``: ``"auto"`` captures on CUDA and is ``"off"`` elsewhere."""
    if cuda_graphs not in CUDA_GRAPHS:
        raise ValueError(f"cuda-graphs must be one of {CUDA_GRAPHS}, got {cuda_graphs!r}")
    if cuda_graphs == "auto":
        return "captured" if device.type == "cuda" else "off"
    return cuda_graphs


_uncapturable: set[str] = set()  # why captures failed, each logged once per process


class CaptureGate:
    """Keeps a capture alone in its process: :meth:`capture` waits until no other thread is inside
    :meth:`work` (a client's message, where a training worker runs several at once), and new work
    waits while a capture is waiting or running. CUDA work on other threads during a capture can
    break it (cuDNN internal errors were seen), whatever the capture's error mode. A thread that
    captures inside its own work lets it count as paused meanwhile."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._working = 0  # threads inside work()
        self._captures = 0  # captures waiting or running
        self._capturing = False
        self._inside = threading.local()

    @contextlib.contextmanager
    def work(self) -> Iterator[None]:
        with self._changed:
            self._changed.wait_for(lambda: not self._captures)
            self._working += 1
        self._inside.work = True
        try:
            yield
        finally:
            self._inside.work = False
            with self._changed:
                self._working -= 1
                self._changed.notify_all()

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        paused = getattr(self._inside, "work", False)
        with self._changed:
            self._working -= paused
            self._captures += 1
            self._changed.wait_for(lambda: not self._working and not self._capturing)
            self._capturing = True
        try:
            yield
        finally:
            with self._changed:
                self._capturing = False
                self._captures -= 1
                self._working += paused
                self._changed.notify_all()


CAPTURE_GATE = CaptureGate()  # this process's


class CapturedStep:
    """One training step for batches of one shape (``step(inputs, labels, *masks)``: forward, loss,
    backward, clipping, the optimizer step, the loss summed on the device), captured once as a
    CUDA graph and replayed for every later batch: each batch (and the dropout masks drawn for
    it) is copied into static input tensors, and the graph updates the weights and the optimizer
    state in place.

    The first :data:`CAPTURE_WARMUP_STEPS` calls run eagerly on a side stream (CUDA libraries and
    the momentum buffers are set up lazily). What ``step`` computes from Python state must not
    change between calls (the graph holds what it was at the capture), and it must not wait for
    the host (a synchronising call fails the capture: the step then runs eagerly, and the reason is
    logged once per process). The capture waits for the process's other clients' work
    (:data:`CAPTURE_GATE`): CUDA work on other threads during a capture can break it.
    ``static=True``: the same code without a graph (any device), each call running ``step`` on the
    static tensors.
    """

    def __init__(self, step: Callable[..., None], static: bool = False) -> None:
        self.step, self.static = step, static
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.tensors: list[torch.Tensor] | None = None  # the static inputs, labels, masks
        self.eager = False  # the capture failed

    def __call__(self, *tensors: torch.Tensor) -> None:
        self.calls += 1
        if self.eager:
            return self.step(*tensors)
        if not self.static and self.calls <= CAPTURE_WARMUP_STEPS:
            return self._on_side_stream(tensors)
        if self.tensors is None or (self.graph is None and len(self.tensors) != len(tensors)):
            self.tensors = [t.clone() for t in tensors]  # keeps the memory format
        else:
            for static, tensor in zip(self.tensors, tensors, strict=True):
                static.copy_(tensor)
        if self.static:
            return self.step(*self.tensors)
        if self.graph is None and not self._capture():
            return self.step(*tensors)
        self.graph.replay()

    def _on_side_stream(self, tensors: tuple[torch.Tensor, ...]) -> None:
        device = tensors[0].device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self.step(*tensors)
        torch.cuda.current_stream(device).wait_stream(side)

    def _capture(self) -> bool:
        """Capture the step on the static tensors (nothing runs yet); False when it cannot be."""
        graph = torch.cuda.CUDAGraph()
        try:
            # a stream of its own (torch.cuda.graph's default is one per process), alone in the
            # process (CAPTURE_GATE); thread_local: other threads' host work may use CUDA's API
            with CAPTURE_GATE.capture(), torch.cuda.graph(graph, stream=torch.cuda.Stream(self.tensors[0].device),
                                              capture_error_mode="thread_local"):
                self.step(*self.tensors)
        except RuntimeError as error:
            self.eager = True
            reason = str(error).splitlines()[0]
            if reason not in _uncapturable:
                _uncapturable.add(reason)
                warnings.warn(f"cuda-graphs: the training step cannot be captured ({reason}); it runs eagerly",
                              stacklevel=2)
            return False
        self.graph = graph
        return True

    def release(self) -> None:
        """Free the graph, then its static tensors (a graph must never outlive what it reads)."""
        self.graph = None
        self.tensors = None


class DeviceMeans:
    """Named means over batches (e.g. a method's loss parts), summed on the device without waiting
    for the host: a captured step's replays add to them. A name's sums are made by its first
    (eager) batch: a capture follows warm-up steps. Sums are in float32 at least: a part computed
    under bf16 autocast is a bfloat16 scalar, and a bfloat16 sum stops growing."""

    def __init__(self) -> None:
        self.sums: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name -> (sum, batches)

    def add(self, **values: torch.Tensor) -> None:
        for name, value in values.items():
            if name not in self.sums:
                self.sums[name] = (at_least_float32(value.new_zeros(())),
                                   torch.zeros((), dtype=torch.long, device=value.device))
            total, batches = self.sums[name]
            total.add_(value.detach())
            batches.add_(1)

    def means(self) -> dict[str, float]:
        return {name: float(total / batches) for name, (total, batches) in self.sums.items()}

    def step_key(self) -> Hashable:
        return ()

    def reset(self) -> None:
        for total, batches in self.sums.values():
            total.zero_()
            batches.zero_()

    def take(self, other: DeviceMeans) -> None:
        self.sums = {name: (total.clone(), batches.clone()) for name, (total, batches) in other.sums.items()}


class Accumulator(Protocol):
    """Sums a training step adds to on the device (:class:`DeviceMeans`, ``FeatureSums``)."""

    def step_key(self) -> Hashable:
        """The Python values the sums' code computes with (part of a kept step's key)."""

    def reset(self) -> None:
        """Zero every sum."""

    def take(self, other: Any) -> None:
        """Hold ``other``'s sums (another object of the same kind and key)."""


class StepState:
    """What a method's training step reads and writes besides the model and its optimizer, so that
    a captured step may train the next clients of its process (:class:`KeptStep`): ``constants``,
    the Python values the step computes with (hashable); ``inputs``, the tensors it reads (e.g.
    received prototypes), copied into the kept step's before a client's steps; ``accumulators``,
    the sums it adds to, zeroed before and taken back after."""

    def __init__(self, constants: Hashable = (), inputs: dict[str, torch.Tensor] | None = None,
                 accumulators: Sequence[Accumulator] = ()) -> None:
        self.constants, self.inputs, self.accumulators = constants, dict(inputs or {}), list(accumulators)

    def key(self) -> Hashable:
        inputs = tuple((name, tuple(t.shape), t.dtype) for name, t in sorted(self.inputs.items()))
        return self.constants, inputs, tuple((type(a), a.step_key()) for a in self.accumulators)


class KeptStep:
    """A captured training step kept after the client it was captured for: the model, optimizer,
    loss sum and :class:`StepState` of that client are its static tensors. A later client of the
    same key trains on it (:meth:`load`, the steps, :meth:`unload`): its model's tensors and
    inputs copied in, the momentum buffers and sums zeroed (a first step's momentum ``0 * m + g``
    is ``g``, as a fresh optimizer's), and the results copied back to its own objects."""

    def __init__(self, model: torch.nn.Module, tensors: dict[str, torch.Tensor], velocity: list,
                 total: torch.Tensor, step: Callable, captured: CapturedStep, state: StepState) -> None:
        self.model, self.tensors, self.velocity, self.total = model, tensors, velocity, total
        self.step, self.captured, self.state = step, captured, state

    @torch.no_grad()
    def load(self, tensors: dict[str, torch.Tensor], state: StepState) -> None:
        copy_tensors(self.tensors, tensors)
        copy_tensors(self.state.inputs, state.inputs)
        kept = [v for v in self.velocity if v is not None]
        if kept:
            torch._foreach_zero_(kept)
        self.total.zero_()
        for accumulator in self.state.accumulators:
            accumulator.reset()
        self.model.train()

    @torch.no_grad()
    def unload(self, tensors: dict[str, torch.Tensor], state: StepState) -> None:
        copy_tensors(tensors, self.tensors)
        for accumulator, kept in zip(state.accumulators, self.state.accumulators):
            accumulator.take(kept)


_kept = threading.local()  # per thread: key -> KeptStep, the most recently used last


def kept_step(key: Hashable) -> KeptStep | None:
    """The step this thread keeps for ``key`` (None: none)."""
    steps = getattr(_kept, "steps", None)
    if steps is None or key not in steps:
        return None
    steps.move_to_end(key)
    return steps[key]


def keep_step(key: Hashable, step: KeptStep) -> None:
    """Keep ``step`` for the next clients of this thread; the least recently used of more than
    :data:`KEPT_STEPS` is released."""
    steps = _kept.__dict__.setdefault("steps", collections.OrderedDict())
    steps[key] = step
    while len(steps) > KEPT_STEPS:
        steps.popitem(last=False)[1].captured.release()


def release_kept_steps() -> None:
    """Release every step this thread keeps (their graphs first, then their tensors)."""
    for step in getattr(_kept, "steps", {}).values():
        step.captured.release()
    _kept.__dict__.pop("steps", None)
