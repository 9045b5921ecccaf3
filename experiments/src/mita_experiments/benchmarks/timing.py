"""Time and peak memory of one attention call, forward or forward+backward, on CPU or CUDA.

Time is the median of repeated calls after warm-up; the repeat count adapts to a time
budget per point. Peak memory is measured in a separate, untimed call:

- CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus the
  memory allocated before the call.
- CPU: torch keeps no CPU peak counter, so the call runs under
  ``torch.profiler.profile(profile_memory=True)``; every allocation and free the CPU
  allocator reports is summed in time order and the peak of that running sum is the
  peak above the start. Memory held outside torch's allocator (the Python heap, the
  BLAS library's scratch buffers) is not seen.

Both report bytes on top of what existed before the call; :func:`measure` adds the
inputs (q, k, v and, for forward+backward, the upstream gradient) to give the peak
footprint of the step.

Whole models are timed side by side by :func:`alternating_rounds` (``mita bench vit``,
``mita bench video``): each round times one call of every variant in turn, so all see the
same machine load, and count the minor page faults of each timed call (the process's, all its
threads: each is a page of fresh memory touched for the first time, about 1 µs on the VMs measured;
which calls fault depends on the C allocator's heap, see docs/performance.md, "Fresh memory").
:func:`measure_side_by_side` does the same for attention calls
(``mita bench --rounds R``): on a machine whose speed drifts (a shared VM), a ratio of two
medians taken minutes apart moves with the drift, one of medians over the same rounds much less.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

try:
    import resource  # POSIX
except ImportError:  # Windows: no fault counts
    resource = None  # type: ignore[assignment]

MODES = ("fwd", "fwdbwd")
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Case:
    """The shapes of one measurement: q, k, v are (batch, heads, n, head_dim) of ``dtype`` on ``device``."""

    batch: int
    heads: int
    n: int
    head_dim: int
    dtype: str = "float32"
    device: str = "cpu"

    @property
    def tensor_bytes(self) -> int:
        """Bytes of one (batch, heads, n, head_dim) tensor."""
        return self.batch * self.heads * self.n * self.head_dim * DTYPES[self.dtype].itemsize

    def reference_bytes(self, mode: str) -> int:
        """q, k, v and the output, plus their four gradients in forward+backward."""
        return (4 if mode == "fwd" else 8) * self.tensor_bytes

    def input_bytes(self, mode: str) -> int:
        """What exists before the call: q, k, v, plus the upstream gradient in forward+backward."""
        return (3 if mode == "fwd" else 4) * self.tensor_bytes

    def inputs(self, mode: str, seed: int = 0) -> tuple[torch.Tensor, ...]:
        """Random normal q, k, v (and the fixed upstream gradient for ``fwdbwd``), seeded."""
        check_mode(mode)
        gen = torch.Generator().manual_seed(seed)
        shape = (self.batch, self.heads, self.n, self.head_dim)
        count = 3 if mode == "fwd" else 4
        tensors = [torch.randn(shape, generator=gen).to(self.device, DTYPES[self.dtype]) for _ in range(count)]
        if mode == "fwdbwd":
            for t in tensors[:3]:
                t.requires_grad_(True)
        return tuple(tensors)


@dataclass(frozen=True)
class Measurement:
    """One measured point: median seconds over ``repeats`` calls, the peak footprint in bytes, and the
    median page faults of a call."""

    median_s: float
    repeats: int
    peak_bytes: int | None  # inputs + the peak above them; None when not measured
    reference_bytes: int
    faults: float | None = None  # median minor page faults of a timed call; None where not counted


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")


def synchronize(device: str | torch.device) -> None:
    """Wait for queued kernels on CUDA (a no-op on CPU), so a clock read means the work is done."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def attention_step(op: Callable[..., torch.Tensor], tensors: tuple[torch.Tensor, ...]) -> Callable[[], None]:
    """A call of ``op``: forward under inference mode for (q, k, v), forward+backward for (q, k, v, grad_out)."""
    if len(tensors) == 3:
        q, k, v = tensors

        def forward() -> None:
            with torch.inference_mode():
                op(q, k, v)

        return forward
    q, k, v, grad_out = tensors

    def forward_backward() -> None:
        torch.autograd.grad(op(q, k, v), (q, k, v), grad_out, allow_unused=True)

    return forward_backward


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op threads set to ``threads`` inside (None: left as they are), restored after;
    a ValueError names ``--threads`` when it is below 1."""
    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """Python's cyclic garbage collector off inside: a collection inside a timed call is noise, as in timeit."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def minor_faults() -> int | None:
    """Minor page faults of this process so far (all its threads; ``getrusage``), None where unknown."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource is not None else None


def _timed(fn: Callable[[], object], device: str | torch.device) -> float:
    """Seconds of one call of ``fn``, its queued device work included."""
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


def _timed_counted(fn: Callable[[], object], device: str | torch.device, faults: list[int]) -> float:
    """:func:`_timed`, with the call's minor page faults appended to ``faults`` where the OS counts them."""
    before = minor_faults()
    seconds = _timed(fn, device)
    after = minor_faults()
    if before is not None and after is not None:
        faults.append(after - before)
    return seconds


