"""Defaults per device: with the model on a GPU the keys the YAML leaves unset get GPU-sized
values, on the CPU today's; an explicit key always wins. CUDA is faked at its one boundary,
``torch.cuda.is_available``; the host's cores at ``os.sched_getaffinity``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from inboxd.config import DEFAULT_CONFIG_PATH, Config, load_config, parse_config
from inboxd.models.device import pick_device, with_device_defaults


@pytest.fixture
def sixteen_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> torch.device:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    device = pick_device("auto")
    assert device.type == "cuda"
    return device


def sized(config: Config) -> tuple[int, int, int, int, int]:
    return (config.preprocess.workers, config.batch.max_size, config.capacity.queue,
            config.capacity.preprocess_cache, config.capacity.preprocess_cache_mb)


def test_a_gpu_gets_gpu_sized_defaults_and_the_record_says_so(
        sixteen_cores: None, fake_cuda: torch.device, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    config, fields = with_device_defaults(load_config(DEFAULT_CONFIG_PATH), fake_cuda)
    assert sized(config) == (14, 64, 28, 128, 1024)  # cores - 2 decoders, batch 64, ...
    assert fields["PROFILE"] == "gpu"
    assert fields["PROFILE_DEFAULTS"] == ("preprocess.workers=14,batch.max_size=64,"
                                          "capacity.queue=28,capacity.preprocess_cache=128,"
                                          "capacity.preprocess_cache_mb=1024")
    # Everything else is the embedded default's.
    assert config.batch.max_delay_ms == 10 and config.capacity.event_buffer == 1024


def test_the_cpu_keeps_todays_defaults(sixteen_cores: None, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    embedded = load_config(DEFAULT_CONFIG_PATH)
    config, fields = with_device_defaults(embedded, pick_device("cpu"))
    assert sized(config) == (2, 4, 1, 4, 256) and config == embedded
    assert fields == {"PROFILE": "cpu", "PROFILE_DEFAULTS": "none"}


def test_explicit_yaml_wins_on_a_gpu(sixteen_cores: None, fake_cuda: torch.device) -> None:
    text = "preprocess: {workers: 6}\nbatch: {max_size: 16}\ncapacity: {preprocess_cache_mb: 64}\n"
    config, fields = with_device_defaults(parse_config(text, "mine.yaml"), fake_cuda)
    # The queue follows the decoders the user asked for; cache items stay the profile's.
    assert sized(config) == (6, 16, 12, 128, 64)
    assert fields["PROFILE_DEFAULTS"] == "capacity.queue=12,capacity.preprocess_cache=128"


def test_a_programs_batch_bound_caps_the_gpu_default(sixteen_cores: None,
                                                     fake_cuda: torch.device) -> None:
    config, _ = with_device_defaults(parse_config("", "empty.yaml"), fake_cuda, max_batch=32)
    assert config.batch.max_size == 32


def test_applying_twice_changes_nothing(sixteen_cores: None, fake_cuda: torch.device) -> None:
    once, _ = with_device_defaults(parse_config("", "empty.yaml"), fake_cuda)
    twice, fields = with_device_defaults(once, fake_cuda)
    assert twice == once and fields["PROFILE_DEFAULTS"] == "none"


def test_a_small_host_still_gets_two_decoders(monkeypatch: pytest.MonkeyPatch,
                                              fake_cuda: torch.device) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    config, _ = with_device_defaults(parse_config("", "empty.yaml"), fake_cuda)
    assert config.preprocess.workers == 2
