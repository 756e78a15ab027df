# inboxd — `make run` and `make test` do their own set-up on a fresh Debian/Ubuntu machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CONFIG ?= config/inboxd.yaml
PYTEST_ARGS ?=

.PHONY: run test test-fast setup setup-test system-deps test-system-deps lint soak fuzz clean

# The default config's inbox is made here; a configured one that does not exist is an error
# (check-config and run say so): a typo must not start a daemon watching the wrong folder.
run: setup
	@if [ "$(CONFIG)" = config/inboxd.yaml ]; then mkdir -p var/inbox; fi
	$(BIN)/inboxd run -c $(CONFIG)

# The house is kept clean by the same command that tests it: lint first (seconds), then the suite.
test: setup-test lint
	@bash .ci/journald.sh
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The layers and the absence of import cycles are import-linter contracts in pyproject.toml.
# The inner loop (the aim: 3 minutes on 2 cores): the unit tests and the quicker end-to-end
# ones (real daemons included); the costlier ones are marked (pyproject's markers) and left to
# `make test`, which CI runs. Two pytest-xdist workers, one test file each at a time (a file's
# module fixtures are built once): much of a test is waiting (a settle time, a child's start),
# which the other worker fills. TEST_FAST_WORKERS=0 runs them in one process.
FAST_MARKERS := not (soak or slow or ray or nspawn or devicecheck)
TEST_FAST_WORKERS ?= 2
test-fast: setup-test
	@bash .ci/journald.sh
	$(BIN)/python -m pytest -m '$(FAST_MARKERS)' -p no:cacheprovider \
	  -n $(TEST_FAST_WORKERS) --dist loadfile $(PYTEST_ARGS)

lint: setup-test
	$(BIN)/ruff check daemon support tests bench
	$(BIN)/mypy
	$(BIN)/lint-imports

soak: setup-test
	@bash .ci/journald.sh
	$(BIN)/python -m pytest -m soak -p no:cacheprovider $(PYTEST_ARGS)

# The decoder fuzzer at full size: 20,000 seeded cases through the real decode workers (CI runs
# 5,000 of the same seed). Crashers land in tests/guarantees/crashers/ to be kept as regressions.
FUZZ_CASES ?= 20000
FUZZ_SEED ?= 20261201
fuzz: setup-test
	INBOXD_FUZZ_CASES=$(FUZZ_CASES) INBOXD_FUZZ_SEED=$(FUZZ_SEED) \
	  INBOXD_FUZZ_SAVE=tests/guarantees/crashers \
	  $(BIN)/python -m pytest -p no:cacheprovider -s tests/guarantees/test_fuzz.py \
	  -k seeded_mutations $(PYTEST_ARGS)

# The shipped unit under a real systemd (PID 1) in systemd-nspawn; part of `make test` too.
.PHONY: nspawn-test
nspawn-test: setup-test
	$(BIN)/python -m pytest -m nspawn -p no:cacheprovider tests/systemd/test_systemd_nspawn.py $(PYTEST_ARGS)

setup: $(VENV)/.runtime-installed
setup-test: $(VENV)/.test-installed | test-system-deps

# systemd-python compiles against libsystemd: install its headers when we can, else say how.
system-deps:
	@if ! pkg-config --exists libsystemd 2>/dev/null || ! command -v gcc >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing libsystemd-dev, pkg-config and gcc (needed to build systemd-python)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      libsystemd-dev pkg-config gcc python3-dev >/dev/null; \
	  else \
	    echo "systemd-python needs the libsystemd headers. Install them, then re-run make:"; \
	    echo "  sudo apt-get install libsystemd-dev pkg-config gcc python3-dev"; \
	    exit 1; \
	  fi; \
	fi

# The metrics tests scrape a real node_exporter (Debian's prometheus-node-exporter); the test
# starts it itself on 127.0.0.1, so its packaged service is not needed (or started here). The
# XMP tests read sidecars back with a real consumer, exiftool (libimage-exiftool-perl).
test-system-deps:
	@if ! command -v prometheus-node-exporter >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing prometheus-node-exporter (the metrics tests scrape a real one)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends prometheus-node-exporter >/dev/null; \
	  else \
	    echo "the metrics tests need node_exporter (they skip without it, fail in CI):"; \
	    echo "  sudo apt-get install prometheus-node-exporter"; \
	  fi; \
	fi
	@if ! command -v exiftool >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing libimage-exiftool-perl (the XMP tests read sidecars back with exiftool)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends libimage-exiftool-perl >/dev/null; \
	  else \
	    echo "the XMP tests need exiftool (they skip without it, fail in CI):"; \
	    echo "  sudo apt-get install libimage-exiftool-perl"; \
	  fi; \
	fi
	@if ! command -v mount.exfat-fuse >/dev/null || ! command -v mkfs.exfat >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing exfat-fuse and exfatprogs (outputs on a real exFAT are tested)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends exfat-fuse exfatprogs >/dev/null; \
	  else \
	    echo "the exFAT output tests need exfat-fuse and exfatprogs (they fail as root without):"; \
	    echo "  sudo apt-get install exfat-fuse exfatprogs"; \
	  fi; \
	fi