def _median_or_none(values: list[int]) -> float | None:
    return statistics.median(values) if values else None


def time_call(
    fn: Callable[[], object],
    *,
    device: str | torch.device = "cpu",
    budget_s: float = 1.0,
    warmup: int = 1,
    min_repeats: int = 3,
    max_repeats: int = 100,
) -> tuple[float, int, float | None]:
    """(median seconds, repeats, median minor page faults or None) of ``fn``: ``warmup`` untimed calls,
    then timed calls until both ``min_repeats`` are done and ``budget_s`` seconds are spent, or
    ``max_repeats`` are done."""
    if warmup < 0 or min_repeats < 1 or max_repeats < min_repeats or budget_s < 0:
        raise ValueError(
            "time_call needs warmup >= 0, 1 <= min_repeats <= max_repeats and budget_s >= 0, got "
            f"warmup={warmup}, min_repeats={min_repeats}, max_repeats={max_repeats}, budget_s={budget_s}"
        )
    for _ in range(warmup):
        fn()
    synchronize(device)
    times: list[float] = []
    faults: list[int] = []
    with _no_gc():
        start = time.perf_counter()
        while len(times) < max_repeats and (len(times) < min_repeats or time.perf_counter() - start < budget_s):
            times.append(_timed_counted(fn, device, faults))
    return statistics.median(times), len(times), _median_or_none(faults)


def matmul_rate(dtype: str = "float32", device: str = "cpu", size: int = 2048, repeats: int = 10) -> float:
    """The machine's matmul rate in GFLOP/s: square products in ``dtype`` on ``device`` with the current
    torch threads, from the fastest of ``repeats`` calls after one warm-up.

    The product grows from 128 by doubling up to ``size`` while one call takes under 50 ms, so that a
    dtype the CPU has no fast path for (bfloat16 without AMX or AVX512-BF16: about 1 GFLOP/s on an
    AVX2 Zen 3) costs a second, not minutes. The physical limit an attention's products run against,
    beside the FLOP model's ideal speed-up, which only compares FLOP counts. The fastest call, not
    the median: a limit is what the machine can do, and a busy or drifting VM only ever slows a call
    (medians of 2,048^3 products on a 2-core VM varied 90-162 GFLOP/s between runs minutes apart)."""
    if dtype not in DTYPES or size < 1 or repeats < 1:
        raise ValueError(
            f"matmul_rate needs dtype in {sorted(DTYPES)}, size >= 1, repeats >= 1; got {dtype}, {size}, {repeats}"
        )
    gen = torch.Generator().manual_seed(0)
    n = min(128, size)
    while True:
        a, b = (torch.randn(n, n, generator=gen).to(device=device, dtype=DTYPES[dtype]) for _ in range(2))
        product = functools.partial(torch.matmul, a, b)
        first = _timed(product, device)  # the warm-up, and the size test
        if first >= 0.05 or n >= size:
            break
        n = min(2 * n, size)
    fastest = min(_timed(product, device) for _ in range(repeats))
    return 2 * n**3 / fastest / 1e9


