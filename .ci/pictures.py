"""Draw the pictures of the docs from real runs (CI runs this before `mkdocs build`).

- `docs/images/timeline.svg`: one gradient step of the wave stepper of `benchmarks/`, on
  the standard and on the deferred schedule, recorded with `dx.record()` on this machine
  just now;
- `docs/images/benchmarks.svg`: the ratios of `benchmarks/results.txt` (the RESULT lines
  of the run that `docs/benchmarks.md` reports), with the ideal 0.5 and the targets marked;
- `docs/images/inverse_design.svg`: the waveguide bend of `examples/inverse_design_ceviche.py`
  after a short Adam run on this machine, and its loss at each step.

    python .ci/pictures.py
"""

from __future__ import annotations

import pathlib
import re
import statistics
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
IMAGES = ROOT / "docs" / "images"
sys.path.insert(0, str(ROOT / "benchmarks"))
SVG = {"metadata": {"Date": None}}  # no timestamp inside: the file changes only when the picture does


def timeline() -> None:
    import jax
    import jax.numpy as jnp
    from _common import make_wave, wave_sites

    import deferax as dx

    forward, adjoint = make_wave(128, 200)  # a few ms a run: long enough to see, quick enough for CI
    wave, _ = wave_sites(forward, adjoint)
    key = jax.random.key(0)
    source = jax.random.normal(key, (128, 128))
    w = jax.random.normal(jax.random.fold_in(key, 1), (128, 128))

    def loss(source):
        return jnp.sum(w * wave(source))

    recorded = {}
    for schedule in ("standard", "auto"):
        step = dx.filter_value_and_grad(loss, schedule=schedule)
        for _ in range(3):  # compiled and warm
            jax.block_until_ready(step(source))
        with dx.record() as t:
            jax.block_until_ready(step(source))
        recorded["standard schedule" if schedule == "standard" else "deferred schedule"] = t
    fig = dx.plot_timelines(recorded, width=7.5)
    fig.suptitle("One gradient step of the wave stepper (128 x 128, 200 steps), eager, this machine", fontsize=9)
    fig.tight_layout()
    fig.savefig(IMAGES / "timeline.svg", **SVG)
    for name, t in recorded.items():
        print(f"{name}: {t.counts()}, {1e3 * (max(c.end for c in t.calls) - min(c.start for c in t.calls)):.1f} ms")


LINE = re.compile(r"^RESULT (\S+) (.+?): .*?ratio ([0-9.]+) \((?:target <= ([0-9.]+)|no target|for comparison)")


def benchmarks() -> None:
    source = ROOT / "benchmarks" / "results.txt"
    lines = source.read_text().splitlines()
    header = [ln[2:] for ln in lines if ln.startswith("# Measured")]
    runs: dict[str, list[float]] = {}
    targets: dict[str, float | None] = {}
    for ln in lines:
        m = LINE.match(ln)
        # speed-ups of the deferred schedules only
        if m and m.group(1) not in ("bench_typed", "bench_eager", "bench_mlp"):
            name = f"{m.group(1).removeprefix('bench_')}: {m.group(2)}"
            runs.setdefault(name, []).append(float(m.group(3)))
            targets[name] = float(m.group(4)) if m.group(4) else None
    names = list(runs)
    medians = [statistics.median(runs[n]) for n in names]
    fig, ax = plt.subplots(figsize=(7.5, 1.2 + 0.26 * len(names)))
    y = list(range(len(names)))
    colours = [
        "#55A868" if targets[n] is None or m <= targets[n] else "#C44E52" for n, m in zip(names, medians, strict=True)
    ]
    ax.barh(y, medians, color=colours, height=0.6)
    for i, n in enumerate(names):
        low, high = min(runs[n]), max(runs[n])
        ax.plot([low, high], [i, i], color="#333333", linewidth=1)
        if targets[n] is not None:
            ax.plot([targets[n], targets[n]], [i - 0.4, i + 0.4], color="black", linewidth=1.5)
        ax.text(
            max(high, targets[n] or 0) + 0.015,
            i,
            f"{low:.2f}-{high:.2f}" if low != high else f"{low:.2f}",
            va="center",
            fontsize=7,
        )
    ax.axvline(0.5, color="#4C72B0", linestyle="--", linewidth=1)
    ax.axvline(1.0, color="grey", linestyle=":", linewidth=1)
    ax.text(
        0.5, 1.0, "ideal 0.5 ", color="#4C72B0", fontsize=7, ha="right", va="bottom", transform=ax.get_xaxis_transform()
    )
    ax.text(1.0, 1.0, "no gain ", color="grey", fontsize=7, ha="right", va="bottom", transform=ax.get_xaxis_transform())
    ax.set_yticks(y, names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, max(1.15, max(max(r) for r in runs.values()) + 0.15))
    ax.set_xlabel(
        "time of deferax / time of the baseline: median of the runs, their range, black tick: target", fontsize=8
    )
    n_runs = max(len(r) for r in runs.values())
    when = [re.match(r"Measured (\S+ \S+) UTC to (\S+) UTC, ([^;]+)", h) for h in header]
    if when and all(when):
        title = f"{n_runs} run(s), {when[0].group(1)} to {when[-1].group(2)} UTC, {when[0].group(3)}"
    else:
        title = f"{n_runs} run(s)"
    fig.suptitle(title, fontsize=7, x=0.01, ha="left")
    fig.tight_layout()
    fig.savefig(IMAGES / "benchmarks.svg", **SVG)
    print(f"benchmarks: {len(names)} ratios, {n_runs} run(s), from {source.relative_to(ROOT)}")


def inverse_design(steps: int = 30) -> None:
    import importlib.util

    import numpy as np

    path = ROOT / "examples" / "inverse_design_ceviche.py"
    spec = importlib.util.spec_from_file_location("inverse_design_ceviche", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model = example.challenge("waveguide_bend")
    losses, design = example.optimise(model, steps, verbose=False)
    fig, (left, right) = plt.subplots(1, 2, figsize=(7.5, 3.2), gridspec_kw={"width_ratios": [1, 1.4]})
    left.imshow(np.asarray(model.density(np.asarray(design))).T, origin="lower", cmap="Greys", vmin=0, vmax=1)
    x0, y0, x1, y1 = model.design_region_coords
    left.add_patch(plt.Rectangle((x0 - 0.5, y0 - 0.5), x1 - x0, y1 - y0, fill=False, edgecolor="#C44E52", linewidth=1))
    left.set_title(f"density after {steps} steps (design region in red)", fontsize=8)
    left.set_xticks([]), left.set_yticks([])
    right.semilogy(range(1, steps + 1), losses, color="#4C72B0", marker=".")
    right.set_xlabel("Adam step", fontsize=8)
    right.set_ylabel("loss (invrs-gym's window loss)", fontsize=8)
    right.tick_params(labelsize=7)
    (nx, ny), waves = model.shape, len(model.output_wavelengths)
    fig.suptitle(f"ceviche-challenges' waveguide bend, {nx} x {ny} grid, {waves} wavelengths", fontsize=9)
    fig.tight_layout()
    fig.savefig(IMAGES / "inverse_design.svg", **SVG)
    print(f"inverse design: loss {losses[0]:.4g} -> {losses[-1]:.4g} in {steps} steps")


if __name__ == "__main__":
    IMAGES.mkdir(parents=True, exist_ok=True)
    plt.rcParams["svg.hashsalt"] = "deferax"
    timeline()
    benchmarks()
    inverse_design()
