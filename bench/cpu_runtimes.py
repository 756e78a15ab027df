"""The built-in model's CPU runtimes against each other on the real photos: speed in turns in one
run and the fidelity contract per runtime: what ``runtime: auto`` could pick on a CPU.

    python -m bench.cpu_runtimes [--rounds 5] [--batches 10] [--batch 8] [--threads 2]

Every variant runs the same ONNX export of the built-in model (``models/onnx_export.py``'s):
ONNX Runtime fp32 (the reference: it agrees with torch fp32 to float rounding), OpenVINO at each
inference precision its CPU plugin offers here (f32; bf16 where the CPU has AMX or AVX512_BF16).
Speed: each round runs every variant once, in the same order, so the load other processes put
on the machine drifts evenly over them; img/s is the median over rounds. Fidelity: the crops are
the exact decode of the upscaled and the real-photo corpus (``bench/fidelity.py``), counted as
the contract counts (``support/fidelity.py``: decisive top-1 agreement, median |Δ top-1 score|)
against ONNX Runtime fp32.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from bench import fidelity
from support import fidelity as contract

Run = Callable[[np.ndarray], np.ndarray]  # N×3×H×W float32 → N×classes logits


def onnx_bytes() -> bytes:
    from inboxd.config import ModelConfig
    from inboxd.models.loading import load_network
    from inboxd.models.runtimes import onnx as onnx_runtime

    model = load_network(ModelConfig(device="cpu", runtime="torch", precision="fp32"))
    return onnx_runtime.export_bytes(model.network.cpu().eval(), model.spec.crop, None,
                                     "bench.cpu_runtimes")


def onnxruntime_run(data: bytes, threads: int) -> Run:
    from inboxd.models.runtimes.onnx_artifact import session

    loaded = session(data, threads)
    name, out = loaded.get_inputs()[0].name, loaded.get_outputs()[0].name
    return lambda batch: np.asarray(loaded.run([out], {name: batch})[0])


def openvino_precisions() -> list[str]:
    """The precisions (inboxd's names) OpenVINO's CPU plugin runs natively on this CPU."""
    import openvino as ov

    capabilities = set(ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"))
    return ["fp32", *(["bf16"] if "BF16" in capabilities else [])]


def openvino_run(data: bytes, threads: int, precision: str) -> Run:
    """``data`` compiled by OpenVINO's CPU plugin at ``precision`` (set explicitly: on a CPU
    with AMX or AVX512_BF16 it would pick bf16 by itself), one stream, ``threads`` threads, no
    pinning (the decode workers share the cores), one infer request."""
    import openvino as ov
    import openvino.properties as props
    import openvino.properties.hint as hints

    core = ov.Core()
    compiled = core.compile_model(core.read_model(data), "CPU", {
        hints.inference_precision: {"fp32": "f32", "bf16": "bf16"}[precision],
        hints.performance_mode: hints.PerformanceMode.LATENCY,
        props.inference_num_threads: threads,
        props.num_streams: 1,
        hints.enable_cpu_pinning: False,
    })
    request = compiled.create_infer_request()
    output = compiled.outputs[0]

    def run(batch: np.ndarray) -> np.ndarray:
        # The request reuses its output buffer: copied before the next batch overwrites it.
        return np.array(request.infer({0: batch})[output], copy=True)

    return run


def openvino_runs(data: bytes, threads: int) -> dict[str, Run]:
    if importlib.util.find_spec("openvino") is None:
        print("(no OpenVINO rows: pip install -e '.[bench]')")
        return {}
    return {f"openvino {precision}": openvino_run(data, threads, precision)
            for precision in openvino_precisions()}


def normalised(crops: list[np.ndarray], spec: Any) -> np.ndarray:
    batch = np.stack(crops).astype(np.float32).transpose(0, 3, 1, 2)
    mean = np.asarray(spec.mean, dtype=np.float32).reshape(1, 3, 1, 1) * 255
    std = np.asarray(spec.std, dtype=np.float32).reshape(1, 3, 1, 1) * 255
    return np.ascontiguousarray((batch - mean) / std)


def softmax(run: Run, inputs: np.ndarray, batch: int) -> torch.Tensor:
    out = [torch.softmax(torch.from_numpy(run(inputs[i:i + batch])), dim=1)
           for i in range(0, len(inputs), batch)]
    return torch.cat(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cpu_runtimes")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=10, help="batches per variant a round")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--emit", action="store_true", help="end with one JSON line")
    args = parser.parse_args(argv)
    from inboxd.models.runtimes.choice import cpu_flags, native_bf16

    data = onnx_bytes()
    runs = {"onnxruntime fp32": onnxruntime_run(data, args.threads),
            **openvino_runs(data, args.threads)}
    spec = contract.model_spec()
    parts = fidelity.all_parts()
    exact = contract.mode_decode(spec, "exact")
    variants = [v for _, vs in parts for v in vs]
    crops = [exact((folder / v.file).read_bytes()) for folder, vs in parts for v in vs]
    inputs = normalised(crops, spec)
    reference = softmax(runs["onnxruntime fp32"], inputs, 32)
    origins = [o for o in contract.ORIGINS if any(v.origin == o for v in variants)]
    agreements: dict[str, dict[str, contract.Agreement]] = {}
    for name, run in runs.items():
        scores = softmax(run, inputs, 32)
        agreements[name] = {}
        for origin in [*origins, None]:
            rows = [i for i, v in enumerate(variants) if origin in (None, v.origin)]
            agreements[name][origin or "all"] = contract.compare(
                name, reference[rows], scores[rows], [variants[i].file for i in rows])
    batch = inputs[: args.batch]
    print(f"load average {os.getloadavg()[0]:.1f}, {args.threads} threads, batch {args.batch}, "
          f"native bf16: {native_bf16(cpu_flags()) or 'no'}, "
          f"AMX: {sorted(f for f in cpu_flags() if f.startswith('amx'))}", flush=True)
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():
        run(batch)  # warm-up
    for index in range(args.rounds):
        for name, run in runs.items():
            started = time.perf_counter()
            for _ in range(args.batches):
                run(batch)
            rates[name].append(args.batches * args.batch / (time.perf_counter() - started))
        print(f"round {index + 1}: " + ", ".join(f"{n} {r[-1]:.0f}" for n, r in rates.items()),
              flush=True)
    base = statistics.median(rates["onnxruntime fp32"])
    lines = [f"CPU runtimes of the built-in model ({args.threads} threads, batch {args.batch}, "
             f"native bf16: {', '.join(native_bf16(cpu_flags())) or 'no'}; load average "
             f"{os.getloadavg()[0]:.1f}); fidelity against onnxruntime fp32, as the contract "
             "counts it:",
             f"| runtime | img/s (median of {args.rounds}) | × onnxruntime fp32 | source | "
             "decisive top-1 agreement % | raw % | median abs Δ top-1 | max abs Δ | flips |",
             "|---|---|---|---|---|---|---|---|---|"]
    summary: dict[str, Any] = {}
    for name in runs:
        rate = statistics.median(rates[name])
        for origin, agreement in agreements[name].items():
            lines.append(f"| {name} | {rate:.0f} | {rate / base:.2f} | {origin} | "
                         f"{100 * agreement.decisive_agreement:.1f} of {agreement.decisive} | "
                         f"{100 * agreement.top1_agreement:.1f} | "
                         f"{agreement.median_delta:.4f} | {agreement.max_delta:.4f} | "
                         f"{len(agreement.flips)} |")
        holds = all(a.holds() for a in agreements[name].values())
        summary[name] = {"img_s": round(rate, 1), "rounds": [round(r, 1) for r in rates[name]],
                         "holds": holds}
        lines.append(f"{name}: {rate / base:.2f}× onnxruntime fp32, contract "
                     f"{'held' if holds else 'NOT held'} with the exact decode (the default "
                     "decode spends part of the same budget: bench/fidelity.py)")
    print("\n".join(lines))
    flips = {name: sorted({f for a in agreements[name].values() for f in a.flips})
             for name in runs}
    for name, found in flips.items():
        if found:
            print(f"{name} flips: " + "; ".join(found[:20]))
    if args.emit:
        print(json.dumps({"lines": lines, "runtimes": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
