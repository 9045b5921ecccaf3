"""Pathfinder and Path-X (Linsley et al. 2018, as used by LRA: Tay et al. 2021; spec section 7).

An image shows two circular markers and several dashed contours; the label says whether
one contour joins the two markers. Contours are smooth random walks of ``contour_length``
paddles (LRA's difficulties: 6 easy, 9 intermediate, 14 hard); every image holds the same
number of contours, so only the markers' placement tells the classes apart. Lines and
markers are anti-aliased by their exact distance to each pixel centre. Images are drawn
in chunks of at most 100 (vectorised over the chunk), each chunk from a ``numpy`` PCG64
stream seeded by ``(seed, first index)``: the files are the same on any machine with the
same NumPy version (NumPy does not promise identical streams across versions).

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
    """Distance (B, P) from each pixel centre to the nearest segment a[i, j] -> b[i, j] of image i (complex)."""
    ab = (b - a)[:, None, :]  # (B, 1, S)
    rel = pixels[None, :, None] - a[:, None, :]  # (B, P, S)
    t = np.clip((rel * ab.conj()).real / np.maximum(np.abs(ab) ** 2, 1e-12), 0.0, 1.0)
    return np.abs(rel - t * ab).min(axis=-1)


class _Canvases:
    """Several images drawn side by side: per image a free-space map and the drawn strokes.

    Points are complex numbers x + iy. The free maps have a taken border of ``pad`` cells
    around the image and start with the band where a marker would not fit taken, so a
    point one step from a free point is always a valid index and "free" means "inside".
    """

    def __init__(self, spec: PathfinderSpec, rng: np.random.Generator, count: int) -> None:
        self.spec, self.rng, s = spec, rng, spec.size
        ys, xs = np.mgrid[0:s, 0:s]
        self.pixels = (xs.ravel() + 0.5) + 1j * (ys.ravel() + 0.5)
        self.margin = (spec.marker_radius + 0.5) * spec.scale
        self.pad = int(np.ceil(spec.paddle_step * spec.scale)) + 1
        self.width = s + 2 * self.pad
        self.cell = (ys.ravel() + self.pad) * self.width + xs.ravel() + self.pad  # pixel -> free-map entry
        real, imag = self.pixels.real, self.pixels.imag
        inside = (real >= self.margin) & (real <= s - self.margin) & (imag >= self.margin) & (imag <= s - self.margin)
        free = np.zeros(self.width * self.width, dtype=bool)
        free[self.cell] = inside
        self.free = np.tile(free, (count, 1))
        self.image = np.zeros((count, s * s))

    def _free_at(self, rows: np.ndarray, points: np.ndarray) -> np.ndarray:
        """Whether each point (rows.size, ...) lies on a free pixel of its image."""
        x = (points.real + self.pad).astype(np.intp)
        y = (points.imag + self.pad).astype(np.intp)
        return self.free[rows.reshape(-1, *[1] * (points.ndim - 1)), y * self.width + x]

    def contours(self, rows: np.ndarray, batch: int = 32, proposals: int = 6) -> tuple[np.ndarray, np.ndarray]:
        """One smooth walk (L+1 points) per image in ``rows``, clear of the border, earlier contours and itself.

        ``batch`` walks per image grow side by side; at each paddle a walk takes the first
        of ``proposals`` random turns whose next point and midpoint are free, and a walk
        with none dies. Returns each image's first surviving walk and whether it has one.
        """
        sp, n, s, p = self.spec, self.spec.contour_length, self.spec.size, rows.size
        step, margin = sp.paddle_step * sp.scale, self.margin
        turns = self.rng.uniform(-sp.max_turn, sp.max_turn, size=(n, p, batch, proposals))
        start = self.rng.uniform(margin, s - margin, size=(2, p, batch))
        walk = np.empty((p, batch, n + 1), dtype=np.complex128)
        walk[..., 0] = start[0] + 1j * start[1]
        heading = np.angle(s / 2 * (1 + 1j) - walk[..., 0]) + self.rng.uniform(-np.pi / 2, np.pi / 2, (p, batch))
        alive = self._free_at(rows, walk[..., 0])
        for j in range(n):
            turn = heading[..., None] + turns[j]  # (p, C, K)
            here = walk[..., j, None]
            nxt = here + step * np.exp(1j * turn)
            ok = self._free_at(rows, nxt) & self._free_at(rows, (nxt + here) / 2)
            if j:  # keep away from the walk's own earlier paddles
                ok &= np.abs(nxt[..., None] - walk[:, :, None, :j]).min(-1) > 1.5 * step
            pick = ok.argmax(-1)[..., None]
            alive &= np.take_along_axis(ok, pick, -1)[..., 0]
            walk[..., j + 1] = np.where(alive, np.take_along_axis(nxt, pick, -1)[..., 0], walk[..., j])  # dead: stay
            heading = np.take_along_axis(turn, pick, -1)[..., 0]
        return walk[np.arange(p), alive.argmax(1)], alive.any(1)

    def draw(self, rows: np.ndarray, walks: np.ndarray) -> None:
        """Draw each walk's paddles (anti-aliased) in its image and reserve the space around it."""
        sp = self.spec
        half = sp.line_width * sp.scale / 2
        a = walks[:, :-1]
        dist = _segment_distance(self.pixels, a, a + sp.paddle_fraction * (walks[:, 1:] - a))
        self.image[rows] = np.maximum(self.image[rows], np.clip(half + 0.5 - dist, 0.0, 1.0))
        taken = _segment_distance(self.pixels, a, walks[:, 1:]) <= (sp.clearance + half) * sp.scale
        index = (rows[:, None], self.cell[None, :])
        self.free[index] &= ~taken

    def marker(self, rows: np.ndarray, centres: np.ndarray) -> None:
        r = self.spec.marker_radius * self.spec.scale
        dist = np.abs(self.pixels[None, :] - centres[:, None])
        self.image[rows] = np.maximum(self.image[rows], np.clip(r + 0.5 - dist, 0.0, 1.0))


