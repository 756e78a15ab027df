"""Nothing let in: outcome paths never escape their folders, names never reach a shell, and
created files are not writable by others."""

from __future__ import annotations

import ast
import asyncio
import stat
from pathlib import Path

import pytest
from inboxd.config import load_config
from inboxd.files.names import (
    NAME_MAX_BYTES,
    NameFilter,
    output_path,
    output_str,
    relative_inside,
)
from inboxd.pipeline.wiring import Pipeline

from tests.conftest import make_image, write_config
from tests.fakes import FakeModel

PACKAGE = Path(__file__).resolve().parents[2] / "daemon" / "inboxd"


@pytest.mark.parametrize("key", ["../x.jpg", "a/../../x.jpg", "/etc/passwd", "a//b.jpg", ".", "..",
                                 "a/./b.jpg", ""])
def test_an_output_key_that_could_escape_is_refused(tmp_path: Path, key: str) -> None:
    with pytest.raises(ValueError):
        output_path(tmp_path, key, ".json")
    with pytest.raises(ValueError):
        output_str(str(tmp_path), key, ".json")


def test_over_long_names_are_shortened_distinctly_within_name_max(tmp_path: Path) -> None:
    a = output_path(tmp_path, "sub/" + "a" * 250 + "1.png", ".error.json")
    b = output_path(tmp_path, "sub/" + "a" * 250 + "2.png", ".error.json")
    assert a != b
    assert len(a.name.encode()) <= NAME_MAX_BYTES and a.name.endswith(".error.json")
    assert a.parent == tmp_path / "sub"
    assert output_str(str(tmp_path), "sub/" + "a" * 250 + "1.png", ".error.json") == str(a)


def test_only_paths_inside_the_inbox_have_a_relative_name(tmp_path: Path) -> None:
    assert relative_inside(tmp_path / "a" / "b.jpg", tmp_path) == "a/b.jpg"
    assert relative_inside(tmp_path.parent / "b.jpg", tmp_path) is None
    assert relative_inside(tmp_path, tmp_path) is None
    # As strs, the way the watcher and the walk give them: the same answers, no ``..`` out.
    root = str(tmp_path)
    assert relative_inside(f"{root}/a//./b.jpg", root) == "a/b.jpg"
    assert relative_inside(f"{root}/a/../../b.jpg", root) is None
    assert relative_inside(f"{root}/../b.jpg", root) is None
    assert relative_inside(f"{root}x/b.jpg", root) is None  # a sibling sharing the prefix
    assert relative_inside(f"{root}/", root) is None


@pytest.mark.parametrize(("name", "wanted"), [
    ("a.jpg", True), ("A.JPG", True), ("a.png", True), (".hidden.jpg", False),
    ("a.jpg.tmp", False), ("a.jpg.part", False), ("a.jpg.crdownload", False), ("a.jpg~", False),
    ("a.txt", False), ("a.jpg.exe", False),
])
def test_name_filter(name: str, wanted: bool) -> None:
    assert NameFilter(["*.jpg", "*.jpeg", "*.png", "*.webp"]).wanted(name) is wanted


FORBIDDEN_CALLS = {"os.system", "os.popen", "os.execv", "os.execvp", "os.spawnv", "eval",
                   "exec", "pickle.load", "pickle.loads", "subprocess.run", "subprocess.Popen",
                   "subprocess.call", "subprocess.check_output", "subprocess.check_call"}


def _called_name(call: ast.Call) -> str:
    func = call.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return f"{func.value.id}.{func.attr}"
    return func.id if isinstance(func, ast.Name) else ""


# The subprocesses the daemon starts, each by a fixed command line (its start, as written in the
# source). File names reach them only as data over a pipe, never as arguments, never through a
# shell: the decode workers, the commit process (files/commit_process.py: a batch's results and
# paths, as JSON), and with `model.engine: ray` the Ray bridge (models/engines/ray_bridge.py), whose
# replies are unpickled by multiprocessing's Connection: it is our own child, and Ray itself
# unpickles whatever the cluster sends, so trusting the cluster is the premise of that engine
# (README, "Running on a Ray cluster"). Each is a ``HelperProcess`` (children.py, the one module
# that calls Popen: ``python`` and the command, nothing else).
FIXED_COMMANDS = {Path("decode/worker_process.py"): ["'-m'", "'inboxd.decode.worker_child'"],
                  Path("files/commit_process.py"): ["'-m'", "'inboxd.files.commit_child'"],
                  Path("models/engines/ray_bridge.py"): ["*BRIDGE_COMMAND"],
                  Path("models/onnx_export.py"): ["'-m'", "'inboxd.models.onnx_export'"],
                  Path("models/onnx_probe.py"): ["'-m'", "'inboxd.models.onnx_probe'"]}
SPAWNER = Path("children.py")


def _is_the_spawners_popen(call: ast.Call, where: Path) -> bool:
    if where != SPAWNER or _called_name(call) != "subprocess.Popen" or not call.args:
        return False
    argv = call.args[0]
    fixed = isinstance(argv, ast.List) and [ast.unparse(e) for e in argv.elts] == [
        "sys.executable", "*command"]
    return fixed and not any(k.arg in ("shell", "executable") for k in call.keywords)


def _is_fixed_helper(call: ast.Call, where: Path) -> bool:
    start = FIXED_COMMANDS.get(where)
    if start is None or not call.args:
        return False
    command = call.args[0]
    return isinstance(command, ast.Tuple | ast.List) and [
        ast.unparse(e) for e in command.elts[:len(start)]] == start


def test_no_shell_or_unpickling_anywhere_in_the_daemon() -> None:
    """File names are attacker-controlled: the daemon never runs a shell or a subprocess (but
    its own decode workers, commit process, Ray bridge and ONNX exporter, by fixed command lines),
    and weights are loaded with ``torch.load(weights_only=True)`` only, never unpickled."""
    offenders = []
    sources = sorted(PACKAGE.rglob("*.py"))
    assert len(sources) > 30, f"the scan must see the whole package, found {len(sources)} modules"
    for path in sources:
        where = path.relative_to(PACKAGE)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                if "pickle" in names or ("subprocess" in names and where != SPAWNER):
                    offenders.append(f"{where}:{node.lineno} imports {names}")
            if not isinstance(node, ast.Call):
                continue
            name = _called_name(node)
            if name in FORBIDDEN_CALLS and not _is_the_spawners_popen(node, where):
                offenders.append(f"{where}:{node.lineno} calls {name}")
            if name == "HelperProcess" and not _is_fixed_helper(node, where):
                offenders.append(f"{where}:{node.lineno} starts a helper by another command")
            if name == "torch.load" and not any(
                k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value
                is True for k in node.keywords
            ):
                offenders.append(f"{where}:{node.lineno} torch.load without weights_only=True")
    assert offenders == []


def test_created_files_are_not_writable_by_others(tmp_path: Path) -> None:
    pipeline = Pipeline(load_config(write_config(tmp_path, inbox={"settle_ms": 0})),
                        FakeModel())  # type: ignore[arg-type]
    make_image(tmp_path / "inbox" / "deep" / "a.png", size=(8, 8))
    (tmp_path / "inbox" / "bad.png").write_bytes(b"nope")
    asyncio.run(pipeline.process_backlog())
    created = [p for folder in ("results", "done", "failed")
               for p in (tmp_path / folder).rglob("*")]
    assert created
    for path in created:
        assert not path.stat().st_mode & stat.S_IWOTH, path
