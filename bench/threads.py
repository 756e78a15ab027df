"""Profile evidence, not part of ``make bench``: the same inboxd flood under different OpenMP
settings, interleaved round by round so that the machine's load drifts evenly over them.

On a 2-core machine inboxd runs 2 decode threads next to torch's intra-op pool (2 threads by
default, spin-waiting between parallel regions). This checks what that costs:

    python -m bench.threads [--rounds 3] [--flood 240]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

from bench import scenarios
from bench.measure import ResultWatcher
from bench.photos import build_corpus
from bench.procs import Daemon, RssSampler, write_config
from bench.run import BENCH_DIR, CORPUS_DIR, MIXES, WORK_DIR, load_avg, log

VARIANTS: dict[str, dict[str, str]] = {
    "default": {},
    "OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
    "OMP_NUM_THREADS=1": {"OMP_NUM_THREADS": "1"},
}


def one_flood(env: dict[str, str], flood: int, photos: list[Any]) -> float:
    root = WORK_DIR / "threads"
    if root.exists():
        import shutil

        shutil.rmtree(root)
    root.mkdir(parents=True)
    daemon = Daemon(write_config(root), env=env)
    run = scenarios.Running(root, daemon, RssSampler(daemon.pid),
                            ResultWatcher(root / "results", scenarios.FLOOD_POLL_S), 0)
    try:
        daemon.wait_ready()
        daemon.next_stats()
        run.idle_rss = run.rss.now()
        return float(scenarios.flood(run, photos, flood, flood * 3 + 120)["files_per_s"])
    finally:
        run.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--flood", type=int, default=240)
    args = parser.parse_args()
    photos = [p for p in build_corpus(CORPUS_DIR) if MIXES["mixed"](p)]
    rates: dict[str, list[float]] = {name: [] for name in VARIANTS}
    loads: list[float] = []
    for round_no in range(args.rounds):
        for name, env in VARIANTS.items():
            loads.append(load_avg())
            rates[name].append(one_flood(env, args.flood, photos))
            log(f"round {round_no + 1}: {name}: {rates[name][-1]:.1f} files/s "
                f"(load average {loads[-1]})")
    summary = {name: {"median": round(statistics.median(v), 2), "runs": v}
               for name, v in rates.items()}
    print(json.dumps({"flood": args.flood, "loadavg": loads, "files_per_s": summary}, indent=1))
    (BENCH_DIR / "out").mkdir(exist_ok=True)
    (BENCH_DIR / "out" / "threads.json").write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
