"""The paper's vision experiments on the digits ViT (spec section 6), each a markdown report with PNGs.

* :func:`run_swap`: train with standard attention, evaluate with MiTA and every other registered
  method without retraining; the accuracy retained.
* :func:`run_robustness`: train MiTA with small m, k; evaluate over a grid of larger m, k.
* :func:`run_pruning`: which tokens MiTA's experts select, per layer; heat maps over the image.

Each takes ``data`` = (x_train, y_train, x_test, y_test) to run on other images (the tests do).
Swap and robustness also take a :class:`Task` (data, model, the methods' options for its length,
the report's words) to run on other inputs: :data:`DIGITS` by default; :mod:`mita_experiments.video`
runs them on moving digits. Every attention an experiment will use is built and run on one input
before anything is trained (:func:`check_attentions`), so a bad option fails at once, not after
training. The models are trained by :func:`~mita_experiments.vision.digits.train` in run folders of
``out`` (``sdpa/``, ``mita/``), which a re-run resumes.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from mita import attention as registry
from mita.layers.mita import MiTAAttention

from ..utils.files import atomic_write_text, prepare_output_dir
from ..utils.machine import describe
from .digits import GRID, DigitsSetup, evaluate, load_digits, make_vit, train
from .flops import markdown_table


def sized_options(
    landmarks: int, topk: int, block_size: int, window: int, nystrom: int | None = None
) -> dict[str, dict[str, Any]]:
    """The registered methods' size options for one sequence length (methods not listed have none).

    Args:
        landmarks (int): m of MiTA and its two ablations; also agent's agents and MHLA's blocks (one
            pooled grid, so a square on a 2-D grid, a cube on a 3-D one).
        topk (int): k, the keys per MiTA expert and per query of top-k attention.
        block_size (int): MoBA's and NSA's key blocks (each query attends to its top 2).
        window (int): NSA's sliding window.
        nystrom (int | None): Nystrom's landmarks; default ``landmarks``.
    """
    mita = {"num_landmarks": landmarks, "topk": topk}
    return {
        "mita": mita,
        "mita_routed": dict(mita),
        "mita_shared": dict(mita),
        "topk": {"topk": topk},
        "moba": {"block_size": block_size, "topk": 2},
        "agent": {"num_agents": landmarks},
        "nystrom": {"num_landmarks": landmarks if nystrom is None else nystrom},
        "mhla": {"num_blocks": landmarks},
        "nsa": {"block_size": block_size, "topk": 2, "window": window},
    }


#: options of each registered method for the digits' N = 65 on the 8x8 grid
SMALL_N_OPTIONS = sized_options(landmarks=16, topk=16, block_size=8, window=4)
#: extra MiTA settings the swap evaluates besides m = k = 16
SWAP_MITA_EXTRA = ("mita:num_landmarks=4,topk=8", "mita:num_landmarks=64,topk=65")
ROBUSTNESS_M = (1, 4, 9, 16, 25, 36, 64)
ROBUSTNESS_K = (1, 2, 4, 8, 16, 32, 65)
REPORT = "report.md"
RUNS = ("sdpa", "mita")  # the run folders of the models the experiments train (and resume)

Log = Callable[[str], None]


def config_string(name: str, options: dict[str, Any]) -> str:
    """``name:key=value,...`` (the registry's config syntax)."""
    return name + (":" + ",".join(f"{k}={v}" for k, v in options.items()) if options else "")


def swap_configs(
    options: dict[str, dict[str, Any]] | None = None, extra: tuple[str, ...] = SWAP_MITA_EXTRA
) -> list[str]:
    """Every registered method with ``options`` (default :data:`SMALL_N_OPTIONS`, sized for N = 65), plus ``extra``."""
    options = SMALL_N_OPTIONS if options is None else options
    configs = [config_string(n, options.get(n, {})) for n in registry.names()]
    return configs + [c for c in extra if c not in configs]


@dataclass(frozen=True)
class Task:
    """What swap and robustness run on.

    Args:
        name (str): in titles ("digits").
        data (str): the report's description of the data (its sizes are appended).
        load (callable): seed -> (x_train, y_train, x_test, y_test).
        build (callable): DigitsSetup -> the model (softmax attention, or ``setup.attention``).
        input_shape (tuple): one input's shape, e.g. (1, 32, 32) (the attentions are checked on one).
        swap_options (dict): each method's options at the task's length (see :data:`SMALL_N_OPTIONS`).
        swap_extra (tuple): more configs the swap evaluates.
    """

    name: str
    data: str
    load: Callable[[int], tuple[torch.Tensor, ...]]
    build: Callable[[DigitsSetup], torch.nn.Module]
    input_shape: tuple[int, ...]
    swap_options: dict[str, dict[str, Any]] = field(default_factory=lambda: SMALL_N_OPTIONS)
    swap_extra: tuple[str, ...] = SWAP_MITA_EXTRA


DIGITS = Task(
    "digits",
    "scikit-learn digits upscaled to 32x32 and standardised, patch 4 (8x8 grid + CLS, N = 65)",
    load_digits,
    make_vit,
    (1, 4 * GRID, 4 * GRID),
)


def check_attentions(task: Task, setup: DigitsSetup, configs: Iterable[str], flag: str) -> None:
    """Build ``task``'s model with each attention config and run it on one random input, so that every
    option is checked against the model's token grid before anything is trained (a bad option would
    otherwise fail only when it is first used, after training). The model is built with one block (its
    blocks are alike) and run on one thread: a second or two for a whole swap or robustness grid.

    Args:
        task (Task): the model and the shape of its input.
        setup (DigitsSetup): the model's size and seed; its attention is replaced by each config.
        configs (iterable of str): registry configs, e.g. ``"mita:num_landmarks=16,topk=16"``.
        flag (str): where the configs came from (``"--attention"``), to start the message with.

    Raises:
        ValueError: ``"{flag} {config}: {why}"`` for the first config that does not build or run.
    """
    example = torch.randn(1, *task.input_shape, generator=torch.Generator().manual_seed(0))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # more threads only wait on each other for one small input
    try:
        for config in configs:
            try:
                model = task.build(replace(setup, attention=config, depth=1))
                with torch.no_grad():
                    model.eval()(example)
            except (ValueError, TypeError) as err:
                raise ValueError(f"{flag} {config}: {err}") from None
    finally:
        torch.set_num_threads(threads)


def prepare_output(out: Path | str, force: bool) -> Path:
    """Create ``out`` before any work. Refuses a file, a path under a file, an unwritable
    folder, and unless ``force`` a folder holding anything but the run folders of an
    interrupted experiment (whose runs are resumed)."""
    return prepare_output_dir(out, force=force, ignore=RUNS)


def write_report(
    out: Path,
    title: str,
    command: str,
    setup: DigitsSetup,
    data: tuple[torch.Tensor, ...],
    sections: Iterable[str],
    task: Task = DIGITS,
) -> Path:
    """The markdown report: title, how it was made, then the sections."""
    head = [
        f"# {title}",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {describe()}",
        "",
        "Setup: "
        + ", ".join(f"{k}={v}" for k, v in asdict(setup).items())
        + f"; data: {task.data}, {len(data[1])} train / {len(data[3])} test examples",
        "",
    ]
    path = out / REPORT
    atomic_write_text(path, "\n".join([*head, *sections]) + "\n")
    return path


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (imported late: it is slow and optional)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def mita_layers(model: torch.nn.Module) -> list[MiTAAttention]:
    """The model's MiTA layers, in order (their m, k can be changed in place)."""
    return [m for m in model.modules() if isinstance(m, MiTAAttention)]


def plot_swap(out: Path, rows: list[dict[str, Any]], column: str, xlabel: str, line: str) -> None:
    """``out/swap.png``: a bar per swap row (its ``"attention at test time"``) of its ``column``, a share
    (%) of the SDPA model's score, with a dashed line at 95% labelled ``line``; ``xlabel`` under the bars."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(rows) + 1.2))
    ax.barh([r["attention at test time"] for r in rows], [r[column] for r in rows], color="tab:blue")
    ax.axvline(95, color="tab:red", linestyle="--", label=line)
    ax.set_xlabel(xlabel)
    ax.invert_yaxis()
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out / "swap.png", dpi=120)
    plt.close(fig)


def robustness_grid(
    layers: list[MiTAAttention], ms: Sequence[int], ks: Sequence[int], score: Callable[[], float], log: Log
) -> torch.Tensor:
    """``score()`` (a percentage) with every layer of ``layers`` set to each m of ``ms`` and k of ``ks``:
    a (len(ms), len(ks)) grid, one log line per m. The layers keep the last m, k."""
    grid = torch.zeros(len(ms), len(ks))
    for i, m in enumerate(ms):
        for j, k in enumerate(ks):
            for layer in layers:
                layer.num_landmarks, layer.topk = m, k
            grid[i, j] = score()
        log(f"robustness m={m}: " + ", ".join(f"k={k} {a:.1f}%" for k, a in zip(ks, grid[i].tolist())))
    return grid


def plot_robustness(
    out: Path, grid: torch.Tensor, ms: Sequence[int], ks: Sequence[int], title: str, label: str
) -> list[dict[str, Any]]:
    """``out/robustness.png``: the ``grid`` of :func:`robustness_grid` as a heat map with its values, titled
    ``title``, its colour bar labelled ``label``; returns its rows for a table (``m \\ k``, then ``k=...``)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(1.5 + 0.8 * len(ks), 1 + 0.6 * len(ms)))
    im = ax.imshow(grid.numpy(), cmap="viridis", origin="lower")
    ax.set_xticks(range(len(ks)), [str(k) for k in ks])
    ax.set_yticks(range(len(ms)), [str(m) for m in ms])
    ax.set(xlabel="k (keys per expert) at test time", ylabel="m (landmarks) at test time", title=title)
    for i in range(len(ms)):
        for j in range(len(ks)):
            ax.text(j, i, f"{grid[i, j]:.1f}", ha="center", va="center", color="w", fontsize=7)
    fig.colorbar(im, ax=ax, label=label)
    fig.tight_layout()
    fig.savefig(out / "robustness.png", dpi=120)
    plt.close(fig)
    return [{"m \\ k": m, **{f"k={k}": float(grid[i, j]) for j, k in enumerate(ks)}} for i, m in enumerate(ms)]


