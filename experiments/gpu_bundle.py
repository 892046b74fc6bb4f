"""Getting a dataset and fedmq's missing wheels to a lent GPU machine, 64 MiB per call.

The tool that runs a command on a GPU machine sends the repository's working tree plus at most 8
carried (git-ignored) paths, 64 MiB in all per call, and keeps what a command wrote under ignored
paths of the repository there while the machine stays warm (about 30 s after each call). A CIFAR
pack is 101 MiB, so it cannot travel in one call. `prepare` (run here) cuts a dataset folder's
files into parts, groups them into as few calls as the limit allows (each call's tree, parts,
manifest and, on the first call, wheels measured), downloads the wheels the GPU machine lacks, and
prints each call's carry list and command. The first call installs the wheels where the machine
keeps them while warm, so it can already run what needs no dataset (the GPU tests, a benchmark on
synthetic data: `--first`), and the last call, once the dataset is whole, runs `--run`. `join`
(run there, standard library only, so it works before any wheel is installed) checks each carried
part's sha256, keeps it in a store that outlives the call, and once every part is there writes the
dataset's files under a data root, each checked against its sha256.

This module imports nothing outside the standard library on purpose: the GPU machine runs
``python3 -m fedmq.experiments.gpu_bundle join ...`` with none of fedmq's dependencies installed.
docs/gpu.md says how to use it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

MIB = 1 << 20
CALL_LIMIT_MIB = 64  # the device tool's limit on what one call carries (tree + carried paths)
COMMAND_LIMIT = 2000  # the device tool's limit on one command's length, in characters
MANIFEST = "manifest.json"
MANIFEST_ROOM = 64 * 1024  # bytes kept in each call for its manifest.json (checked once written)
OUT_DIR = ".gpu"  # git-ignored (.gitignore): nothing under it travels unless a call carries it
WHEELS_DIR = f"{OUT_DIR}/wheels"
STORE_DIR = f"{OUT_DIR}/store"  # on the GPU machine: parts kept between calls
DATA_DIR = f"{OUT_DIR}/data"  # on the GPU machine: the joined datasets, FEDMQ_DATA_ROOT
CACHE_DIR = f"{OUT_DIR}/cache"  # on the GPU machine: FEDMQ_CACHE_DIR, decoded arrays kept between runs
SITE_DIR = f"{OUT_DIR}/site"  # on the GPU machine: the carried wheels, installed; ignored, so kept while warm
RESUME_DIR = f"{OUT_DIR}/resume"  # grids cut off in an earlier session, as parts (`gpu_resume`), carried back
RUN_PLACEHOLDER = "YOUR_COMMAND"
HERE = Path(__file__).resolve().parent  # experiments/ of the checkout a GPU call would send

Manifest = dict[str, Any]  # the JSON written beside every call's parts

# What `import fedmq.<anything>` needs that the GPU machine's image lacks, or may hold too old
# (/work/.library/device/KINDS.md lists its packages): the MQTT clients and the embedded broker with
# their own needs (amqtt: dacite, transitions, websockets, pwdlib[argon2]), `fedmq provision`'s
# cryptography and argon2 (both need cffi's compiled backend), secure aggregation's pycryptodome,
# pydantic, typing-extensions (pydantic needs >= 4.16) and msgpack (fedmq's floor 1.2.1). Versions
# are those of the Python that runs `prepare`, so the GPU machine runs what the tests here ran. torch
# is never carried: the machine has its own CUDA build.
GPU_WHEELS = (
    "aiomqtt",
    "paho-mqtt",
    "amqtt",
    "dacite",
    "transitions",
    "websockets",
    "pwdlib",
    "argon2-cffi",
    "argon2-cffi-bindings",
    "cffi",
    "pycparser",
    "cryptography",
    "pycryptodome",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "typing-extensions",
    "msgpack",
)
# Packages fedmq's dependencies need that the GPU image holds (KINDS.md), so they are not carried.
GPU_PRESENT = (
    "torch",
    "numpy",
    "xxhash",
    "pyyaml",
    "rich",
    "safetensors",
    "scikit-learn",
    "pillow",
    "matplotlib",
    "uvloop",
    "aiohttp",
    "prometheus-client",
    "psutil",
    "typer",
    "six",
)
# The GPU machine's Python: 3.12 on x86-64 Linux. pip matches manylinux tags exactly and prefers
# them in the order given, so the glibc levels its image certainly has come first (2.28 and below),
# the newer ones only as fallbacks for a package that publishes nothing older.
PIP_PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
    "manylinux_2_31_x86_64",
    "manylinux_2_34_x86_64",
    "manylinux_2_35_x86_64",
)
PIP_PYTHON_VERSION = "3.12"


class BundleError(Exception):
    """A bundle that cannot be made, carried or joined; the message says why and what to do."""


@dataclass(frozen=True)
class Part:
    """One slice of one file: the unit that travels, named so that its file and place are plain."""

    name: str  # the part's file name, e.g. cifar10_webp.npz.part001
    file: str  # the dataset file it is a slice of
    offset: int
    size: int
    call: int  # 1-based: the call that carries it


# --- hashing and sizes -------------------------------------------------------------------------


def sha256_file(path: Path, offset: int = 0, size: int | None = None) -> str:
    """The sha256 of `size` bytes of `path` from `offset` (the rest when None), read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        fh.seek(offset)
        left = size
        while left is None or left > 0:
            block = fh.read(MIB if left is None else min(MIB, left))
            if not block:
                break
            digest.update(block)
            if left is not None:
                left -= len(block)
    if left:
        raise BundleError(f"{path}: {left} bytes short of the {size} expected from offset {offset}")
    return digest.hexdigest()