def _profiler(*, cuda: bool, profile_memory: bool = False) -> torch.profiler.profile:
    """``torch.profiler.profile`` of CPU (and CUDA) activity, without kineto's log lines on every start."""
    from torch.profiler import ProfilerActivity, profile

    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # read when the profiler starts
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    return profile(activities=activities, profile_memory=profile_memory)


def peak_memory(fn: Callable[[], object], *, device: str | torch.device = "cpu") -> int:
    """Peak bytes allocated by ``fn`` above what was allocated when it started (see the module doc)."""
    dev = torch.device(device)
    gc.collect()
    if dev.type == "cuda":
        synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        start = torch.cuda.memory_allocated(dev)
        fn()
        synchronize(dev)
        return max(0, torch.cuda.max_memory_allocated(dev) - start)
    if dev.type != "cpu":
        raise ValueError(f"peak memory is measured on 'cpu' or 'cuda' devices, got {str(device)!r}")
    with _profiler(cuda=False, profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    running = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        running += event.nbytes()
        peak = max(peak, running)
    return peak


def op_profile(op: Callable[..., torch.Tensor], case: Case, mode: str, *, seed: int = 0, row_limit: int = 30) -> str:
    """The profiler's table of the ops of one call (after a warm-up call), by self time: where the time goes."""
    step = attention_step(op, case.inputs(mode, seed))
    step()
    cuda = torch.device(case.device).type == "cuda"
    with _profiler(cuda=cuda) as prof:
        step()
        synchronize(case.device)
    sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort_by, row_limit=row_limit)


def measure(
    op: Callable[..., torch.Tensor],
    case: Case,
    mode: str,
    *,
    budget_s: float = 1.0,
    warmup: int = 1,
    min_repeats: int = 3,
    max_repeats: int = 100,
    memory: bool = True,
    seed: int = 0,
) -> Measurement:
    """Time ``op(q, k, v)`` on random inputs of ``case`` in ``mode`` and, if ``memory``, its peak footprint.

    The memory call comes after the warm-up and before the timed calls, so one-off
    first-call allocations are not counted and the profiler does not slow a timed call.
    When a warm-up call alone takes longer than ``budget_s``, one timed call is enough
    (``min_repeats`` drops to 1): the repeat count is reported with the median.
    """
    tensors = case.inputs(mode, seed)
    step = attention_step(op, tensors)
    slowest = 0.0
    for _ in range(warmup):
        t0 = time.perf_counter()
        step()
        synchronize(case.device)
        slowest = max(slowest, time.perf_counter() - t0)
    peak = case.input_bytes(mode) + peak_memory(step, device=case.device) if memory else None
    if slowest > budget_s:  # one call alone exceeds the budget: a single timed call will do
        min_repeats = 1
    median, repeats, faults = time_call(
        step, device=case.device, budget_s=budget_s, warmup=0, min_repeats=min_repeats, max_repeats=max_repeats
    )
    return Measurement(median, repeats, peak, case.reference_bytes(mode), faults)


@dataclass(frozen=True)
class Rounds:
    """What :func:`alternating_rounds` measured: each call's seconds and page faults per round, and
    what it returned."""

    times: dict[str, list[float]]  # seconds of each timed call, in round order
    outputs: dict[str, object]  # what each call returned in its last warm-up call (for checks such as finiteness)
    faults: dict[str, list[int]]  # minor page faults of each timed call (empty where not counted)

    def median(self, name: str) -> float:
        """Median seconds of the call ``name`` over the rounds."""
        return statistics.median(self.times[name])

    def median_faults(self, name: str) -> float | None:
        """Median minor page faults of a call of ``name`` over the rounds; None where not counted."""
        return _median_or_none(self.faults[name])