# --- attention swap ----------------------------------------------------------------------


def run_swap(
    out: Path,
    setup: DigitsSetup,
    configs: list[str] | None,
    command: str,
    force: bool = False,
    log: Log = print,
    data: tuple[torch.Tensor, ...] | None = None,
    task: Task = DIGITS,
) -> list[dict[str, Any]]:
    """Train with SDPA, evaluate every config without retraining; writes report.md and swap.png."""
    from mita.models.convert import convert

    setup = replace(setup, attention="sdpa")
    configs = configs or swap_configs(task.swap_options, task.swap_extra)
    check_attentions(task, setup, configs, "--attention")
    data = data or task.load(setup.seed)
    model, summary = train(setup, data, out / "sdpa", force=force, build=task.build, name=task.name)
    base = summary["test_accuracy"]
    rows = []
    for config in configs:
        t0 = time.perf_counter()
        accuracy = evaluate(convert(copy.deepcopy(model), config), data[2], data[3])
        retained = 100 * accuracy / base if base else float("nan")
        rows.append(
            {
                "attention at test time": config,
                "test accuracy (%)": 100 * accuracy,
                "retained (%)": retained,
                "eval s": time.perf_counter() - t0,
            }
        )
        log(f"swap {config}: {100 * accuracy:.2f}%")
    xlabel = "accuracy retained after the swap (% of the SDPA model's)"
    plot_swap(out, rows, "retained (%)", xlabel, "95% (the paper's MiTA claim)")
    title = f"Attention swap on {task.name}: trained with SDPA, evaluated with other attentions"
    sections = [
        f"SDPA model: test accuracy {100 * base:.2f}% after {summary['train_seconds']:.0f} s of training.",
        "",
        markdown_table(rows),
        "![accuracy retained](swap.png)",
    ]
    write_report(out, title, command, setup, data, sections, task)
    return rows


