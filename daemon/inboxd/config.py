"""The YAML configuration: one pydantic model per concern, every unknown key an error.

A bad file is reported with every problem at once, each with its YAML line and key path, and the
process exits with ``EX_CONFIG`` (78) so that systemd's ``RestartPreventExitStatus=78`` stops a
restart loop instead of hammering a config that cannot work.

Every key of the YAML lives here, next to its default, its unit and its check: reading this one
file is reading the whole configuration surface.
"""

from __future__ import annotations

import difflib
import os
import re
import stat
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

# Re-exported for the code that has always imported them from here (inboxd.exit_codes has them).
from inboxd.exit_codes import EX_CONFIG as EX_CONFIG
from inboxd.exit_codes import EX_TEMPFAIL as EX_TEMPFAIL
from inboxd.logs import shown

MAX_CONFIG_BYTES = 16 << 20  # far beyond any real configuration
DEFAULT_CONFIG_PATH = Path(__file__).resolve().parents[2] / "config" / "inboxd.yaml"

Positive = Annotated[int, Field(gt=0)]
NonNegative = Annotated[float, Field(ge=0)]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class InboxConfig(Section):
    paths: list[Path] = Field(default_factory=lambda: [Path("var/inbox")], min_length=1)
    recursive: bool = True
    # Unset: every format this build decodes (inboxd.decode.formats; `check-config` lists
    # them). Patterns match file names without regard to case.
    include: Annotated[list[str], Field(min_length=1)] | None = None
    # watchfiles has no close-write event: a file is taken once its mtime is this old.
    settle_ms: NonNegative = 250
    rescan_interval_s: Annotated[float, Field(gt=0)] = 30
    after_success: Literal["move", "delete", "keep"] = "move"
    # inotify does not see other hosts' writes on NFS, SMB, FUSE or 9p: auto polls those
    # (found by statfs at start-up), always polls every inbox, never trusts inotify anywhere.
    poll: Literal["auto", "always", "never"] = "auto"
    poll_interval_ms: Annotated[int, Field(ge=50)] = 1000

    @field_validator("paths")
    @classmethod
    def _distinct_names(cls, paths: list[Path]) -> list[Path]:
        # With several inboxes, results are filed under each inbox's folder name.
        names = [p.name for p in paths]
        if len(paths) > 1 and len(set(names)) != len(names):
            raise ValueError("several inbox paths must have distinct folder names")
        return paths


class CapacityConfig(Section):
    event_buffer: Positive = 1024
    queue: Positive = 1
    preprocess_cache: Positive = 4
    preprocess_cache_mb: Positive = 256
    retry_list: Positive = 256
    # Batches sent to the model and not answered yet. The local engine on the CPU runs torch
    # one batch at a time whatever this says, and ONNX Runtime's cached artifact, where this
    # is at least the cores at start, one single-threaded batch per core (else one batch
    # across the cores); on CUDA it takes this many (the copy of one overlaps the
    # compute of another); engine: ray keeps up to this many in flight across the replicas.
    # The next batch waits here, never in Serve's own queue.
    in_flight_batches: Positive = 4
    # model: ocr only: crops cut out of a photo and waiting for the recogniser. A photo's
    # regions are cut this many at a time, so a page of small print holds no more.
    ocr_crops: Positive = 32
    # models: only: photos handed to the tasks and not yet answered by every one (each task
    # takes them in order, at its own pace; a fast task runs at most this far ahead of the
    # slowest). Unset: (batches out + 1) x batch.max_size of the task with the most, the
    # photos one model: config holds at most past the cache (its calls out and one forming
    # batch; batches out is 1 on an engine that takes one call at a time).
    task_join: Positive | None = None


class BatchConfig(Section):
    max_size: Positive = 4
    max_delay_ms: NonNegative = 10


