"""Run every benchmark, one process each, and print their RESULT lines together at the end.

    python benchmarks/run_all.py            # full sizes (a few minutes on a 2-core CPU)
    python benchmarks/run_all.py --small    # smoke test (seconds)
    python benchmarks/run_all.py --save benchmarks/results.txt   # also keep the RESULT lines

`--save` writes the RESULT lines with the date, the machine and the load average as `# `
lines on top: `.ci/pictures.py` draws the benchmarks page's chart from that file.

Runs every `benchmarks/bench_*.py` (as CI does), passing `--small` on when given.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time


def main() -> int:
    here = pathlib.Path(__file__).resolve().parent
    args = sys.argv[1:]
    save = None
    if "--save" in args:
        i = args.index("--save")
        if i + 1 >= len(args):
            print("run_all.py: --save needs a file name", file=sys.stderr)
            return 2
        save = pathlib.Path(args[i + 1])
        del args[i : i + 2]
    extra = [a for a in args if a == "--small"]
    unknown = [a for a in args if a != "--small"]
    if unknown:
        print(f"run_all.py: unknown arguments {unknown}; only --small and --save FILE are understood", file=sys.stderr)
        return 2
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load_before = os.getloadavg()[0]
    results: list[str] = []
    failed: list[str] = []
    for script in sorted(here.glob("bench_*.py")):
        name = script.name
        print(f"==> {name} {' '.join(extra)}", flush=True)
        proc = subprocess.run(
            [sys.executable, str(script), *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        print(proc.stdout, end="", flush=True)
        results += [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0:
            failed.append(name)
    print("==> summary")
    for line in results:
        print(line)
    for name in failed:
        print(f"FAILED {name}")
    if save is not None:
        sys.path.insert(0, str(here))
        from _common import machine

        ended = time.strftime("%H:%M UTC", time.gmtime())
        header = [
            f"# Measured {started} to {ended}, {machine()}.",
            f"# Load average (1 min) {load_before:.2f} at the start, {os.getloadavg()[0]:.2f} at the end.",
        ]
        save.write_text("\n".join([*header, *results]) + "\n")
        print(f"saved {len(results)} RESULT lines to {save}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