def alternating_rounds(
    calls: dict[str, Callable[[], object]],
    rounds: int,
    *,
    warmup: int = 1,
    device: str | torch.device = "cpu",
    on_round: Callable[[int, dict[str, float]], None] | None = None,
) -> Rounds:
    """Time whole-model variants side by side: ``warmup`` untimed calls of each, then ``rounds``
    rounds that each time one call of every variant in turn, so all see the same machine load.

    Args:
        calls: the variants by name, each a call with no arguments (its result is kept from the warm-up).
        rounds: timed rounds (>= 1).
        warmup: untimed calls of each variant first (>= 0; with none, ``outputs`` is empty).
        device: where the calls run, synchronized around each timed call (CUDA).
        on_round: called after each round with its index (from 0) and that round's seconds per
            variant, for progress (a log line, a progress bar).
    """
    if rounds < 1 or warmup < 0 or not calls:
        raise ValueError(f"alternating_rounds needs calls, rounds >= 1 and warmup >= 0, got {rounds=}, {warmup=}")
    outputs: dict[str, object] = {}
    for _ in range(warmup):
        for name, fn in calls.items():
            outputs[name] = fn()
    synchronize(device)
    times: dict[str, list[float]] = {name: [] for name in calls}
    faults: dict[str, list[int]] = {name: [] for name in calls}
    with _no_gc():
        for r in range(rounds):
            for name, fn in calls.items():
                times[name].append(_timed_counted(fn, device, faults[name]))
            if on_round is not None:
                on_round(r, {name: t[-1] for name, t in times.items()})
    return Rounds(times, outputs, faults)


def measure_side_by_side(
    ops: dict[str, Callable[..., torch.Tensor]],
    case: Case,
    mode: str,
    rounds: int,
    *,
    warmup: int = 1,
    memory: bool = True,
    seed: int = 0,
) -> dict[str, Measurement | Exception]:
    """Time several ops on the same inputs of ``case`` in ``mode`` by :func:`alternating_rounds`.

    Each op first makes ``warmup`` untimed calls (at least one: an op that raises there is
    left out and its error returned in its place, the others go on), then every round times
    one call of each op in turn; the peak memory call of each comes after the rounds.

    Args:
        ops: the ops by name, each called as ``op(q, k, v)``.
        case, mode: the shapes and ``"fwd"`` or ``"fwdbwd"``; the inputs are made once and shared.
        rounds: timed rounds (>= 1); each op's median is over them.
        warmup: untimed calls of each op before the rounds (>= 1).
        memory, seed: as in :func:`measure`.
    """
    if warmup < 1:
        raise ValueError(f"measure_side_by_side needs warmup >= 1 (the call that finds a failing op), got {warmup}")
    tensors = case.inputs(mode, seed)
    results: dict[str, Measurement | Exception] = {}
    steps: dict[str, Callable[[], None]] = {}
    for name, op in ops.items():
        step = attention_step(op, tensors)
        try:
            for _ in range(warmup):
                step()
            synchronize(case.device)
        except Exception as err:  # one method failing at a shape (out of memory) must not end the others
            results[name] = err
            continue
        steps[name] = step
    if steps:
        measured = alternating_rounds(steps, rounds, warmup=0, device=case.device)
        for name, step in steps.items():
            peak = case.input_bytes(mode) + peak_memory(step, device=case.device) if memory else None
            results[name] = Measurement(
                measured.median(name), rounds, peak, case.reference_bytes(mode), measured.median_faults(name)
            )
    return {name: results[name] for name in ops}