class PreprocessConfig(Section):
    """Decoding untrusted bytes, in ``workers`` processes, each file bounded before any work."""

    workers: Positive = 2  # decode worker processes, one file each at a time
    # Files named in one request to a worker (each still decoded alone, one after another): a
    # round trip per file cost a flood of small images more than their decode. A decoder takes
    # a fair share of what the queue holds, up to this many, and passes their crops on when the
    # whole request is done, so a file that hangs its worker holds the others of its request
    # back by up to decode_timeout_s; 1 gives every file its own request.
    files_per_request: Annotated[int, Field(ge=1, le=64)] = 16
    # Pillow's own default: larger images are refused as decompression bombs.
    max_image_pixels: Positive = 89_478_485
    # Checked on the opened file before a byte is read. 256 MiB holds max_image_pixels of
    # uncompressed 8-bit RGB; a JPEG header followed by gigabytes of junk is refused.
    max_file_mb: Positive = 256
    # Address space a worker may add for one decode (RLIMIT_AS above its warmed-up size): room
    # for an RGBA PNG of max_image_pixels, the largest legitimate decode (docs/decisions.md).
    decode_memory_mb: Positive = 1536
    # Hashing and decoding one file; past it the worker is killed and replaced, the file fails.
    # A few times the slowest legitimate decode (a max_image_pixels RGBA PNG on a busy CPU).
    decode_timeout_s: Annotated[float, Field(gt=0)] = 30
    # auto: with the model on a GPU, baseline JPEGs whose header passes a check on the CPU are
    # decoded there by nvJPEG, in the daemon's process; off: every byte in the sandboxed
    # workers (inboxd.decode.tensor says what the trade-off is).
    gpu_decode: Literal["auto", "off"] = "auto"
    # fast: JPEGs decoded at a reduced scale by libjpeg (DCT scaling) to a margin above the
    # model's resize target, then a two-step resize; within the fidelity contract of
    # bench/fidelity.py (top-1 agreement >= 99%, median score change <= 0.01) and several
    # times faster on large photos. exact: torchvision's Resize + CenterCrop pixels.
    # fastest: JPEGs decoded by libjpeg right down to the resize target (shrink-on-load, what
    # libvips thumbnail does): outside the contract, the top-1 class changes on a few percent
    # of real photos (README, Performance).
    resize: Literal["fast", "exact", "fastest"] = "fast"


Interpolation = Literal["bilinear", "bicubic", "nearest", "lanczos"]
Triple = tuple[float, float, float]


class ModelInputConfig(Section):
    """How each image becomes the model's input tensor. Unset keys take the model's defaults
    (torchvision and export: 256 bilinear, crop 224, ImageNet mean/std; built-in: 256 bicubic,
    crop 224, mean/std 0.5, as ``inboxd.models.efficientnet_lite`` says)."""

    resize: Positive | None = None  # the shorter side is scaled to this many pixels ...
    interpolation: Interpolation | None = None
    crop: Positive | None = None  # ... then a centered square of this size is cut out
    mean: Triple | None = None  # per channel, on the 0-1 scale (torchvision's convention)
    std: Triple | None = None
    # rgb; bgr (channels swapped, for OpenCV/Caffe-trained models); gray (luma, as Pillow's
    # convert("L"), copied onto all three channels, for models trained on greyscale images).
    color: Literal["rgb", "bgr", "gray"] = "rgb"
    # output: detect: the square the whole photo is fitted into (aspect ratio kept, padded
    # centred: the letterbox). Unset: an ONNX detector's own fixed input, else 640; for a
    # torchvision detector the longest side its own transform resizes to.
    size: Annotated[int, Field(gt=0, le=4096)] | None = None

    @field_validator("mean", "std")
    @classmethod
    def _unit_scale(cls, values: Triple | None, info: ValidationInfo) -> Triple | None:
        if values is None:
            return None
        if info.field_name == "std" and min(values) <= 0:
            raise ValueError("std values must be > 0")
        if max(abs(v) for v in values) > 1:
            # The classic mistake: pixel-scale numbers such as 123.675 copied from Caffe/OpenCV.
            raise ValueError(
                f"{info.field_name} is on the 0-1 scale (pixel value / 255), e.g. 0.485, "
                "not 123.675"
            )
        return values

    @model_validator(mode="after")
    def _crop_fits(self) -> ModelInputConfig:
        if self.crop is not None and self.resize is not None and self.crop > self.resize:
            raise ValueError(f"crop ({self.crop}) must not be larger than resize ({self.resize})")
        return self


class DetectConfig(Section):
    """``output: detect``: how a detector's raw output becomes each photo's boxes."""

    # yolo: one output N×(4+classes)×candidates, cx,cy,w,h in the letterboxed input, no NMS
    # inside (an Ultralytics export); boxes: NMS inside, boxes/scores/labels outputs (or one
    # N×K×6 output: x0,y0,x1,y1,score,label). auto: told apart from the output shapes, which
    # start-up refuses when they could be either.
    layout: Literal["auto", "yolo", "boxes"] = "auto"
    score_threshold: Annotated[float, Field(ge=0, le=1)] = 0.25
    iou_threshold: Annotated[float, Field(gt=0, le=1)] = 0.45  # class-wise NMS (yolo layout)
    # Boxes kept per photo, the best first: the bound on what one photo adds to its result.
    max_detections: Annotated[int, Field(gt=0, le=10000)] = 100
    pad_value: Annotated[int, Field(ge=0, le=255)] = 114  # the letterbox's grey, as Ultralytics


