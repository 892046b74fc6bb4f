"""A grid cut off on a lent GPU machine, brought back in parts and sent again to go on where it stopped.

A call brings back at most 8 files of 16 MiB from the device tool's $OUT, 64 MiB together, and each
lease is 15 minutes. A cell of FedRCL's or FedSA's headline tables (a ResNet-18, 1,000 rounds) does not
finish in one call, and its checkpoint alone is 45 MB: the single archive `scripts/gpu-tables` brought
back was dropped above 15 MB, so such a cell started again from round 0 in every session.

`pack` (there, after a grid) archives the grid's run directory as `fedmq simulate --resume` needs it
(every cell's records, the checkpoints of the cells not finished; a finished cell's checkpoint is left
out: it is never read again; a grid with no unfinished checkpoint has nothing to resume and is not
packed), cuts the archive into parts of at most 15 MiB named
``NAME.resume.SHA256.IofN`` (letters, digits and dots, as the tool brings back), and writes them only
when they fit the files and bytes the call may still bring back; otherwise it writes nothing and says
why. `unpack` (there, in a later call or session, the parts carried in ``.gpu/resume/``) joins each
complete set, checks the archive's sha256, and extracts it under ``runs/`` unless the machine already
holds that grid (a warm machine's own copy is newer); `scripts/gpu-tables` then runs the grid with
``--resume``. docs/gpu.md says how to carry the parts.

Standard library only, like `gpu_bundle`: it runs before or without fedmq's wheels.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import re
import sys
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

MIB = 1 << 20
PART_BYTES = 15 * MIB
"""Under the 16 MiB a file the tool brings back."""
CHECKPOINT = "checkpoint.safetensors"
FINISHED = "summary.json"
PART_NAME = re.compile(r"(?P<name>[A-Za-z0-9_-]+)\.resume\.(?P<sha>[0-9a-f]{64})\.(?P<index>\d+)of(?P<count>\d+)")


class ResumeError(ValueError):
    """Parts that cannot be packed or unpacked; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class Packed:
    parts: list[Path]
    """The parts written (empty when they did not fit)."""
    archive_bytes: int
    reason: str = ""
    """Why nothing was written, when nothing was."""


def _members(run: Path) -> list[Path]:
    """The files a resumed grid needs, relative to run's parent: all but finished cells' checkpoints and
    the temporary files of a write the budget's SIGINT cut short (``.NAME.XXXX.tmp``, a checkpoint's 45 MB)."""
    files = []
    for path in sorted(p for p in run.rglob("*") if p.is_file() and not p.is_symlink()):
        if path.name == CHECKPOINT and (path.parent / FINISHED).is_file():
            continue
        if path.name.startswith(".") and path.name.endswith(".tmp"):
            continue
        files.append(path.relative_to(run.parent))
    return files


