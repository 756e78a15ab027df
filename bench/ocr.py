"""``make bench``'s OCR stage (``python -m bench.ocr``): inboxd with ``model: {name: ocr}``
against RapidOCR's own API called in a loop (``bench/ocr_peer.py``: the same networks, 2
threads, the same durable work), in turns, on generated text images: pages, receipts, signs
and text on the sample photos, every fifth stored turned with an EXIF tag
(``support/text_images.py``, rendered once and cached under ``var/ocr-corpus``).

Files/s: each side from the moment its files are there (after start-up and warm-up) to its
last durable result. The corpus is split in two halves run in the order peer, inboxd, inboxd,
peer, so drift on the shared machine falls on both sides alike; the figure is the ratio of the
totals, with each half's ratio beside it. Agreement: the share of the peer's lines that inboxd
read identically on the same file (whitespace runs collapsed), and each side's share of the
rendered lines read exactly.

    python -m bench.ocr [--count N] [--emit]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.procs import write_config
from support.daemon import DaemonProcess

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO / "var" / "ocr-corpus"
WORK = REPO / "var" / "ocr-bench"
SEED = 20261205


def corpus(count: int) -> tuple[list[Path], dict[str, list[str]]]:
    """The generated images (rendered once per count and seed) and the lines drawn on each."""
    stamp = CORPUS / f"corpus-{count}-{SEED}.json"
    if not stamp.exists():
        sys.path.insert(0, str(REPO))
        from support.text_images import generated

        shutil.rmtree(CORPUS, ignore_errors=True)
        CORPUS.mkdir(parents=True)
        drawn = {text.save(CORPUS).name: text.lines for text in generated(count, SEED)}
        stamp.write_text(json.dumps(drawn))
    drawn = json.loads(stamp.read_text())
    return [CORPUS / name for name in sorted(drawn)], drawn


def normalised(text: str) -> str:
    return " ".join(text.split())


def run_peer(files: list[Path], root: Path) -> tuple[float, dict[str, list[str]]]:
    shutil.rmtree(root, ignore_errors=True)
    (root / "inbox").mkdir(parents=True)
    for path in files:
        os.link(path, root / "inbox" / path.name)
    done = subprocess.run(
        [sys.executable, "-m", "bench.ocr_peer", "--inbox", str(root / "inbox"),
         "--results", str(root / "results"), "--done", str(root / "done")],
        cwd=REPO, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the peer exited {done.returncode}:\n{done.stderr[-3000:]}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    return float(report["seconds"]), report["lines"]


def run_inboxd(files: list[Path], root: Path) -> tuple[float, dict[str, list[str]], int]:
    """Seconds from the drop to the last result, the lines per file, and the crop layer's
    high-water mark."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    config = write_config(root, {"model": {"name": "ocr"}})
    daemon = DaemonProcess(config)
    try:
        daemon.wait_ready()
        staging = root / "staging"
        staging.mkdir()
        started = time.monotonic()
        for path in files:  # renamed in, as well-behaved writers do: taken at once
            os.link(path, staging / path.name)
            os.rename(staging / path.name, root / "inbox" / path.name)
        results = root / "results"
        expected = {f"{path.name}.json" for path in files}
        while not expected <= set(os.listdir(results) if results.exists() else ()):
            daemon.check_alive()
            time.sleep(0.02)
        seconds = time.monotonic() - started
        stats = daemon.next_stats()
    finally:
        daemon.stop()
    lines = {path.name: [line["text"] for line in json.loads(
        (results / f"{path.name}.json").read_text())["ocr"]["lines"]] for path in files}
    return seconds, lines, int(stats.get("OCR_CROPS_HIGH_WATER", 0))


def agreement(ours: dict[str, list[str]], theirs: dict[str, list[str]]) -> tuple[int, int]:
    """(the peer's lines inboxd read identically on the same file, the peer's lines)."""
    same = total = 0
    for name, peer_lines in theirs.items():
        mine = Counter(normalised(line) for line in ours.get(name, []))
        for line in peer_lines:
            total += 1
            if mine[normalised(line)] > 0:
                mine[normalised(line)] -= 1
                same += 1
    return same, total


def exact(read: dict[str, list[str]], drawn: dict[str, list[str]]) -> float:
    hits = sum(sum(normalised(line) in {normalised(r) for r in read.get(name, [])}
                   for line in lines) for name, lines in drawn.items())
    return hits / max(1, sum(len(lines) for lines in drawn.values()))


def summary(r: dict[str, Any]) -> str:
    return (f"OCR ({r['files']} generated text images, {r['stored_turned']} stored turned): "
            f"inboxd {r['inboxd_files_per_s']} files/s, RapidOCR's API in a loop "
            f"{r['peer_files_per_s']} files/s: ratio {r['ratio']} (turns {r['ratio_by_turn']}); "
            f"{r['lines_equal']}/{r['peer_lines']} of the peer's lines equal "
            f"({100 * r['lines_equal_share']:.1f}%); rendered lines read exactly: inboxd "
            f"{100 * r['inboxd_exact_share']:.1f}%, peer {100 * r['peer_exact_share']:.1f}%; "
            f"ocr_crops high-water {r['ocr_crops_high_water']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--emit", action="store_true", help="print the JSON line last")
    args = parser.parse_args()
    files, drawn = corpus(args.count)
    halves = [files[0::2], files[1::2]]
    peer_s, inboxd_s = [0.0, 0.0], [0.0, 0.0]
    peer_lines: dict[str, list[str]] = {}
    inboxd_lines: dict[str, list[str]] = {}
    high_water = 0
    for turn, half in ((0, halves[0]), (1, halves[1])):
        order = ("peer", "inboxd") if turn == 0 else ("inboxd", "peer")
        for side in order:
            if side == "peer":
                peer_s[turn], found = run_peer(half, WORK / "peer")
                peer_lines.update(found)
            else:
                inboxd_s[turn], found, mark = run_inboxd(half, WORK / "inboxd")
                inboxd_lines.update(found)
                high_water = max(high_water, mark)
            print(f"[ocr] turn {turn + 1}: {side} {len(half)} files in "
                  f"{(peer_s if side == 'peer' else inboxd_s)[turn]:.1f} s", file=sys.stderr)
    same, total = agreement(inboxd_lines, peer_lines)
    result: dict[str, Any] = {
        "files": len(files),
        "stored_turned": sum(path.suffix == ".jpg" for path in files),
        "peer_files_per_s": round(len(files) / sum(peer_s), 3),
        "inboxd_files_per_s": round(len(files) / sum(inboxd_s), 3),
        "ratio": round(sum(peer_s) / sum(inboxd_s), 3),
        "ratio_by_turn": [round(p / i, 3) for p, i in zip(peer_s, inboxd_s, strict=True)],
        "peer_lines": total,
        "lines_equal": same,
        "lines_equal_share": round(same / max(1, total), 4),
        "inboxd_exact_share": round(exact(inboxd_lines, drawn), 4),
        "peer_exact_share": round(exact(peer_lines, drawn), 4),
        "ocr_crops_high_water": high_water,
    }
    print(summary(result), file=sys.stderr)
    if args.emit:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
