"""Pathfinder and Path-X (Linsley et al. 2018, as used by LRA: Tay et al. 2021; spec section 7).

An image shows two circular markers and several dashed contours; the label says whether
one contour joins the two markers. Contours are smooth random walks of ``contour_length``
paddles (LRA's difficulties: 6 easy, 9 intermediate, 14 hard); every image holds the same
number of contours, so only the markers' placement tells the classes apart. Lines and
markers are anti-aliased by their exact distance to each pixel centre. Each sample is
drawn from its own ``numpy`` PCG64 stream seeded by ``(seed, index)``: the files are the
same on any machine and any sample can be regenerated alone.

The output follows the LRA release: ``pathfinder{size}/{difficulty}/imgs/{b}/sample_{i}.png``
and ``metadata/{b}.npy``, a text file (despite its suffix) with one line per image:
``imgs/{b} sample_{i}.png {i} {label} {contour_length} {num_contours}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

DIFFICULTIES = {6: "curv_baseline", 9: "curv_contour_length_9", 14: "curv_contour_length_14"}


@dataclass(frozen=True)
class PathfinderSpec:
    """Generator parameters; lengths are in pixels of a 32x32 image and scale with ``size``."""

    size: int = 32
    contour_length: int = 14  # paddles per contour
    num_distractors: int = 2  # contours beyond the marked ones (one more in positives)
    paddle_step: float = 2.0  # centre-to-centre distance of consecutive paddles
    paddle_fraction: float = 0.45  # the drawn part of each step (the rest is the gap)
    line_width: float = 1.0
    marker_radius: float = 1.6
    max_turn: float = 0.6  # radians between consecutive paddles
    clearance: float = 1.0  # minimum distance between contours
    seed: int = 0

    def __post_init__(self) -> None:
        if self.size not in (32, 64, 128, 256):
            raise ValueError(f"size must be 32, 64, 128 or 256 (Pathfinder / Path-X), got {self.size!r}")
        if self.contour_length < 2 or self.num_distractors < 0:
            raise ValueError(
                f"need contour_length >= 2 and num_distractors >= 0, got {self.contour_length}, {self.num_distractors}"
            )
        if not 0.0 < self.paddle_fraction <= 1.0:
            raise ValueError(f"paddle_fraction must be in (0, 1], got {self.paddle_fraction!r}")

    @property
    def scale(self) -> float:
        return self.size / 32

    @property
    def difficulty(self) -> str:
        return DIFFICULTIES.get(self.contour_length, f"curv_contour_length_{self.contour_length}")


def _segment_distance(pixels: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Distance (P,) from each pixel centre to the nearest of the segments a[j] -> b[j] (complex points)."""
    ab = b - a  # (S,)
    rel = pixels[:, None] - a[None]  # (P, S)
    t = np.clip((rel * ab.conj()).real / np.maximum(np.abs(ab) ** 2, 1e-12), 0.0, 1.0)
    return np.abs(rel - t * ab).min(axis=1)