def archive(run: Path, members: Sequence[Path] | None = None) -> bytes:
    """`run` (runs/NAME) as a gzipped tar of its resumable files (`members`, when already listed), named
    NAME/..., reproducible: sorted, with no owners or times, so that the same directory gives the same bytes."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=6) as tar:
        for member in _members(run) if members is None else members:
            info = tar.gettarinfo(str(run.parent / member), arcname=member.as_posix())
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0
            with (run.parent / member).open("rb") as f:
                tar.addfile(info, f)
    return buffer.getvalue()


def pack(run: Path, out: Path, *, files_left: int, bytes_left: int, part_bytes: int = PART_BYTES) -> Packed:
    """Write `run`'s resume archive into `out` as parts, if they fit `files_left` files and `bytes_left`
    bytes; else nothing, with the reason."""
    if not run.is_dir():
        raise ResumeError(f"{run} is not a run directory")
    if not re.fullmatch(r"[A-Za-z0-9_-]+", run.name):
        raise ResumeError(f"{run.name!r}: a grid's name must be letters, digits, '_' and '-' to travel back")
    members = _members(run)
    if not any(member.name == CHECKPOINT for member in members):
        return Packed([], 0, f"{run.name}: no checkpoint of a cell left unfinished, nothing to resume: not written")
    data = archive(run, members)
    count = max(1, -(-len(data) // part_bytes))
    if count > files_left or len(data) > bytes_left:
        return Packed(
            [], len(data),
            f"{run.name}'s resume archive is {len(data) / MIB:.1f} MiB in {count} part(s); the call may bring back"
            f" {max(files_left, 0)} more file(s) and {max(bytes_left, 0) / MIB:.1f} MiB: not written",
        )  # fmt: skip
    sha = hashlib.sha256(data).hexdigest()
    out.mkdir(parents=True, exist_ok=True)
    parts = []
    for i in range(count):
        path = out / f"{run.name}.resume.{sha}.{i + 1}of{count}"
        path.write_bytes(data[i * part_bytes : (i + 1) * part_bytes])
        parts.append(path)
    return Packed(parts, len(data))


def unpack(carried: Path, into: Path) -> list[str]:
    """Join each complete set of parts under `carried`, check it, extract it under `into`; returns what
    became of each set. A set with parts missing or a wrong sha256 is an error: nothing of it is extracted."""
    sets: dict[tuple[str, str, int], dict[int, Path]] = {}
    for path in sorted(carried.iterdir()):
        match = PART_NAME.fullmatch(path.name)
        if match is None:
            raise ResumeError(f"{path}: not a resume part (NAME.resume.SHA256.IofN); carry only what pack wrote")
        key = (match["name"], match["sha"], int(match["count"]))
        sets.setdefault(key, {})[int(match["index"])] = path
    said = []
    for (name, sha, count), parts in sorted(sets.items()):
        missing = sorted(set(range(1, count + 1)) - set(parts))
        if missing:
            raise ResumeError(f"{name}: part(s) {missing} of {count} were not carried; carry every part of the set")
        if (into / name).exists():
            said.append(f"{name}: kept the machine's own runs/{name} (newer than the carried parts)")
            continue
        data = b"".join(parts[i].read_bytes() for i in range(1, count + 1))
        got = hashlib.sha256(data).hexdigest()
        if got != sha:
            raise ResumeError(f"{name}: the joined parts hash to {got}, not {sha}: bring the parts back again")
        _extract(data, name, into)
        said.append(f"{name}: {count} part(s) joined, sha256 checked, extracted to {into / name}")
    return said


def _extract(data: bytes, name: str, into: Path) -> None:
    """Extract the archive's members, every one a plain file or folder under NAME/ (never a link, an
    absolute path or a way out of `into`)."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        members = tar.getmembers()
        for member in members:
            parts = Path(member.name).parts
            if not (member.isfile() or member.isdir()) or not parts or parts[0] != name or ".." in parts:
                raise ResumeError(f"{name}: the archive holds {member.name!r}, which is not a file of the grid")
        into.mkdir(parents=True, exist_ok=True)
        # and tarfile's own check for extraction where it has one (3.11.4 and later)
        checked = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(into, members=members, **checked)  # type: ignore[arg-type]


def _out_room(out: Path, files: int, total: int, reserve_files: int, reserve_bytes: int) -> tuple[int, int]:
    """The files and bytes still free under `out` (what the call brings back), less a reserve."""
    present = [p for p in out.rglob("*") if p.is_file()] if out.is_dir() else []
    used = sum(p.stat().st_size for p in present)
    return files - len(present) - reserve_files, total - used - reserve_bytes


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m fedmq.experiments.gpu_resume pack|unpack ...`; exit 0, 1 on an error."""
    parser = argparse.ArgumentParser(
        prog="python -m fedmq.experiments.gpu_resume",
        description="Bring a cut-off grid back from a GPU machine in parts, and unpack them there again to resume"
        " it (docs/gpu.md).",
    )
    sub = parser.add_subparsers(dest="verb", required=True)
    pk = sub.add_parser("pack", help="(there) write runs/NAME's resume archive into OUT as parts, if they fit")
    pk.add_argument("run", type=Path, help="the grid's run directory, e.g. runs/fedsa")
    pk.add_argument("out", type=Path, help="the folder the call brings back ($OUT)")
    pk.add_argument("--max-files", type=int, default=8, help="files the call brings back in all (8)")
    pk.add_argument("--max-mib", type=float, default=64, help="MiB the call brings back in all (64)")
    pk.add_argument("--reserve-files", type=int, default=2, help="files left for the steps after this one (2)")
    pk.add_argument("--reserve-mib", type=float, default=2, help="MiB left for the steps after this one (2)")
    un = sub.add_parser("unpack", help="(there) join carried parts, check them, extract under INTO")
    un.add_argument("carried", type=Path, help="the folder of carried parts, e.g. .gpu/resume")
    un.add_argument("--into", type=Path, default=Path("runs"), help="where the grids go (runs)")
    args = parser.parse_args(argv)
    try:
        if args.verb == "pack":
            files, room = _out_room(
                args.out, args.max_files, int(args.max_mib * MIB), args.reserve_files, int(args.reserve_mib * MIB)
            )
            packed = pack(args.run, args.out, files_left=files, bytes_left=room)
            if not packed.parts:
                print(f"gpu_resume: {packed.reason}")
            for part in packed.parts:
                print(f"gpu_resume: wrote {part} ({part.stat().st_size / MIB:.1f} MiB)")
            return 0
        for line in unpack(args.carried, args.into):
            print(f"gpu_resume: {line}")
        return 0
    except ResumeError as exc:
        print(f"gpu_resume: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