def path_bytes(path: Path) -> int:
    """Bytes a path adds to a call: a file's size, a folder's files summed; links count as themselves."""
    if path.is_symlink() or not path.is_dir():
        return path.lstat().st_size
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_symlink() or p.is_file())


def repo_root(start: Path) -> Path:
    """The git work tree holding `start`: the folder a GPU call sends and runs in."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--show-toplevel"], cwd=start, check=True, capture_output=True, text=True
        ).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise BundleError(f"{start} is not inside a git checkout: a GPU call sends a repository's tree") from exc
    return Path(out.strip())


def tree_bytes(repo: Path) -> int:
    """What every call sends besides its carried paths: tracked and untracked-not-ignored files, shared/.

    Measured from git rather than assumed, because an untracked file left in the checkout travels too
    and eats the room the parts were planned with.
    """
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=repo,
        check=True,
        capture_output=True,
    ).stdout
    seen: set[Path] = set()
    total = 0
    for raw in out.split(b"\0"):
        if not raw:
            continue
        path = repo / os.fsdecode(raw)
        if path.is_symlink() or path.exists():  # a tracked file deleted in the checkout does not travel
            seen.add(path)
            total += path.lstat().st_size
    shared = repo / "shared"
    if shared.is_dir() and not shared.is_symlink():  # the tool sends shared/ even when git ignores it
        total += sum(p.lstat().st_size for p in shared.rglob("*") if (p.is_file() or p.is_symlink()) and p not in seen)
    return total


def check_ignored(repo: Path, rel: str) -> None:
    """Refuse unless git ignores `rel`: parts under a tracked folder would travel with every call."""
    probe = f"{rel.rstrip('/')}/probe"
    done = subprocess.run(["git", "check-ignore", "-q", probe], cwd=repo, capture_output=True)
    if done.returncode != 0:
        raise BundleError(
            f"{rel}/ is not ignored by git in {repo}: add '{rel.rstrip('/')}/' to .gitignore, or every call "
            "would send the parts and wheels in its tree"
        )


# --- planning and splitting --------------------------------------------------------------------


def plan_parts(
    files: Sequence[tuple[str, int]], room: int, first_extra: int, part_cap: int | None = None
) -> tuple[list[Part], int]:
    """Cut files (name, size), in order, into parts packed into the fewest calls that hold them.

    Each call holds at most `room` bytes of parts, the first one `room - first_extra` (it also carries
    the wheels); a part is at most `part_cap` bytes when given. Fewer calls matter because the parts
    of one bundle must reach one warm machine, which is given back about 30 s after each call.
    Returns the parts and the number of calls.
    """
    if part_cap is not None and part_cap <= 0:
        raise BundleError(f"part size must be positive, not {part_cap} bytes")
    if room - first_extra <= 0:
        raise BundleError(
            f"no room for data: the first call's wheels and the tree leave {room - first_extra} bytes "
            f"of the call limit; carry fewer wheels or shrink the tree"
        )
    total = sum(size for _, size in files)
    calls = max(1, -(-(total + first_extra) // room))
    while calls <= 1000:
        parts = _pack(files, [room - first_extra] + [room] * (calls - 1), part_cap)
        if parts is not None:
            # As many calls as greedy filling needs, but each sending about the same: every call then
            # keeps some headroom under the limit instead of the first ones none.
            even = -(-(total + first_extra) // calls)
            if even - first_extra > 0:
                balanced = _pack(files, [even - first_extra] + [even] * (calls - 1), part_cap)
                if balanced is not None:
                    return balanced, calls
            return parts, calls
        calls += 1
    raise BundleError(f"{total} bytes do not fit in 1000 calls of {room} bytes")


def _pack(files: Sequence[tuple[str, int]], rooms: Sequence[int], part_cap: int | None) -> list[Part] | None:
    """Greedy fill of calls with the given rooms, in order; None when they do not hold everything."""
    parts: list[Part] = []
    call, left = 0, rooms[0]
    for name, size in files:
        offset, index = 0, 1
        while True:
            if left == 0 and offset < size:  # this call is full: the rest goes to the next
                call += 1
                if call == len(rooms):
                    return None
                left = rooms[call]
            take = min(size - offset, left, part_cap if part_cap is not None else size)
            parts.append(Part(f"{name}.part{index:03d}", name, offset, take, call + 1))
            offset += take
            left -= take
            index += 1
            if offset >= size:
                break
    return parts


def split(
    source: Path,
    dest: Path,
    bundle: str,
    room: int,
    first_extra: int,
    part_cap: int | None = None,
) -> Manifest:
    """Write `source`'s files as parts into dest/call-N/ folders, each with the whole manifest.

    Returns the manifest: every file's size and sha256, every part's file, offset, size, sha256 and
    call, in joining order. The same manifest goes into each call's folder so that any call alone can
    tell the GPU machine what it still lacks.
    """
    files = sorted(p for p in source.iterdir() if p.is_file())
    if not files:
        raise BundleError(f"{source} holds no files to bundle")
    parts, calls = plan_parts([(p.name, p.stat().st_size) for p in files], room, first_extra, part_cap)
    if dest.exists():
        shutil.rmtree(dest)  # stale parts of an earlier plan must not travel
    for n in range(1, calls + 1):
        (dest / f"call-{n}").mkdir(parents=True)
    entries = []
    for part in parts:
        out = dest / f"call-{part.call}" / part.name
        digest = hashlib.sha256()
        with (source / part.file).open("rb") as src, out.open("wb") as dst:
            src.seek(part.offset)
            left = part.size
            while left > 0:
                block = src.read(min(MIB, left))
                if not block:
                    raise BundleError(f"{source / part.file} shrank while it was being split")
                digest.update(block)
                dst.write(block)
                left -= len(block)
        entries.append({**part.__dict__, "sha256": digest.hexdigest()})
    manifest: Manifest = {
        "bundle": bundle,
        "files": [{"name": p.name, "size": p.stat().st_size, "sha256": sha256_file(p)} for p in files],
        "parts": entries,
        "calls": calls,
    }
    text = json.dumps(manifest, indent=1) + "\n"
    if len(text.encode()) > MANIFEST_ROOM:
        raise BundleError(f"the manifest is {len(text)} bytes, over the {MANIFEST_ROOM} kept for it: use larger parts")
    for n in range(1, calls + 1):
        (dest / f"call-{n}" / MANIFEST).write_text(text)
    return manifest


# --- joining (on the GPU machine) ---------------------------------------------------------------


def _copy_checked(src: Path, dst: Path, sha256: str, size: int) -> None:
    """Copy src to dst only if its bytes hash to `sha256`: a corrupt part never enters the store."""
    tmp = dst.with_name(dst.name + ".tmp")
    digest = hashlib.sha256()
    with src.open("rb") as fin, tmp.open("wb") as fout:
        while block := fin.read(MIB):
            digest.update(block)
            fout.write(block)
    got = digest.hexdigest()
    if got != sha256 or tmp.stat().st_size != size:
        tmp.unlink()
        raise BundleError(
            f"part {src} is corrupt: {src.stat().st_size} bytes with sha256 {got}, expected {size} bytes "
            f"with sha256 {sha256}; prepare the bundle again and resend its call"
        )
    os.replace(tmp, dst)


def _load_manifest(path: Path) -> Manifest:
    """A manifest read back, with the fields join relies on checked."""
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise BundleError(f"cannot read the manifest {path}: {exc}") from exc
    if not isinstance(manifest, dict) or not {"bundle", "files", "parts"} <= manifest.keys():
        raise BundleError(f"{path} is not a gpu_bundle manifest")
    return manifest


@dataclass
class JoinResult:
    """What join did: parts stored now, parts still missing (with their calls), files written or checked."""

    bundle: str
    stored: list[str]
    missing: list[tuple[str, int]]
    joined: list[str]

    @property
    def complete(self) -> bool:
        """Every file of the bundle is in place and checked."""
        return not self.missing


def join(carried: Sequence[Path], store: Path, into: Path, bundle: str | None = None) -> JoinResult:
    """Keep the carried parts in `store`; once all are there, write the files to into/BUNDLE/.

    `carried` are call folders (or single part files beside their manifest) that arrived with this
    call, in any order and any number, none at all to only check. Every part is checked against the
    manifest's sha256 before it is stored, every joined file before it replaces anything, and a file
    already in place with the right sha256 is left alone, so the step can run again on every call.
    """
    manifest: Manifest | None = None
    sources: list[Path] = []
    for path in carried:
        folder = path if path.is_dir() else path.parent
        if not (folder / MANIFEST).is_file():
            raise BundleError(f"{path}: no {MANIFEST} beside it; carry the whole call folder")
        found = _load_manifest(folder / MANIFEST)
        if manifest is not None and found != manifest:
            raise BundleError(f"{path} belongs to another bundle than the other carried paths")
        manifest = found
        sources.extend(sorted(folder.iterdir()) if path.is_dir() else [path])
    if manifest is None:
        if bundle is None:
            raise BundleError("nothing carried: name a call folder, or --bundle to check a stored bundle")
        kept = store / bundle / MANIFEST
        if not kept.is_file():
            raise BundleError(
                f"bundle {bundle!r} was never stored on this machine ({kept} is missing): send its calls "
                "first; a machine given back (about 30 s idle) loses them"
            )
        manifest = _load_manifest(kept)
    name = str(manifest["bundle"])
    if bundle is not None and bundle != name:
        raise BundleError(f"the carried manifest is bundle {name!r}, not {bundle!r}")
    if not re.fullmatch(r"[A-Za-z0-9._-]+", name) or name in {".", ".."}:
        raise BundleError(f"bad bundle name {name!r}")
    kept_dir = store / name
    kept_dir.mkdir(parents=True, exist_ok=True)
    old = kept_dir / MANIFEST
    if old.is_file() and _load_manifest(old) != manifest:  # a newer preparation of the same bundle
        shutil.rmtree(kept_dir)
        kept_dir.mkdir(parents=True)
    (kept_dir / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")

    parts = {str(p["name"]): p for p in manifest["parts"]}
    stored = []
    for src in sources:
        if src.name == MANIFEST:
            continue
        entry = parts.get(src.name)
        if entry is None:
            raise BundleError(f"{src} is not a part of bundle {name!r}")
        _copy_checked(src, kept_dir / src.name, str(entry["sha256"]), int(entry["size"]))
        stored.append(src.name)

    missing = [
        (part_name, int(entry["call"]))
        for part_name, entry in parts.items()
        if not (kept_dir / part_name).is_file() or (kept_dir / part_name).stat().st_size != int(entry["size"])
    ]
    joined: list[str] = []
    if not missing:
        target = into / name
        target.mkdir(parents=True, exist_ok=True)
        for spec in manifest["files"]:
            joined.append(_join_file(kept_dir, target, spec, [p for p in parts.values() if p["file"] == spec["name"]]))
    return JoinResult(name, stored, missing, joined)


def _join_file(kept: Path, target: Path, spec: Manifest, parts: list[Manifest]) -> str:
    """Write one file from its stored parts, in offset order, keeping it only if its sha256 matches."""
    out = target / str(spec["name"])
    want = str(spec["sha256"])
    if out.is_file() and out.stat().st_size == int(str(spec["size"])) and sha256_file(out) == want:
        return f"{out} (already in place, sha256 checked)"
    tmp = out.with_name(out.name + ".tmp")
    digest = hashlib.sha256()
    with tmp.open("wb") as fout:
        for part in sorted(parts, key=lambda p: int(str(p["offset"]))):
            with (kept / str(part["name"])).open("rb") as fin:
                while block := fin.read(MIB):
                    digest.update(block)
                    fout.write(block)
    if digest.hexdigest() != want:
        tmp.unlink()
        raise BundleError(f"{out}: the joined parts hash to {digest.hexdigest()}, expected {want}; resend all calls")
    os.replace(tmp, out)
    return f"{out} (joined, sha256 checked)"


# --- wheels -------------------------------------------------------------------------------------


def normalize(name: str) -> str:
    """A distribution name as wheel file names spell it (PEP 427/503): lower case, runs of -_. as _."""
    return re.sub(r"[-_.]+", "_", name).lower()


def requirements(names: Sequence[str] = GPU_WHEELS) -> list[str]:
    """NAME==VERSION for each name, at the version this Python has: what the tests here ran."""
    pins = []
    for name in names:
        try:
            pins.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError as exc:
            raise BundleError(
                f"{name} is not installed in {sys.executable}: run prepare with fedmq's environment"
            ) from exc
    return pins


def pip_download_command(dest: Path, pins: Sequence[str], python: str = sys.executable) -> list[str]:
    """The pip command that fetches binary wheels for the GPU machine's Python, without their needs."""
    cmd = [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version"]
    cmd += [PIP_PYTHON_VERSION, "--implementation", "cp"]
    for platform in PIP_PLATFORMS:
        cmd += ["--platform", platform]
    return [*cmd, "-d", str(dest), *pins]


def _wheel_key(path: Path) -> tuple[str, str]:
    """(normalized name, version) from a wheel's file name."""
    name, version = path.name.split("-")[:2]
    return normalize(name), version


def sync_wheels(dest: Path, pins: Sequence[str]) -> list[Path]:
    """Download the pinned wheels missing from `dest` and drop any other version there.

    Two versions of one package stop the whole install on the GPU machine, so a wheel left from an
    earlier pin goes. Returns the wheels `dest` then holds, one per pin.
    """
    dest.mkdir(parents=True, exist_ok=True)
    wanted = {(normalize(p.split("==")[0]), p.split("==")[1]) for p in pins}
    for whl in dest.glob("*.whl"):
        if _wheel_key(whl) not in wanted:
            whl.unlink()
    have = {_wheel_key(w) for w in dest.glob("*.whl")}
    todo = [p for p in pins if (normalize(p.split("==")[0]), p.split("==")[1]) not in have]
    if todo:
        done = subprocess.run(pip_download_command(dest, todo), capture_output=True, text=True)
        if done.returncode != 0:
            raise BundleError(f"pip download failed for {' '.join(todo)}:\n{done.stderr.strip()[-2000:]}")
    wheels = sorted(dest.glob("*.whl"))
    missing = wanted - {_wheel_key(w) for w in wheels}
    if missing:
        raise BundleError(f"no wheel came for {sorted(missing)}")
    return wheels


# --- the calls ----------------------------------------------------------------------------------


def install_command(wheels_dir: str = WHEELS_DIR) -> str:
    """The shell step that installs the carried wheels on the GPU machine, beside (not over) its torch,
    under the checkout's ignored .gpu/site: kept for the later calls while the machine is warm."""
    return (
        "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "
        f"--target {SITE_DIR} {wheels_dir}/*.whl"
    )


def site_command() -> str:
    """The shell step that puts the installed wheels and the checkout on Python's path, or stops the call
    (exit 3) when they are gone with a machine that was given back."""
    return (
        f"{{ test -d {SITE_DIR} || {{ echo 'gpu_bundle: {SITE_DIR} is gone (the machine was given back): "
        f"start again from call 1' >&2; exit 3; }}; }} && export PYTHONPATH=$PWD/{SITE_DIR}:$PWD"
    )


def join_command(bundle: str, carried: str | None, complete: bool) -> str:
    """The shell step that stores a call's parts and, with `complete`, insists the bundle is whole."""
    cmd = "python3 -m fedmq.experiments.gpu_bundle join"
    cmd += f" {shlex.quote(carried)}" if carried is not None else f" --bundle {shlex.quote(bundle)}"
    return cmd + (" --complete" if complete else "")


def call_command(
    bundle: str,
    carried: str | None,
    *,
    install: bool,
    site: bool,
    complete: bool,
    first: str | None = None,
    run: str | None = None,
) -> str:
    """A call's whole command: store its parts (with `complete`, insist the bundle is whole), install the
    wheels it carries (`install`), put the installed wheels on the path (`site`), with the whole bundle
    export the data root and cache; then `first` (whose failure does not stop `run`) and `run`."""
    steps = [join_command(bundle, carried, complete)]
    if install:
        steps.append(install_command())
    if site:
        steps.append(site_command())
    if complete:
        steps.append(f"export FEDMQ_DATA_ROOT=$PWD/{DATA_DIR} FEDMQ_CACHE_DIR=$PWD/{CACHE_DIR}")
    if first is not None:
        steps.append(f"{{ {first}; true; }}" if run is not None else first)
    if run is not None:
        steps.append(run)
    return " && ".join(steps)


@dataclass
class Call:
    """One call to the GPU machine: what it carries, its command, and the bytes it sends."""

    carry: list[str]
    command: str
    sends: int


def resume_command() -> str:
    """The shell step that puts the carried grids back under runs/ (`gpu_resume`, standard library only)."""
    return f"python3 -m fedmq.experiments.gpu_resume unpack {RESUME_DIR} --into runs"


def plan_calls(
    bundle: str,
    run: str,
    tree: int,
    call_bytes: Sequence[int],
    wheels: int | None,
    first: str | None = None,
    resume: int | None = None,
) -> tuple[list[Call], Call]:
    """The calls that carry a bundle, and a later run's call.

    The first call also carries the wheels (`wheels`: their bytes; None: none carried) and installs
    them, then runs `first` when given (work that needs the wheels but not the dataset); the last runs
    `run` once the bundle is whole (a bundle of one call: `first`, then `run`). `call_bytes` are the
    sizes of the call folders. `resume`: the bytes of the grids' resume parts (`gpu_resume`), carried by
    a call of their own just before the last (the data calls are full) that unpacks them under runs/, so
    that the last call's grids go on from their checkpoints. The later run is for more runs on the same
    warm machine once the bundle is joined: it carries nothing, the wheels and the data being kept there.
    """
    extra = [WHEELS_DIR] if wheels is not None else []
    out = []
    last = len(call_bytes)
    for n, size in enumerate(call_bytes, 1):
        folder = f"{OUT_DIR}/{bundle}/call-{n}"
        command = call_command(
            bundle,
            folder,
            install=n == 1 and wheels is not None,
            site=wheels is not None,
            complete=n == last,
            first=first if n == 1 else None,
            run=run if n == last else None,
        )
        wheel_bytes = wheels if n == 1 and wheels is not None else 0
        if n == last and resume is not None:
            out.append(Call([RESUME_DIR], resume_command(), tree + resume))
        out.append(Call([folder, *(extra if n == 1 else [])], command, tree + size + wheel_bytes))
    again = Call([], call_command(bundle, None, install=False, site=wheels is not None, complete=True, run=run), tree)
    for call in [*out, again]:
        if len(call.command) > COMMAND_LIMIT:
            raise BundleError(f"a call's command is {len(call.command)} characters, over the {COMMAND_LIMIT} allowed")
    return out, again


def prepare(
    source: Path,
    repo: Path,
    bundle: str,
    run: str = RUN_PLACEHOLDER,
    first: str | None = None,
    limit: int = CALL_LIMIT_MIB * MIB,
    margin: int = MIB,
    part_cap: int | None = None,
    pins: Sequence[str] | None = None,
    wheels: bool = True,
    resume: bool = False,
) -> tuple[Manifest, list[Call], Call, list[Path]]:
    """Wheels, parts and the calls that carry them, each call checked against `limit`.

    `first` runs in the first call after the wheels' install, `run` in the last once the dataset is
    whole; `resume`: carry the grids' resume parts in .gpu/resume/ by a call just before the last.
    `margin` is kept free in every call for what the measurement here cannot see (a file written in
    the checkout between now and the call). Raises BundleError when the tree and wheels alone leave
    no room, or any call would exceed the limit.
    """
    if not source.is_dir():
        raise BundleError(f"{source} is not a folder: name the dataset's folder, e.g. /work/shared/data/cifar10")
    check_ignored(repo, OUT_DIR)
    wheels_dir = repo / WHEELS_DIR
    fetched = sync_wheels(wheels_dir, requirements() if pins is None else pins) if wheels else []
    wheel_bytes = path_bytes(wheels_dir) if wheels else 0
    tree = tree_bytes(repo)
    room = limit - tree - margin - MANIFEST_ROOM
    if room <= 0 or room - wheel_bytes <= 0:
        raise BundleError(
            f"impossible: the tree sends {tree / MIB:.1f} MiB and the wheels {wheel_bytes / MIB:.1f} MiB, "
            f"leaving no room for data in a {limit / MIB:.0f} MiB call (margin {margin / MIB:.1f} MiB)"
        )
    manifest = split(source, repo / OUT_DIR / bundle, bundle, room, wheel_bytes, part_cap)
    calls = int(str(manifest["calls"]))
    call_bytes = [path_bytes(repo / OUT_DIR / bundle / f"call-{n}") for n in range(1, calls + 1)]
    parts = None
    if resume:
        folder = repo / RESUME_DIR
        if not folder.is_dir() or not any(folder.iterdir()):
            raise BundleError(
                f"--resume: {folder} holds no resume parts: copy there the NAME.resume.* files a call brought back"
            )
        parts = path_bytes(folder)
    planned, again = plan_calls(bundle, run, tree, call_bytes, wheel_bytes if wheels else None, first, parts)
    for n, call in enumerate(planned, 1):
        if call.sends > limit:
            hint = f": carry the parts of fewer grids in {RESUME_DIR}" if RESUME_DIR in call.carry else ""
            raise BundleError(f"call {n} would send {call.sends} bytes, over the {limit}-byte limit{hint}")
    return manifest, planned, again, fetched


# --- command line -------------------------------------------------------------------------------


def _print_plan(manifest: Manifest, calls: list[Call], again: Call, wheels: list[Path], limit: int) -> None:
    """The calls to make, in order, as the device tool takes them (carry as JSON, command as text)."""
    print(
        f"bundle {manifest['bundle']}: {len(manifest['files'])} files in {len(manifest['parts'])} parts, "
        f"{len(calls)} call(s); wheels: {len(wheels)} ({sum(w.stat().st_size for w in wheels) / MIB:.1f} MiB)"
    )
    for whl in wheels:
        print(f"  wheel {whl.name} ({whl.stat().st_size} bytes)")
    print("Make the calls one right after another: the machine is given back about 30 s after a call, and")
    print("the parts of earlier calls go with it.")
    for n, call in enumerate(calls, 1):
        print(f"\ncall {n} of {len(calls)}: sends {call.sends / MIB:.2f} MiB of {limit / MIB:.0f} MiB")
        print(f"  carry:   {json.dumps(call.carry)}")
        print(f"  command: {call.command}")
    print(
        f"\nmore runs on the same warm machine (the wheels and the data kept there): sends {again.sends / MIB:.2f} MiB"
    )
    print(f"  carry:   {json.dumps(again.carry)}")
    print(f"  command: {again.command}")


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m fedmq.experiments.gpu_bundle prepare|join ...`; exit 0, 1 on a bundle error, 3 incomplete."""
    parser = argparse.ArgumentParser(
        prog="python -m fedmq.experiments.gpu_bundle",
        description=(
            "Carry a dataset and fedmq's missing wheels to a lent GPU machine, 64 MiB per call: `prepare` "
            "here splits the dataset into parts under .gpu/ (git-ignored), downloads the wheels and prints "
            "each call's carry list and command; `join` there keeps each call's parts and writes the "
            "dataset under .gpu/data/ once all arrived, checking every sha256. See docs/gpu.md."
        ),
    )
    sub = parser.add_subparsers(dest="verb", required=True)
    prep = sub.add_parser(
        "prepare",
        help="split a dataset folder, fetch wheels, print the calls",
        description="Split a dataset folder into parts, download the wheels, print each call's carry and command.",
    )
    prep.add_argument("source", type=Path, help="the dataset's folder, e.g. /work/shared/data/cifar10")
    prep.add_argument("--name", help="the bundle's name, the folder under FEDMQ_DATA_ROOT (default: source's name)")
    prep.add_argument(
        "--run",
        default=RUN_PLACEHOLDER,
        help="the command the last call runs there, with the dataset whole, e.g. "
        "'python3 -m fedmq run experiments/papers/kdia-beta01-reduced.yaml'",
    )
    prep.add_argument(
        "--first",
        help="a command the first call runs once the wheels are installed, before the dataset is whole (work"
        ' on no data: the GPU tests, a benchmark on synthetic data), e.g. \'FEDMQ_GPU_STEPS="tests bench"'
        " scripts/gpu-tables'",
    )
    prep.add_argument(
        "--repo", type=Path, default=HERE, help="the checkout the calls send (default: the one holding this module)"
    )
    prep.add_argument("--limit-mib", type=float, default=CALL_LIMIT_MIB, help="bytes one call may send (64 MiB)")
    prep.add_argument("--margin-mib", type=float, default=1.0, help="room kept free in each call (1 MiB)")
    prep.add_argument("--part-mib", type=float, help="largest part (default: as large as a call allows)")
    prep.add_argument("--no-wheels", action="store_true", help="carry no wheels (they are installed there already)")
    prep.add_argument(
        "--resume",
        action="store_true",
        help=f"carry the grids' resume parts in {RESUME_DIR}/ (what an earlier call brought back) by a call just"
        " before the last, which unpacks them under runs/ so that its grids go on from their checkpoints",
    )
    jn = sub.add_parser(
        "join",
        help="(on the GPU machine) keep carried parts; join and check once all are there",
        description=(
            "Keep the parts of the carried call folders in .gpu/store/ and, once every part is there, "
            "write the dataset's files to .gpu/data/BUNDLE/, each checked against the manifest's sha256. "
            "Standard library only: it runs before the wheels are installed."
        ),
    )
    jn.add_argument("carried", nargs="*", type=Path, help="call folders this call carried, e.g. .gpu/cifar10/call-1")
    jn.add_argument("--bundle", help="the bundle to check when nothing is carried")
    jn.add_argument("--store", type=Path, default=Path(STORE_DIR), help=f"where parts wait ({STORE_DIR})")
    jn.add_argument("--into", type=Path, default=Path(DATA_DIR), help=f"the data root written to ({DATA_DIR})")
    jn.add_argument("--complete", action="store_true", help="exit 3 unless the bundle is whole and checked")
    args = parser.parse_args(argv)
    try:
        if args.verb == "prepare":
            repo = repo_root(args.repo)
            limit = int(args.limit_mib * MIB)
            manifest, calls, again, wheels = prepare(
                args.source,
                repo,
                args.name or args.source.resolve().name,
                run=args.run,
                first=args.first,
                limit=limit,
                margin=int(args.margin_mib * MIB),
                part_cap=int(args.part_mib * MIB) if args.part_mib else None,
                wheels=not args.no_wheels,
                resume=args.resume,
            )
            _print_plan(manifest, calls, again, wheels, limit)
            return 0
        result = join(args.carried, args.store, args.into, args.bundle)
    except BundleError as exc:
        print(f"gpu_bundle: error: {exc}", file=sys.stderr)
        return 1
    if result.stored:
        print(f"gpu_bundle: stored {len(result.stored)} part(s) of {result.bundle}: {', '.join(result.stored)}")
    if result.missing:
        lacking = sorted({call for _, call in result.missing})
        names = ", ".join(name for name, _ in result.missing)
        print(
            f"gpu_bundle: {result.bundle} still lacks {len(result.missing)} part(s): {names} (from call(s) {lacking})"
        )
        if args.complete:
            print(
                f"gpu_bundle: send call(s) {lacking} before this one, each right after the last: a machine given "
                "back (about 30 s idle) loses the parts it kept",
                file=sys.stderr,
            )
            return 3
        return 0
    for line in result.joined:
        print(f"gpu_bundle: {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