ModelKind = Literal["builtin", "torchvision", "export", "onnx", "ocr"]
# The environment variable systemd sets for a unit's CacheDirectory= (several: colon-separated).
CACHE_DIRECTORY_ENV = "CACHE_DIRECTORY"
# The search index's file inside results_dir unless ``index:`` names another (hidden: never
# taken for a result, whose files end in .json).
INDEX_FILENAME = ".inboxd-index.sqlite3"


class RayConfig(Section):
    """``model.engine: ray``: where the Serve application runs and what each replica needs.
    Checked here without connecting; ``inboxd models`` connects and deploys."""

    # A ``ray start`` address (HOST:PORT of the head's GCS, or ray://HOST:PORT), or auto:
    # RAY_ADDRESS, else the Ray node running on this host.
    address: str = "auto"
    replicas: Positive = 2
    # What one replica reserves on its node, e.g. {GPU: 1}; {CPU: 1} or a custom resource on a
    # cluster without GPUs. A replica that cannot be placed waits for a node that has it.
    replica_resources: dict[str, Annotated[float, Field(gt=0)]] = Field(
        default_factory=lambda: {"GPU": 1.0})
    app_name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]+$", max_length=64)] = "inboxd"
    # How long one batch may take on a replica before it counts as lost (a hung replica):
    # the batch is retried like one whose replica died.
    call_timeout_s: Annotated[float, Field(gt=0)] = 120
    # Waits between reconnection attempts while the cluster is unreachable (doubling).
    reconnect_initial_s: Annotated[float, Field(gt=0)] = 1
    reconnect_max_s: Annotated[float, Field(gt=0)] = 30

    @field_validator("address")
    @classmethod
    def _address(cls, address: str) -> str:
        if address == "auto":
            return address
        if split_host_port(address.removeprefix("ray://")) is None:
            raise ValueError("give auto, HOST:PORT of the head (what `ray start --head` "
                             "printed, e.g. 10.0.0.5:6379) or ray://HOST:10001")
        return address

    @field_validator("replica_resources")
    @classmethod
    def _some_resource(cls, resources: dict[str, float]) -> dict[str, float]:
        if not resources:
            raise ValueError("name what one replica needs, e.g. {GPU: 1} or {CPU: 1}")
        return resources

    @model_validator(mode="after")
    def _backoff_ordered(self) -> RayConfig:
        if self.reconnect_max_s < self.reconnect_initial_s:
            raise ValueError("reconnect_max_s must be >= reconnect_initial_s")
        return self