$(VENV)/bin/python:
	$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
	  { echo "inboxd needs Python >= 3.11 (found $$($(PYTHON) --version))"; exit 1; }
	$(PYTHON) -m venv $(VENV)

# model: ocr's networks: the files of this wheel, without its requirements (pyproject.toml says
# why); --ignore-requires-python because the wheel says <3.13 for its code, which is not used.
OCR_MODELS := rapidocr-onnxruntime==1.4.4

# Its stamp names the version: a new OCR_MODELS installs again.
OCR_MODELS_INSTALLED := $(VENV)/.installed-$(subst ==,-,$(OCR_MODELS))
$(OCR_MODELS_INSTALLED): | $(VENV)/bin/python
	$(BIN)/python -m pip install -q --no-deps --ignore-requires-python $(OCR_MODELS)
	touch $@

# Without -q: torch and its friends take minutes to fetch, and pip's progress says so.
$(VENV)/.runtime-installed: pyproject.toml $(OCR_MODELS_INSTALLED) | system-deps $(VENV)/bin/python
	$(BIN)/python -m pip install --progress-bar on -e .
	touch $@

$(VENV)/.test-installed: pyproject.toml $(OCR_MODELS_INSTALLED) | system-deps $(VENV)/bin/python
	$(BIN)/python -m pip install -q -e '.[test,ray,bench]'
	touch $(VENV)/.runtime-installed $@

clean:
	rm -rf var .pytest_cache .mypy_cache .ruff_cache

# The service, as root: the program in $(PREFIX)/.venv, the inboxd user and folders, the units,
# /etc/inboxd/inboxd.yaml (never overwritten), daemon-reload. Idempotent. See systemd/install.sh.
PREFIX ?= /opt/inboxd
.PHONY: install uninstall
install:
	@PREFIX=$(PREFIX) PYTHON=$(PYTHON) bash systemd/install.sh install

uninstall:
	@PREFIX=$(PREFIX) bash systemd/install.sh uninstall

# Benchmarks (bench/): one table + JSON + PNG under bench/out/. Not tests: figures, not asserts.
.PHONY: bench bench-sweep bench-ray bench-overhead bench-index bench-peer bench-fidelity bench-decoders bench-ocr
bench: setup-test
	$(BIN)/python -m bench.run $(BENCH_ARGS)

# Only the pipeline-overhead scenario of `make bench` (null model, 4,000 tiny JPEGs, 1 and 2
# instances, a cProfile run, peak RSS under 2,000 vs 20,000 files): a few minutes (10 on a
# saturated machine).
bench-overhead: setup-test
	$(BIN)/python -m bench.overhead $(BENCH_ARGS)

# Only the search index's stage: the flood with and without it, search at 100,000 photos.
bench-index: setup-test
	$(BIN)/python -m bench.index_cost --emit $(BENCH_ARGS)

# Only inboxd (default config) against the peer, bench/peer.py (libvips + ONNX Runtime, what a
# user would write instead), in turns at 0.3-MP JPEG, 12-MP JPEG and 12-MP HEIC, with a profile
# of a 12-MP JPEG's CPU by process and stage: 3-5 minutes on a quiet 2-core machine (the first
# run also encodes the HEIC photos). BENCH_ARGS="--scale quick" checks it works in about 2.
bench-peer: setup-test
	$(BIN)/python -m bench.peer_vs_inboxd $(BENCH_ARGS)

# The fidelity contract: every default fast decode path against resize: exact + eager fp32 on
# the 324-variant corpus (built once into var/corpus), with the draft/reducing_gap candidates.
bench-fidelity: setup-test
	$(BIN)/python -m bench.fidelity --sweep $(BENCH_ARGS)

# Only model: ocr against RapidOCR's own API in a loop, in turns, on 200 generated text images
# (rendered once into var/ocr-corpus): files/s ratio and the share of the peer's lines read
# the same. BENCH_ARGS="--count 24" checks it works.
bench-ocr: setup-test
	$(BIN)/python -m bench.ocr $(BENCH_ARGS)

# Pillow exact/fast against libvips, in worker-limited children, in turns.
bench-decoders: setup-test
	$(BIN)/python -m bench.decoders --interleaved $(BENCH_ARGS)

bench-sweep: setup-test
	$(BIN)/python -m bench.sweep $(BENCH_ARGS)

# engine: local against engine: ray (one replica on a local Ray cluster), appended to RESULTS.md.
bench-ray: setup-test
	$(BIN)/python -m bench.ray_vs_local --append $(BENCH_ARGS)