# --- robustness over m and k --------------------------------------------------------------


def run_robustness(
    out: Path,
    setup: DigitsSetup,
    ms: tuple[int, ...],
    ks: tuple[int, ...],
    command: str,
    force: bool = False,
    log: Log = print,
    data: tuple[torch.Tensor, ...] | None = None,
    task: Task = DIGITS,
) -> dict[str, Any]:
    """Train MiTA with ``setup.attention``'s m, k; evaluate on the grid ms x ks; report.md and robustness.png."""
    name, options = registry.parse(setup.attention)
    if name != "mita":
        raise ValueError(f"robustness trains MiTA: --train-attention must be a 'mita:...' config, got {name!r}")
    check_attentions(task, setup, [setup.attention], "--train-attention")
    grid_configs = [config_string(name, {**options, "num_landmarks": m, "topk": k}) for m in ms for k in ks]
    check_attentions(task, setup, grid_configs, "--m/--k give")
    data = data or task.load(setup.seed)
    model, summary = train(setup, data, out / "mita", force=force, build=task.build, name=task.name)
    grid = robustness_grid(mita_layers(model), ms, ks, lambda: 100 * evaluate(model, data[2], data[3]), log)
    title = f"trained with m={options.get('num_landmarks')}, k={options.get('topk')}"
    rows = plot_robustness(out, grid, ms, ks, title, "test accuracy (%)")
    trained = (options.get("num_landmarks"), options.get("topk"))
    best = divmod(int(grid.argmax()), len(ks))
    title = f"Robustness on {task.name}: MiTA trained with small m, k, evaluated with larger ones"
    sections = [
        f"Trained with m={trained[0]}, k={trained[1]}: test accuracy {100 * summary['test_accuracy']:.2f}% "
        f"after {summary['train_seconds']:.0f} s of training. Best on the grid: {grid.max():.2f}% at "
        f"m={ms[best[0]]}, k={ks[best[1]]}.",
        "",
        "Test accuracy (%), rows m, columns k:",
        "",
        markdown_table(rows),
        "![accuracy over m and k](robustness.png)",
    ]
    write_report(out, title, command, setup, data, sections, task)
    return {"trained": summary["test_accuracy"], "grid": grid, "ms": ms, "ks": ks}