def render(spec: PathfinderSpec, start: int, labels: list[int], max_restarts: int = 50) -> np.ndarray:
    """Samples ``start, start + 1, ...`` with the given labels (1 = joined) as (n, size, size) uint8.

    The images are drawn together from one PCG64 stream seeded by ``(spec.seed, start)``.
    """
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.isin(labels, (0, 1)).all():
        raise ValueError(f"labels must be a list of 0 and 1, got {labels.tolist()!r}")
    rng = np.random.default_rng([spec.seed, start])
    out = np.empty((labels.size, spec.size, spec.size), dtype=np.uint8)
    todo = np.arange(labels.size)
    for _ in range(max_restarts):
        if not todo.size:
            return out
        canvases = _Canvases(spec, rng, todo.size)
        rows = np.arange(todo.size)
        ok = np.ones(todo.size, dtype=bool)
        walks = []
        for _ in range(spec.num_distractors + 2):
            walk = np.zeros((todo.size, spec.contour_length + 1), dtype=np.complex128)
            need = rows[ok]
            for _ in range(8):
                if not need.size:
                    break
                got, found = canvases.contours(need)
                walk[need[found]] = got[found]
                need = need[~found]
            ok[need] = False
            canvases.draw(rows[ok], walk[ok])
            walks.append(walk)
        other_end = np.where(labels[todo] == 1, walks[0][:, -1], walks[1][:, -1])
        canvases.marker(rows[ok], walks[0][ok, 0])
        canvases.marker(rows[ok], other_end[ok])
        out[todo[ok]] = np.round(canvases.image[ok] * 255).astype(np.uint8).reshape(-1, spec.size, spec.size)
        todo = todo[~ok]
    if todo.size:
        raise RuntimeError(
            f"could not place {spec.num_distractors + 2} contours of {spec.contour_length} paddles in a "
            f"{spec.size}x{spec.size} image after {max_restarts} restarts; lower num_distractors or paddle_step"
        )
    return out


def _write(job: tuple[PathfinderSpec, Path, int, int, int]) -> list[str]:
    """Render and save samples [lo, hi) of one folder; returns their metadata lines."""
    from PIL import Image

    spec, root, folder, lo, hi = job
    labels = labels_for_range(spec.seed, lo, hi)
    img_dir = root / "imgs" / str(folder)
    img_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, label, img in zip(range(lo, hi), labels, render(spec, lo, labels)):
        Image.fromarray(img, mode="L").save(img_dir / f"sample_{i}.png")
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
        raise FileExistsError(f"{root} holds a Pathfinder set already; pass overwrite=True (--force)")
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
    for i, img in enumerate(render(spec, 0, labels)):
        img = Image.fromarray(img, mode="L").resize((s, s), Image.NEAREST)
        frame = Image.new("RGB", (s + 2 * pad, s + 2 * pad), (0, 160, 0) if labels[i] else (200, 0, 0))
        frame.paste(img.convert("RGB"), (pad, pad))
        grid.paste(frame, ((i % cols) * (s + 2 * pad), (i // cols) * (s + 2 * pad)))
    Path(out_png).parent.mkdir(parents=True, exist_ok=True)
    grid.save(out_png)
    return Path(out_png)
