"""Run every benchmark, one process each, and print their RESULT lines together at the end.

    python benchmarks/run_all.py            # full sizes (a few minutes on a 2-core CPU)
    python benchmarks/run_all.py --small    # smoke test (seconds)

Runs every `benchmarks/bench_*.py` (as CI does), passing `--small` on when given.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys


def main() -> int:
    here = pathlib.Path(__file__).resolve().parent
    extra = [a for a in sys.argv[1:] if a == "--small"]
    unknown = [a for a in sys.argv[1:] if a != "--small"]
    if unknown:
        print(f"run_all.py: unknown arguments {unknown}; only --small is passed on", file=sys.stderr)
        return 2
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
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
