"""``runtime: auto`` by the CPU's features: OpenVINO bf16 where the CPU has AMX, ONNX Runtime fp32
elsewhere, and the real daemon serving OpenVINO from the cached artifact on a CPU with AMX.

The choice is tested for each CPU case with a fake /proc/cpuinfo (the boundary); whether the
openvino package is installed is passed in, as the callers pass ``openvino_runtime.available()``.
The end-to-end test runs on a CPU with AMX only (it is skipped elsewhere, and says why).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from inboxd.config import ConfigError, ModelConfig
from inboxd.models.runtimes import openvino_runtime
from inboxd.models.runtimes.choice import OPENVINO_NOT_INSTALLED, choose, cpu_flags

from tests.conftest import drop, line_fields, read_json, wait_until, write_config

# Flags of the three CPU families the choice tells apart (as /proc/cpuinfo lists them).
AMX_XEON = "avx2 fma avx512f avx512bw avx512vl avx512dq avx512_bf16 avx512_vnni amx_bf16 amx_tile"
ZEN5 = "avx2 fma avx512f avx512bw avx512vl avx512dq avx512_bf16 avx512_vnni"
AVX2_ONLY = "avx2 fma"


def flags_of(tmp_path: Path, line: str) -> frozenset[str]:
    (tmp_path / "proc").mkdir(parents=True, exist_ok=True)
    (tmp_path / "proc" / "cpuinfo").write_text(f"processor\t: 0\nflags\t\t: {line}\n")
    return cpu_flags(tmp_path)


@pytest.mark.parametrize("cpu, installed, runtime, precision, why", [
    (AMX_XEON, True, "openvino", "bf16", "OpenVINO bf16 on AMX is the fastest"),
    (AMX_XEON, False, "onnxruntime", "fp32", OPENVINO_NOT_INSTALLED),
    (ZEN5, True, "onnxruntime", "fp32", "onnxruntime fp32 is the fastest"),
    (AVX2_ONLY, True, "onnxruntime", "fp32", "bf16 not native"),
])
def test_auto_picks_by_the_cpus_features(tmp_path: Path, cpu: str, installed: bool,
                                         runtime: str, precision: str, why: str) -> None:
    flags = flags_of(tmp_path, cpu)
    chosen = choose(ModelConfig(), "cpu", flags=flags, cpu_capability="AVX512",
                    openvino=None if installed else OPENVINO_NOT_INSTALLED)
    assert (chosen.runtime, chosen.precision) == (runtime, precision), chosen.reason
    assert why in chosen.reason
    # bf16 chosen by auto is checked against fp32 on the probe batch before it serves.
    assert chosen.precision_by_auto


def test_the_yaml_wins_over_the_cpu(tmp_path: Path) -> None:
    amx, zen5 = flags_of(tmp_path / "a", AMX_XEON), flags_of(tmp_path / "z", ZEN5)
    pinned = choose(ModelConfig(runtime="onnxruntime"), "cpu", flags=amx, cpu_capability="x",
                    openvino=None)
    assert (pinned.runtime, pinned.precision) == ("onnxruntime", "fp32")
    exact = choose(ModelConfig(precision="fp32"), "cpu", flags=amx, cpu_capability="x",
                   openvino=None)
    assert (exact.runtime, exact.precision) == ("onnxruntime", "fp32")
    asked = choose(ModelConfig(runtime="openvino"), "cpu", flags=zen5, cpu_capability="x",
                   openvino=None)
    assert (asked.runtime, asked.precision) == ("openvino", "fp32")  # no AMX: bf16 is slower
    bf16 = choose(ModelConfig(runtime="openvino", precision="bf16"), "cpu", flags=zen5,
                  cpu_capability="x", openvino=None)
    assert (bf16.runtime, bf16.precision, bf16.precision_by_auto) == ("openvino", "bf16", False)
    torch = choose(ModelConfig(runtime="torch"), "cpu", flags=amx, cpu_capability="x",
                   openvino=None)
    assert torch.runtime == "torch"


def test_what_openvino_cannot_do_is_a_config_error_that_says_what_to_do(tmp_path: Path) -> None:
    amx = flags_of(tmp_path / "a", AMX_XEON)
    with pytest.raises(ConfigError, match="pip install openvino"):
        choose(ModelConfig(runtime="openvino"), "cpu", flags=amx, cpu_capability="x",
               openvino=OPENVINO_NOT_INSTALLED)
    with pytest.raises(ConfigError, match="bf16 natively"):
        choose(ModelConfig(runtime="openvino", precision="bf16"), "cpu",
               flags=flags_of(tmp_path / "o", AVX2_ONLY), cpu_capability="x", openvino=None)
    with pytest.raises(ConfigError, match="runtime: openvino runs on the CPU"):
        choose(ModelConfig(runtime="openvino"), "cuda", flags=amx, cpu_capability="x",
               gpu_capability=(9, 0), openvino=None)
    with pytest.raises(ConfigError, match="compile: true"):
        choose(ModelConfig(runtime="openvino", compile=True), "cpu", flags=amx,
               cpu_capability="x", openvino=None)


def amx_here() -> str | None:
    """Why the end-to-end test cannot run on this machine, or None."""
    if "amx_bf16" not in cpu_flags():
        return "this CPU has no AMX (amx_bf16): auto keeps ONNX Runtime fp32 here"
    return openvino_runtime.available()


@pytest.mark.daemon
@pytest.mark.timeout(900)  # one real export first: 15 s on a quiet core, minutes on a busy one
@pytest.mark.skipif(amx_here() is not None, reason=str(amx_here()))
def test_a_daemon_on_a_cpu_with_amx_serves_openvino_bf16_without_torch(
        tmp_path: Path, daemon_factory) -> None:
    """The defaults on this machine: the first start serves torch, exports and swaps in
    OpenVINO bf16 once it agrees with torch; a restart serves OpenVINO from the cached artifact
    without torch, and every result says what ran it."""
    from support.photos import photo_paths

    cache = tmp_path / "cache"
    config = write_config(tmp_path, model={"cache_dir": str(cache), "device": "cpu"})
    first = daemon_factory(config)
    started = line_fields(first.wait_for("started", 180)[0])
    assert (started["RUNTIME"], started["RUNTIME_CHOSEN"], started["PRECISION_CHOSEN"]) == (
        "torch", "openvino", "bf16"), started
    assert "amx_bf16" in started["BF16_NATIVE"]
    swapped = line_fields(first.wait_for("runtime", 600)[0])
    assert (swapped["RUNTIME"], swapped["PRECISION"]) == ("openvino", "bf16"), first.output()
    assert first.stop() == 0

    daemon = daemon_factory(config)
    started = line_fields(daemon.wait_for("started", 180)[0])
    assert (started["RUNTIME"], started["PRECISION"]) == ("openvino", "bf16"), started
    assert started["RUNTIME_ARTIFACT"] == "cached, served without torch", started
    assert started["TORCH_VERSION"] == "not loaded", started
    assert "OpenVINO bf16: top-1 equal on 4/4 probe images" in started["RUNTIME_REASON"]
    daemon.wait_for("ready")
    drop(photo_paths()["chelsea"], tmp_path / "inbox", "cat.png")
    result_path = tmp_path / "results" / "cat.png.json"
    wait_until(result_path.exists, 60, "the result JSON")
    result = read_json(result_path)
    assert (result["runtime"], result["precision"]) == ("openvino", "bf16")
    assert 281 <= result["top_k"][0]["index"] <= 285, result["top_k"][0]  # a cat
    maps = Path(f"/proc/{daemon.proc.pid}/maps").read_text()
    assert "libtorch" not in maps
    assert "libopenvino" in maps
    assert daemon.stop() == 0