class _Canvas:
    """One image being drawn: pixel centres, a free-space map, and the drawn strokes.

    Points are complex numbers x + iy. The free map starts with the border band (where a
    marker would not fit) taken, so "free" also means "inside".
    """

    def __init__(self, spec: PathfinderSpec, rng: np.random.Generator) -> None:
        self.spec, self.rng, s = spec, rng, spec.size
        ys, xs = np.mgrid[0:s, 0:s]
        self.pixels = (xs.ravel() + 0.5) + 1j * (ys.ravel() + 0.5)
        self.margin = (spec.marker_radius + 0.5) * spec.scale
        inside = (self.pixels.real >= self.margin) & (self.pixels.real <= s - self.margin)
        self.free = inside & (self.pixels.imag >= self.margin) & (self.pixels.imag <= s - self.margin)
        self.image = np.zeros(s * s, dtype=np.float64)

    def contour(self, batch: int = 32, proposals: int = 6) -> np.ndarray | None:
        """A smooth walk (L+1,) of complex points, clear of the border, earlier contours and itself.

        ``batch`` walks grow side by side; at each paddle every walk takes the first of
        ``proposals`` random turns whose next point and midpoint are free, and a walk with
        none dies. The first survivor is returned (None if all die).
        """
        sp, n, s = self.spec, self.spec.contour_length, self.spec.size
        step, margin = sp.paddle_step * sp.scale, self.margin
        rows = np.arange(batch)
        turns = self.rng.uniform(-sp.max_turn, sp.max_turn, size=(n, batch, proposals))
        walk = np.empty((batch, n + 1), dtype=np.complex128)
        start = self.rng.uniform(margin, s - margin, size=(2, batch))
        walk[:, 0] = start[0] + 1j * start[1]
        heading = np.angle(s / 2 * (1 + 1j) - walk[:, 0]) + self.rng.uniform(-np.pi / 2, np.pi / 2, size=batch)
        alive = self._free_at(walk[:, 0])
        min_gap = 1.5 * step  # keep away from the walk's own earlier paddles
        for j in range(n):
            turn = heading[:, None] + turns[j]
            here = walk[:, j, None]
            nxt = here + step * np.exp(1j * turn)  # (C, K)
            ok = self._free_at(nxt) & self._free_at((nxt + here) / 2)
            if j:
                ok &= np.abs(nxt[:, :, None] - walk[:, None, :j]).min(-1) > min_gap
            pick = ok.argmax(axis=1)
            alive &= ok[rows, pick]
            if not alive.any():
                return None
            walk[:, j + 1], heading = nxt[rows, pick], turn[rows, pick]
        return walk[np.flatnonzero(alive)[0]]

    def _free_at(self, points: np.ndarray) -> np.ndarray:
        """Whether each point's pixel is free; points off the image count as taken."""
        s = self.spec.size
        x, y = np.floor(points.real).astype(np.intp), np.floor(points.imag).astype(np.intp)
        on = (x >= 0) & (x < s) & (y >= 0) & (y < s)
        return on & self.free[np.where(on, y * s + x, 0)]

    def draw(self, walk: np.ndarray) -> None:
        """Draw the walk's paddles (anti-aliased) and reserve the space around it."""
        sp = self.spec
        a, b = walk[:-1], walk[:-1] + sp.paddle_fraction * (walk[1:] - walk[:-1])
        half = sp.line_width * sp.scale / 2
        reach = (sp.clearance + half) * sp.scale
        lo, hi = walk.real.min() - reach - 1, walk.real.max() + reach + 1
        lo_y, hi_y = walk.imag.min() - reach - 1, walk.imag.max() + reach + 1
        px = self.pixels
        near = np.flatnonzero((px.real >= lo) & (px.real <= hi) & (px.imag >= lo_y) & (px.imag <= hi_y))
        dist = _segment_distance(px[near], a, b)
        self.image[near] = np.maximum(self.image[near], np.clip(half + 0.5 - dist, 0.0, 1.0))
        self.free[near] &= _segment_distance(px[near], walk[:-1], walk[1:]) > reach

    def marker(self, centre: complex) -> None:
        r = self.spec.marker_radius * self.spec.scale
        self.image = np.maximum(self.image, np.clip(r + 0.5 - np.abs(self.pixels - centre), 0.0, 1.0))


def render(spec: PathfinderSpec, index: int, label: int, max_restarts: int = 50) -> np.ndarray:
    """Sample ``index`` of ``spec`` as a (size, size) uint8 image with the given label (1 = joined)."""
    if label not in (0, 1):
        raise ValueError(f"label must be 0 or 1, got {label!r}")
    rng = np.random.default_rng([spec.seed, index])
    for _ in range(max_restarts):
        canvas = _Canvas(spec, rng)
        walks = []
        for _ in range(spec.num_distractors + 2):
            walk = next((w for w in (canvas.contour() for _ in range(8)) if w is not None), None)
            if walk is None:
                break
            canvas.draw(walk)
            walks.append(walk)
        if len(walks) < spec.num_distractors + 2:
            continue
        ends = [walks[0][0], walks[0][-1]] if label else [walks[0][0], walks[1][-1]]
        for end in ends:
            canvas.marker(end)
        return np.round(canvas.image.reshape(spec.size, spec.size) * 255).astype(np.uint8)
    raise RuntimeError(
        f"could not place {spec.num_distractors + 2} contours of {spec.contour_length} paddles in a "
        f"{spec.size}x{spec.size} image after {max_restarts} restarts; lower num_distractors or paddle_step"
    )