# --- token pruning ------------------------------------------------------------------------


@torch.no_grad()
def selection_statistics(model: torch.nn.Module, images: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per MiTA layer, from the experts' top-k sets over ``images``:

    ``unselected_head`` (L,): mean fraction of tokens in no expert of a head;
    ``unselected_all`` (L,): mean fraction of tokens in no expert of any head;
    ``frequency`` (L, N): how often each token is selected, averaged over images and heads;
    ``per_image`` (L, B, N): how many heads select each token of each image.
    """
    layers = mita_layers(model)
    if not layers:
        raise ValueError("the model has no MiTAAttention layers to analyse")
    for layer in layers:
        layer.record_routing = True
    try:
        model.eval()
        model(images)
        stats: dict[str, list[torch.Tensor]] = {
            "unselected_head": [],
            "unselected_all": [],
            "frequency": [],
            "per_image": [],
        }
        for layer in layers:
            experts = layer.routing.experts  # (B, H, m, k) key indices
            (B, H), n = experts.shape[:2], layer.routing.routes.shape[2]
            selected = torch.zeros(B, H, n, dtype=torch.bool)
            selected.scatter_(2, experts.flatten(2), True)
            stats["unselected_head"].append((~selected).float().mean())
            stats["unselected_all"].append((~selected.any(1)).float().mean())
            stats["frequency"].append(selected.float().mean((0, 1)))
            stats["per_image"].append(selected.sum(1))
    finally:
        for layer in layers:
            layer.record_routing, layer.routing = False, None
    return {k: torch.stack(v) for k, v in stats.items()}


def chance_unselected(n: int, m: int, k: int) -> float:
    """Fraction of tokens no expert picks if each of m experts drew k of n tokens uniformly at random."""
    k = min(k, n)
    return (1 - k / n) ** m


def run_pruning(
    out: Path,
    setup: DigitsSetup,
    command: str,
    force: bool = False,
    examples: int = 6,
    log: Log = print,
    data: tuple[torch.Tensor, ...] | None = None,
) -> dict[str, torch.Tensor]:
    """Train MiTA; per layer the fraction of tokens no expert selects; heat maps (PNG) over the image."""
    name, options = registry.parse(setup.attention)
    if name != "mita":
        raise ValueError(f"pruning analyses MiTA: --train-attention must be a 'mita:...' config, got {name!r}")
    check_attentions(DIGITS, setup, [setup.attention], "--train-attention")
    data = data or load_digits(setup.seed)
    model, summary = train(setup, data, out / "mita", force=force)
    stats = selection_statistics(model, data[2])
    n, L = GRID * GRID + 1, stats["frequency"].shape[0]
    m, k = options.get("num_landmarks", 64), options.get("topk", 64)
    m = m if isinstance(m, int) else math.prod(m)
    chance = chance_unselected(n, m, k)
    plt = pyplot()
    fig, axes = plt.subplots(1, L, figsize=(2.6 * L, 2.8), squeeze=False)
    for layer, ax in enumerate(axes[0]):
        im = ax.imshow(stats["frequency"][layer, 1:].reshape(GRID, GRID).numpy(), cmap="magma", vmin=0, vmax=1)
        ax.set_title(f"layer {layer}: CLS {stats['frequency'][layer, 0]:.2f}", fontsize=8)
        ax.axis("off")
    fig.colorbar(im, ax=axes[0].tolist(), label="P(patch selected), mean over images and heads")
    fig.savefig(out / "selection_frequency.png", dpi=120, bbox_inches="tight")
    plt.close(fig)
    heads = mita_layers(model)[0].num_heads
    examples = min(examples, len(data[3]))
    fig, axes = plt.subplots(examples, L + 1, figsize=(1.6 * (L + 1), 1.6 * examples), squeeze=False)
    for row in range(examples):
        axes[row, 0].imshow(data[2][row, 0].numpy(), cmap="gray_r")
        axes[row, 0].set_title(f"digit {int(data[3][row])}", fontsize=7)
        for layer in range(L):
            counts = stats["per_image"][layer, row, 1:].reshape(GRID, GRID).numpy()
            axes[row, layer + 1].imshow(counts, cmap="magma", vmin=0, vmax=heads)
            axes[row, layer + 1].set_title(f"layer {layer}", fontsize=7)
    for ax in axes.flat:
        ax.axis("off")
    fig.suptitle(f"heads (of {heads}) selecting each patch; black = reached only through the shared expert")
    fig.savefig(out / "selection_examples.png", dpi=120, bbox_inches="tight")
    plt.close(fig)
    rows = [
        {
            "layer": layer,
            "unselected per head (%)": 100 * float(stats["unselected_head"][layer]),
            "unselected by every head (%)": 100 * float(stats["unselected_all"][layer]),
            "random experts would leave per head (%)": 100 * chance,
        }
        for layer in range(L)
    ]
    for row in rows:
        log(f"pruning layer {row['layer']}: {row['unselected per head (%)']:.1f}% unselected per head")
    write_report(
        out,
        "Token pruning on digits: tokens no MiTA expert selects",
        command,
        setup,
        data,
        [
            f"MiTA model (m={m}, k={k}, so m k = {m * k} slots for N = {n} tokens): test accuracy "
            f"{100 * summary['test_accuracy']:.2f}% after {summary['train_seconds']:.0f} s of training. "
            "A token no expert selects reaches the queries only through the compressed shared expert.",
            "",
            markdown_table(rows),
            f"Selection frequency of each patch (mean over the {len(data[3])} test images and the heads):",
            "",
            "![selection frequency](selection_frequency.png)",
            "",
            "Per image, how many heads select each patch:",
            "",
            "![selection examples](selection_examples.png)",
        ],
    )
    return stats
