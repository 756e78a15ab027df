"""The model alone on the CPU, runner against runner, in turns in one run: what ``runtime: auto``
rests on. Not part of ``make bench`` (it needs no daemon); figures go to ``bench/RESULTS.md``.

    python -m bench.runtimes [--rounds 5] [--batches 10] [--batch 8] [--compile]

Each round runs every variant once, in the same order, so the load other processes put on the
machine drifts evenly over them; img/s is the median over rounds. The input is the real photos'
crops (the same uint8 crops and normalisation the daemon uses, through ``Model.run``), and each
variant's agreement with eager fp32 on them is printed next to its speed.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch


def variants(model: Any, compile_too: bool) -> dict[str, Any]:
    from inboxd.models.runtimes import onnx as onnx_runtime
    from inboxd.models.runtimes.runner import Runner

    threads = torch.get_num_threads()
    network = model.network
    key = onnx_runtime.expected_key(network, model.spec.crop, None)
    started = time.perf_counter()
    data = onnx_runtime.export_bytes(network, model.spec.crop, None, key)
    print(f"export: {time.perf_counter() - started:.1f} s, {len(data) / 2**20:.1f} MiB",
          flush=True)
    found: dict[str, Any] = {
        "eager fp32": model.torch_runner("fp32"),
        "eager bf16 autocast": model.torch_runner("bf16"),
        "onnxruntime fp32 (no spinning: the default)": onnx_runtime.from_bytes(data, threads),
    }
    import onnxruntime as ort

    spinning = onnx_runtime.session_options(threads)
    spinning.add_session_config_entry("session.intra_op.allow_spinning", "1")
    session = ort.InferenceSession(data, spinning, providers=["CPUExecutionProvider"])
    found["onnxruntime fp32, spinning pool"] = onnx_runtime.runner(
        onnx_runtime.OnnxNetwork(session))
    if compile_too:
        import torch._inductor.config as inductor

        inductor.freezing = True
        compiled = torch.compile(network)
        found["torch.compile + freezing + bf16"] = Runner("torch", "bf16", compiled)
    return found


def timed(run: Callable[[], Any], batches: int) -> float:
    started = time.perf_counter()
    for _ in range(batches):
        run()
    return time.perf_counter() - started


def agreement(model: Any, runner: Any, reference: torch.Tensor,
              crops: Sequence[np.ndarray]) -> str:
    got = torch.softmax(model.run(crops, runner), 1)
    want = torch.softmax(reference, 1)
    equal = int((got.argmax(1) == want.argmax(1)).sum())
    top = want.argmax(1, keepdim=True)
    top_diff = (got.gather(1, top) - want.gather(1, top)).abs().squeeze(1)
    return (f"top-1 {equal}/{len(crops)} equal, |Δ top-1 score| median "
            f"{float(top_diff.median()):.1e} max {float(top_diff.max()):.1e}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.runtimes")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=10, help="batches per variant a round")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--compile", action="store_true",
                        help="also torch.compile + freezing + bf16 (minutes of compiling)")
    args = parser.parse_args(argv)

    from inboxd.config import ModelConfig
    from inboxd.decode.pillow import decode_image
    from inboxd.models.loading import load_network

    from support.photos import photo_paths

    with tempfile.TemporaryDirectory() as cache:
        model = load_network(ModelConfig(device="cpu", runtime="torch", precision="fp32",
                                       cache_dir=Path(cache)))
    crops = [decode_image(p.read_bytes(), model.spec, 89_478_485).pixels
             for p in photo_paths().values()]
    batch = (crops * (args.batch // len(crops) + 1))[: args.batch]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}, batch {args.batch}, load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    runners = variants(model, args.compile)
    reference = model.run(crops, runners["eager fp32"])
    agreements = {}
    for name, runner in runners.items():
        started = time.perf_counter()
        model.run(batch, runner)  # warm-up (and torch.compile's compile)
        print(f"warm-up {name}: {time.perf_counter() - started:.1f} s", flush=True)
        agreements[name] = agreement(model, runner, reference, crops)
    rates: dict[str, list[float]] = {name: [] for name in runners}
    for round_index in range(args.rounds):
        for name, runner in runners.items():
            seconds = timed(functools.partial(model.run, batch, runner), args.batches)
            rates[name].append(args.batches * args.batch / seconds)
        print(f"round {round_index + 1}: " + ", ".join(
            f"{name.split(' (')[0]} {rates[name][-1]:.0f}" for name in runners), flush=True)
    base = statistics.median(rates["eager fp32"])
    print(f"\n{'variant':48} {'img/s':>7} {'x eager':>8}  agreement with eager fp32 "
          f"({len(crops)} photos)")
    for name in runners:
        rate = statistics.median(rates[name])
        print(f"{name:48} {rate:7.1f} {rate / base:8.2f}  {agreements[name]}")
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