def _write(job: tuple[PathfinderSpec, Path, int, int, int]) -> list[str]:
    """Render and save samples [lo, hi) of one folder; returns their metadata lines."""
    from PIL import Image

    spec, root, folder, lo, hi = job
    labels = labels_for_range(spec.seed, lo, hi)
    img_dir = root / "imgs" / str(folder)
    img_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, label in zip(range(lo, hi), labels):
        Image.fromarray(render(spec, i, int(label)), mode="L").save(img_dir / f"sample_{i}.png")
        lines.append(f"imgs/{folder} sample_{i}.png {i} {label} {spec.contour_length} {spec.num_distractors + 2}")
    return lines


def labels_for_range(seed: int, lo: int, hi: int) -> list[int]:
    """Labels of samples [lo, hi): balanced in every aligned pair (2j, 2j+1), order seeded per pair."""
    flips = [int(np.random.default_rng([seed, 2**31 + j]).integers(2)) for j in range(lo // 2, (hi + 1) // 2)]
    return [(i % 2) ^ flips[i // 2 - lo // 2] for i in range(lo, hi)]


def generate(
    out_dir: str | Path,
    spec: PathfinderSpec = PathfinderSpec(),
    num_samples: int = 20_000,
    per_folder: int = 1_000,
    workers: int = 1,
    overwrite: bool = False,
    progress: bool = False,
) -> Path:
    """Write ``num_samples`` images and metadata in the LRA layout; returns the difficulty folder."""
    from tqdm import tqdm

    if num_samples < 1 or per_folder < 1 or workers < 1:
        raise ValueError(
            f"num_samples, per_folder and workers must be >= 1, got {num_samples}, {per_folder}, {workers}"
        )
    root = Path(out_dir) / f"pathfinder{spec.size}" / spec.difficulty
    if (root / "metadata").exists() and not overwrite:
        raise FileExistsError(f"{root} holds a Pathfinder set already; pass overwrite=True (--overwrite)")
    jobs = [  # chunks of at most 100 samples, each inside one folder
        (spec, root, start // per_folder, lo, min(lo + 100, start + per_folder, num_samples))
        for start in range(0, num_samples, per_folder)
        for lo in range(start, min(start + per_folder, num_samples), 100)
    ]
    bar = tqdm(total=num_samples, desc=f"pathfinder{spec.size} {spec.difficulty}", disable=not progress)
    lines: dict[int, list[str]] = {}
    if workers == 1:
        results = map(_write, jobs)
    else:
        import multiprocessing as mp

        pool = mp.get_context("spawn").Pool(workers)
        results = pool.imap(_write, jobs)
    for job, rows in zip(jobs, results):
        lines.setdefault(job[2], []).extend(rows)
        bar.update(len(rows))
    bar.close()
    if workers > 1:
        pool.close()
        pool.join()
    (root / "metadata").mkdir(parents=True, exist_ok=True)
    for folder, rows in lines.items():
        (root / "metadata" / f"{folder}.npy").write_text("\n".join(rows) + "\n")
    return root


def example_grid(out_png: str | Path, spec: PathfinderSpec, count: int = 16, cols: int = 8, zoom: int = 4) -> Path:
    """A PNG of ``count`` samples (green frame: joined, red frame: not joined) for the docs."""
    from PIL import Image

    labels = labels_for_range(spec.seed, 0, count)
    s, pad = spec.size * zoom, 2
    rows = -(-count // cols)
    grid = Image.new("RGB", (cols * (s + 2 * pad), rows * (s + 2 * pad)), "white")
    for i in range(count):
        img = Image.fromarray(render(spec, i, int(labels[i])), mode="L").resize((s, s), Image.NEAREST)
        frame = Image.new("RGB", (s + 2 * pad, s + 2 * pad), (0, 160, 0) if labels[i] else (200, 0, 0))
        frame.paste(img.convert("RGB"), (pad, pad))
        grid.paste(frame, ((i % cols) * (s + 2 * pad), (i // cols) * (s + 2 * pad)))
    Path(out_png).parent.mkdir(parents=True, exist_ok=True)
    grid.save(out_png)
    return Path(out_png)