class ModelConfig(Section):
    """Which network, where its files are, what it outputs and how it runs.

    Exactly one of ``name`` (the built-in, also the default when none is given),
    ``torchvision`` or ``export`` says what to load. The checks that need the files or torch
    (shapes, labels count, the device) run when the model is loaded, at start-up: see
    ``inboxd.models.loading``.
    """

    # efficientnet_lite0 (ImageNet labels) or ocr (text lines: PP-OCRv4 in ONNX Runtime).
    name: Literal["efficientnet_lite0", "ocr"] | None = None
    torchvision: str | None = None  # an architecture name from torchvision.models
    export: Path | None = None  # a torch.export .pt2 program
    onnx: Path | None = None  # an ONNX network, run by ONNX Runtime on the CPU
    weights: Path | None = None  # torchvision: the state_dict file
    num_classes: Positive | None = None  # torchvision: default = the labels count, else 1000
    labels: Path | None = None  # one label per line, or a JSON list
    input: ModelInputConfig = ModelInputConfig()
    output: Literal["classify", "embed", "detect"] = "classify"
    top_k: Annotated[int, Field(gt=0, le=1000)] = 5  # classify only
    # name: ocr only: text regions read per photo, the best by the detector's score; a photo
    # with more says how many were cut. RapidOCR's own bound (max_candidates) is 1000.
    max_regions: Annotated[int, Field(gt=0, le=100_000)] = 1000
    detect: DetectConfig = DetectConfig()
    device: str = "auto"
    # auto: from the device's capability and the runtime (inboxd.models.runtimes.choice says
    # how); the choice and its reason are in the started record. An explicit value wins.
    precision: Literal["auto", "fp32", "fp16", "bf16"] = "auto"
    compile: bool = False
    # What runs the network: torch (eager, or compiled with compile: true), onnxruntime (the
    # network exported once to ONNX, cached in cache_dir, swapped in between batches once it
    # agrees with torch on a probe batch), or auto (onnxruntime on the CPU where it applies).
    runtime: Literal["auto", "torch", "onnxruntime"] = "auto"
    # Built artifacts (the exported ONNX network). Unset: $CACHE_DIRECTORY (systemd's
    # CacheDirectory=), else a cache folder beside results_dir.
    cache_dir: Path | None = None
    # Where the model runs: a thread of this process (local) or a Ray Serve application.
    engine: Literal["local", "ray"] = "local"
    ray: RayConfig = RayConfig()
    # models: only (a model: block has the top-level batch: and capacity.in_flight_batches):
    # this task's own batches and its own bound on batches sent and unanswered; unset, the
    # top-level ones.
    batch: BatchConfig | None = None
    in_flight_batches: Positive | None = None

    # Field validators see the fields declared before them in ``info.data``, so a key that
    # does not fit the model kind is reported at its own YAML line, not at ``model:``.

    @field_validator("torchvision")
    @classmethod
    def _one_source(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("name") is not None:
            raise ValueError("give either name (the built-in) or torchvision, not both")
        return value

    @field_validator("export")
    @classmethod
    def _one_program(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        if value is not None and (info.data.get("name") or info.data.get("torchvision")):
            raise ValueError("export is a model of its own: remove name/torchvision")
        return _absolute(value)

    @field_validator("onnx")
    @classmethod
    def _one_onnx(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        if value is not None and (info.data.get("name") or info.data.get("torchvision")
                                  or info.data.get("export")):
            raise ValueError("onnx is a model of its own: remove name/torchvision/export")
        return _absolute(value)

    @field_validator("weights", "num_classes")
    @classmethod
    def _torchvision_only(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and info.data.get("torchvision") is None:
            if info.data.get("export") or info.data.get("onnx"):
                why = ("a program carries its own weights" if info.field_name == "weights"
                       else "a program's output size is its class count")
            else:
                why = "the built-in model is EfficientNet-Lite0 with its ImageNet weights"
            raise ValueError(f"{info.field_name} only applies to torchvision: models ({why})")
        return _absolute(value) if isinstance(value, Path) else value

    @field_validator("labels")
    @classmethod
    def _not_builtin(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        if value is not None and not (info.data.get("torchvision") or info.data.get("export")
                                      or info.data.get("onnx")):
            raise ValueError("the built-in model uses the ImageNet class names; labels only "
                             "applies to torchvision:, export: and onnx: models")
        return _absolute(value)

    @field_validator("device")
    @classmethod
    def _known_device(cls, device: str) -> str:
        if device in ("auto", "cpu", "cuda") or device.startswith("cuda:"):
            return device
        raise ValueError("device must be auto, cpu, cuda or cuda:N")

    @field_validator("precision")
    @classmethod
    def _precision_fits_device(cls, precision: str, info: ValidationInfo) -> str:
        # Only an explicit cpu is known here; device: auto is checked again once resolved.
        if precision == "fp16" and info.data.get("device") == "cpu":
            raise ValueError("fp16 needs a CUDA GPU (CPUs have no fast fp16 kernels); "
                             "use fp32 or bf16 on the CPU")
        return precision

    @field_validator("cache_dir")
    @classmethod
    def _cache_absolute(cls, value: Path | None) -> Path | None:
        return _absolute(value)

    @model_validator(mode="after")
    def _complete(self) -> ModelConfig:
        if self.onnx is not None and (self.compile or self.runtime == "torch"):
            raise ValueError("an onnx: model runs in onnxruntime: remove compile: true and "
                             "runtime: torch")
        if self.onnx is not None and self.precision in ("fp16", "bf16"):
            raise ValueError("an onnx: model runs at the precision it was exported with: "
                             "set precision: auto or fp32")
        if self.name == "ocr":
            self._check_ocr()
        elif self._not_default({"max_regions"}):
            raise ValueError("max_regions only applies to name: ocr")
        if self.output == "detect" and self.kind not in ("torchvision", "onnx", "export"):
            raise ValueError("output: detect runs a detector you bring: torchvision: ARCH with "
                             "weights: PATH, or onnx: PATH or export: PATH (a YOLO-layout or "
                             "boxes/scores/labels export)")
        if (self.output == "detect" and self.export is not None
                and (self.compile or self.runtime == "onnxruntime")):
            raise ValueError("an export: detector runs in torch as it was exported: remove "
                             "compile: true and runtime: onnxruntime")
        if self.torchvision is not None and self.weights is None:
            raise ValueError(
                "torchvision: needs weights: PATH, a local state_dict file "
                "(torch.save(model.state_dict(), PATH)); inboxd never downloads weights"
            )
        return self

    def _not_default(self, keys: set[str]) -> list[str]:
        """Which of ``keys`` hold other than their defaults (a config comes back from the
        commit process as a full dump, so being set says nothing)."""
        fields = type(self).model_fields
        return sorted(key for key in keys if getattr(self, key) != fields[key].get_default(
            call_default_factory=True))

    def _check_ocr(self) -> None:
        wrong = self._not_default({"labels", "input", "output", "top_k", "detect",
                                   "precision", "compile", "runtime"})
        if wrong:
            raise ValueError(f"name: ocr brings its own networks, input and output (text lines "
                             f"in ONNX Runtime, fp32): remove {', '.join(wrong)}")

    @property
    def kind(self) -> ModelKind:
        if self.name == "ocr":
            return "ocr"
        if self.torchvision is not None:
            return "torchvision"
        if self.export is not None:
            return "export"
        if self.onnx is not None:
            return "onnx"
        return "builtin"


def _absolute(path: Path | None) -> Path | None:
    """Model files resolve against the working directory, like every other path here."""
    return None if path is None else resolve_path(path, Path.cwd())


def resolve_path(path: Path, base: Path) -> Path:
    """Every path of the config, made absolute: ``~`` expanded, relative to ``base`` (the
    working directory at load), normalised without touching the disk (links stay links)."""
    return Path(os.path.normpath(base / path.expanduser()))


def split_host_port(text: str) -> tuple[str, int] | None:
    """``HOST:PORT`` (``[::1]:9464`` for IPv6) as (host without brackets, port); None unless
    both parts are there and the port is 0-65535 (0: any free port, which tests ask for)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        return None
    return host.strip("[]"), int(port)


class RetryPolicyConfig(Section):
    """`retry:`: how often and how far apart a transient failure is tried again (the retry list
    holds the files meanwhile; `inboxd retry` is something else: failed files back by hand)."""

    max_attempts: Positive = 5
    backoff_initial_ms: Annotated[float, Field(gt=0)] = 500
    backoff_max_ms: Annotated[float, Field(gt=0)] = 60_000
    # A full or read-only output is probed from backoff_initial_ms on, doubling up to this:
    # a probe is one small write, and the wait it ends holds back every photo, not one.
    output_probe_max_ms: Annotated[float, Field(gt=0)] = 5_000

    @model_validator(mode="after")
    def _ordered(self) -> RetryPolicyConfig:
        if self.backoff_max_ms < self.backoff_initial_ms:
            raise ValueError("backoff_max_ms must be >= backoff_initial_ms")
        return self


class StatsConfig(Section):
    interval_s: Annotated[float, Field(gt=0)] = 10
    # While idle (nothing counted, every layer empty) a record only this often: one comes
    # when work starts, each interval while it goes on, and one when it stops.
    heartbeat_s: Annotated[float, Field(gt=0)] = 300


class MetricsConfig(Section):
    """Prometheus metrics, both off by default. ``textfile`` is written atomically every
    ``stats.interval_s`` for node_exporter's textfile collector (no network needed: works with
    the shipped unit); ``listen`` serves HTTP on HOST:PORT (the unit then needs the README's
    drop-in, since it has no network)."""

    textfile: Path | None = None  # e.g. /var/lib/inboxd/metrics/inboxd.prom
    listen: str | None = None  # e.g. 127.0.0.1:9464, or unix:/var/lib/inboxd/metrics.sock

    @field_validator("textfile")
    @classmethod
    def _prom_suffix(cls, path: Path | None) -> Path | None:
        # node_exporter reads only *.prom files: any other name would be silently unread.
        if path is not None and path.suffix != ".prom":
            raise ValueError("node_exporter's textfile collector only reads *.prom files: "
                             f"name it {path.with_suffix('.prom').name}")
        return path

    @field_validator("listen")
    @classmethod
    def _host_port(cls, listen: str | None) -> str | None:
        if listen is None or listen.startswith("unix:/"):
            return listen
        if listen.startswith("unix:"):
            raise ValueError("give an absolute socket path: unix:/var/lib/inboxd/metrics.sock")
        if split_host_port(listen) is None:
            raise ValueError("give HOST:PORT, e.g. 127.0.0.1:9464 (or [::1]:9464), or "
                             "unix:/PATH")
        return listen


class XmpConfig(Section):
    # A label is a keyword (dc:subject) from this score up; detections become regions from it.
    min_score: Annotated[float, Field(ge=0.0, le=1.0)] = 0.2


class ShutdownConfig(Section):
    # How long SIGTERM waits for in-flight work; the unit's TimeoutStopSec must be longer.
    grace_s: NonNegative = 30


class Config(Section):
    inbox: InboxConfig = InboxConfig()
    results_dir: Path = Path("var/results")
    done_dir: Path = Path("var/done")
    failed_dir: Path = Path("var/failed")
    instance: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.@-]+$", max_length=64)] = "default"
    capacity: CapacityConfig = CapacityConfig()
    batch: BatchConfig = BatchConfig()
    preprocess: PreprocessConfig = PreprocessConfig()
    model: ModelConfig = ModelConfig()
    # Several tasks per photo: task name → model block (in place of model:). Each photo is
    # decoded once and its result has one section per task, under the task's name.
    models: dict[str, ModelConfig] | None = None
    retry: RetryPolicyConfig = RetryPolicyConfig()
    stats: StatsConfig = StatsConfig()
    shutdown: ShutdownConfig = ShutdownConfig()
    metrics: MetricsConfig = MetricsConfig()
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # The search index (SQLite): its file, by default inside results_dir; null: none.
    index: Path | None = None
    # XMP sidecars beside each photo where it ends: true, or {min_score: …}; false: none.
    xmp: XmpConfig | None = None

    @field_validator("xmp", mode="before")
    @classmethod
    def _xmp_switch(cls, value: Any) -> Any:
        if value is True:
            return {}
        return None if value is False else value

    @field_validator("instance")
    @classmethod
    def _plain_name(cls, instance: str) -> str:
        # The name becomes a folder (.processing/<instance>, .tmp/<instance>) that start-up
        # empties: "." or ".." would empty the results and failed folders themselves.
        if instance.startswith("."):
            raise ValueError("an instance name is a plain folder name: letters, digits, "
                             "_ . @ - and not starting with a dot (e.g. gpu0)")
        return instance

    @field_validator("models")
    @classmethod
    def _tasks(cls, models: dict[str, ModelConfig] | None) -> dict[str, ModelConfig] | None:
        if models is None:
            return None
        if not 1 <= len(models) <= MAX_TASKS:
            raise ValueError(f"models: name 1 to {MAX_TASKS} tasks (task name: model block)")
        for task in models:
            if not re.fullmatch(TASK_NAME, task) or task in RESULT_FIELDS:
                raise ValueError(f"models: task name {task!r}: lower-case letters, digits and _ "
                                 f"(starting with a letter), none of the result's own fields "
                                 f"({', '.join(sorted(RESULT_FIELDS))})")
        on_ray: dict[str, str] = {}
        for task, block in models.items():
            if block.engine != "ray":
                continue
            # Two tasks deployed under one name would be one application: the second task
            # would find the first's running and send its photos to the first's model.
            app = f"{block.ray.address} {block.ray.app_name}"
            if app in on_ray:
                raise ValueError(f"models.{task} and models.{on_ray[app]} both run on the Ray "
                                 f"cluster at {block.ray.address} as application "
                                 f"{block.ray.app_name}: give each task its own ray.app_name "
                                 f"(e.g. app_name: inboxd_{task})")
            on_ray[app] = task
        if sum(block.output == "embed" for block in models.values()) > 1:
            raise ValueError("models: at most one task may have output: embed (its vector is "
                             "the one .npy file beside the result)")
        return models

    @field_validator("model")
    @classmethod
    def _task_keys_in_tasks(cls, model: ModelConfig) -> ModelConfig:
        for key in ("batch", "in_flight_batches"):
            if getattr(model, key) is not None:
                where = "batch:" if key == "batch" else "capacity.in_flight_batches"
                raise ValueError(f"{key} is a models: task's own key; with one model: block "
                                 f"set the top-level {where}")
        return model

    @model_validator(mode="after")
    def _join_holds_a_batch(self) -> Config:
        join = self.capacity.task_join
        if join is None or self.models is None:
            return self
        for task in self.models:
            size = self.task_batch(task).max_size
            if join < size:
                raise ValueError(
                    f"capacity.task_join ({join}) is smaller than task {task}'s batch.max_size "
                    f"({size}): its batches could never fill; raise capacity.task_join to at "
                    f"least {size} or lower the batch size")
        return self

    @property
    def tasks(self) -> dict[str, ModelConfig]:
        """Every task's model block: ``models:``, or ``model:`` alone under its own name."""
        return self.models if self.models is not None else {"model": self.model}

    def task_batch(self, task: str) -> BatchConfig:
        """A task's batches: its own ``batch:``, else the top-level one."""
        return self.tasks[task].batch or self.batch

    def task_in_flight(self, task: str) -> int:
        """A task's bound on batches sent and unanswered: its own, else the top-level one."""
        return self.tasks[task].in_flight_batches or self.capacity.in_flight_batches

    def task_join(self, calls_out: dict[str, int] | None = None) -> int:
        """``capacity.task_join``, or its default: the photos one model: config holds at most
        past the cache (its batches out and the one forming), for the task with the most.
        ``calls_out``: each task's bound on batches out where its engine takes one call at a
        time (1); else its ``in_flight_batches``."""
        if self.capacity.task_join is not None:
            return self.capacity.task_join
        calls_out = calls_out or {}
        return max((calls_out.get(task, self.task_in_flight(task)) + 1)
                   * self.task_batch(task).max_size for task in self.tasks)

    def resolved(self, base: Path) -> Config:
        """Relative paths resolve against ``base`` (the working directory), once, at load."""

        def absolute(path: Path) -> Path:
            return resolve_path(path, base)

        inbox = self.inbox.model_copy(update={"paths": [absolute(p) for p in self.inbox.paths]})
        textfile = self.metrics.textfile
        metrics = self.metrics.model_copy(
            update={"textfile": absolute(textfile) if textfile is not None else None})
        results_dir = absolute(self.results_dir)
        # Unset: inside results_dir. ``index: null`` sets it to None on purpose.
        index = (absolute(self.index) if self.index is not None else None) if (
            "index" in self.model_fields_set) else results_dir / INDEX_FILENAME
        from_systemd = os.environ.get(CACHE_DIRECTORY_ENV, "").split(":")[0]
        cache_dir = absolute(Path(from_systemd)) if from_systemd else (
            results_dir.parent / "cache")

        def cached(model: ModelConfig) -> ModelConfig:
            if model.cache_dir is not None:
                return model
            return model.model_copy(update={"cache_dir": cache_dir})

        models = (None if self.models is None
                  else {task: cached(block) for task, block in self.models.items()})
        return self.model_copy(
            update={
                "inbox": inbox,
                "metrics": metrics,
                "model": cached(self.model),
                "models": models,
                "results_dir": results_dir,
                "index": index,
                "done_dir": absolute(self.done_dir),
                "failed_dir": absolute(self.failed_dir),
            }
        )

    def key_for(self, inbox: Path, rel: str) -> str:
        """The name a file's outcome is filed under: its path in the inbox, prefixed with the
        inbox's folder name when there are several inboxes."""
        return f"{inbox.name}/{rel}" if len(self.inbox.paths) > 1 else rel


MAX_TASKS = 8
TASK_NAME = r"[a-z][a-z0-9_]{0,31}"
# The result's own top-level fields: a task's section cannot take one of their names.
RESULT_FIELDS = frozenset({
    "source", "sha256", "size_bytes", "source_identity", "model", "device", "runtime",
    "precision", "top_k", "embedding", "detections", "image", "timings_ms", "attempts",
    "instance", "completed_at", "inboxd_version", "error",
})


class ConfigError(Exception):
    """A configuration that cannot be used; ``str()`` lists every problem, one per line, each
    printable (a path or value with a newline or ESC in it is shown escaped)."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        super().__init__("\n".join(shown(f"{source}: {p}") for p in problems))


def load_config(path: Path | None, overrides: dict[str, Any] | None = None) -> Config:
    """Read, validate and resolve a config file (``None``: the embedded default)."""
    path = path or DEFAULT_CONFIG_PATH
    source = str(path)
    data = _config_bytes(path, source)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise ConfigError(source, [
            f"line {line}: the file is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
            f"{exc.start}); save it as UTF-8"]) from exc
    return parse_config(text, source, overrides)


def _config_bytes(path: Path, source: str) -> bytes:
    """The file's bytes. Opened without blocking and refused unless a regular file: a read of
    a FIFO nobody writes to never returns (SIGHUP would hang the daemon), one of /dev/zero
    never ends."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError(source, ["the config file is not a regular file (a folder, a "
                                           "FIFO or a device); give -c the path of a YAML file"])
            chunks, size = [], 0
            while chunk := os.read(fd, 1 << 16):
                chunks.append(chunk)
                size += len(chunk)
                if size > MAX_CONFIG_BYTES:
                    raise ConfigError(source, [
                        f"the config file is larger than {MAX_CONFIG_BYTES >> 20} MiB, which no "
                        "configuration is; give -c the path of the YAML file"])
            return b"".join(chunks)
        finally:
            os.close(fd)
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        strerror = exc.strerror if isinstance(exc, OSError) else None
        raise ConfigError(source, [f"cannot read the config file: {strerror or exc}; "
                                   "give -c the path of a readable YAML file"]) from exc


def parse_config(text: str, source: str, overrides: dict[str, Any] | None = None) -> Config:
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(source, [yaml_problem(exc)]) from exc
    except RecursionError as exc:  # the parser recurses once per level: "[[[[…" ends it
        raise ConfigError(source, ["invalid YAML: nested deeper than the parser can follow, "
                                   "which no configuration is"]) from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(source, ["line 1: the top level must be a mapping of keys"])
    if data.get("models") is not None and "model" in data:
        # Asked of the file, not of the Config (whose dump, handed to a child, has both).
        raise ConfigError(source, ["give model: (one task) or models: (several), not both"])
    if (nul_at := _nul_in(data, ())) is not None:
        # A YAML escape ("\0") puts a NUL where no path or name can hold one: every later
        # os call would raise ValueError, not a problem the user can read.
        line = _yaml_line(node, nul_at)
        where = f"line {line}: " if line else ""
        raise ConfigError(source, [f"{where}{'.'.join(map(str, nul_at)) or '(top level)'}: "
                                   "a NUL character (\\0) is in the value; remove it"])
    data.update(overrides or {})
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        found = []
        for error in exc.errors():
            loc = tuple(error["loc"])
            key_path = ".".join(str(part) for part in loc) or "(top level)"
            line = _yaml_line(node, loc)
            where = f"line {line}: " if line else ""
            hint = did_you_mean(loc) if error["type"] == "extra_forbidden" else ""
            found.append((line or 0, f"{where}{key_path}: {error['msg']}{hint}"))
        # In the file's order, as an editor shows it (pydantic's is the fields' order).
        raise ConfigError(source, [problem for _, problem in
                                   sorted(found, key=lambda pair: pair[0])]) from exc
    return config.resolved(Path.cwd())


def yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML syntax error on one line: where, what, and what it was in (PyYAML's own text
    spans several lines, with the source quoted)."""
    mark = getattr(exc, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context = getattr(exc, "context", None)
    within = f" ({context})" if context else ""
    return (f"{where}invalid YAML: {problem}{within}; check the indentation and the quoting "
            "there")


def did_you_mean(loc: tuple[str | int, ...]) -> str:
    """For an unknown key: the known keys of its section that it is close to."""
    section: Any = Config
    for part in loc[:-1]:
        field = getattr(section, "model_fields", {}).get(part)
        annotation = getattr(field, "annotation", None)
        candidates = [annotation, *getattr(annotation, "__args__", ())]
        section = next((c for c in candidates if isinstance(c, type)
                        and issubclass(c, BaseModel)), None)
        if section is None:
            return ""
    known = list(getattr(section, "model_fields", {}))
    close = difflib.get_close_matches(str(loc[-1]), known, n=2, cutoff=0.6)
    return f"; did you mean {' or '.join(close)}?" if close else ""


def _nul_in(value: Any, loc: tuple[str | int, ...],
            seen: set[int] | None = None) -> tuple[str | int, ...] | None:
    """Where in the parsed YAML a string (key or value) holds a NUL character, if anywhere.
    Each list or mapping is looked at once: YAML aliases share them, and following every
    alias of a "billion laughs" file would take for ever."""
    if isinstance(value, str):
        return loc if "\0" in value else None
    seen = set() if seen is None else seen
    if not isinstance(value, dict | list) or id(value) in seen:
        return None
    seen.add(id(value))
    items: list[tuple[Any, Any]] = (list(value.items()) if isinstance(value, dict)
                                    else list(enumerate(value)))
    for key, item in items:
        if isinstance(key, str) and "\0" in key:
            return (*loc, key)
        if (found := _nul_in(item, (*loc, key), seen)) is not None:
            return found
    return None


def _yaml_line(node: yaml.Node | None, loc: tuple[str | int, ...]) -> int | None:
    """The 1-based line of the deepest YAML node that ``loc`` reaches."""
    line = node.start_mark.line + 1 if node is not None else None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if key.value == part:
                    # Point at the key for an unknown key, at the value otherwise.
                    line = key.start_mark.line + 1
                    node = value
                    break
            else:
                return line
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
            if part >= len(node.value):
                return line
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return line
