"""Pack the device calls' carry (vLLM's two archives, the wheels, the bench files) into stage folders that each fit
one call beside the working tree.

A call carries the tree (every tracked file: ~30 MiB on 2026-12-06, most of it docs/bench, and it grows with each
lease) and its `carry` paths, 64 MiB in all. Whole folders no longer fit (siteA 26 MiB, av's wheel 34 MiB), so
each file is cut into parts of at most `--part-mib` and the parts are dealt to folders `.devcarry/stage/NN/<group>/`
of at most what a call has left. On the device, `tools/device/stage.sh` (one call per folder, carrying it) merges
the folders under /tmp/stage and joins each file's parts once the last one is in; the call scripts then read
/tmp/stage/<group> where the .devcarry folder is not carried.

`python3 tools/device/pack.py [.devcarry]` (rebuilds .devcarry/stage; prints the calls);
`python3 tools/device/pack.py --join /tmp/stage` (on the device: joins what is complete, checks it once all is in).
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

MIB = 1 << 20
CALL_LIMIT_MIB = 64  # the device tool's limit on a call's tree plus carry
SLACK_MIB = 3  # for the snapshot (.devcarry/snap, ~1 MiB) and the tree growing before the lease
GROUPS = ("cur1", "cur2", "gw1", "gw2", "pool", "bench")  # .devcarry folders the calls read
PART_SUFFIX = ".part."
PART_NAME = re.compile(r"^(?P<base>.+)\.part\.(?P<index>\d{3})of(?P<count>\d{3})$")
SUMS = "SHA256SUMS"  # in the last stage folder: every file's digest, checked once all are joined


def tree_bytes(repo: Path) -> int:
    """What a call copies besides its carry: tracked files and untracked ones git does not ignore."""
    listed = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            check=True, capture_output=True).stdout.split(b"\0")
    return sum((repo / name.decode()).stat().st_size for name in listed if name and (repo / name.decode()).is_file())


def pieces(source: Path, part_bytes: int) -> list[tuple[str, int, int]]:
    """(name in the stage, offset, length) of a file: whole, or its parts `<name>.part.NNN` in order."""
    size = source.stat().st_size
    if size <= part_bytes:
        return [(source.name, 0, size)]
    count = -(-size // part_bytes)
    return [(f"{source.name}{PART_SUFFIX}{index:03d}of{count:03d}", index * part_bytes,
             min(part_bytes, size - index * part_bytes)) for index in range(count)]


def pack(devcarry: Path, out: Path, call_bytes: int, part_bytes: int) -> list[list[tuple[str, str, int]]]:
    """Deal every file of GROUPS to stage folders of at most `call_bytes` (the last one also gets SUMS); returns each
    folder's (group, name, bytes)."""
    if part_bytes > call_bytes:
        raise SystemExit(f"a part ({part_bytes // MIB} MiB) must fit a call ({call_bytes // MIB} MiB)")
    calls: list[list[tuple[str, str, int]]] = [[]]
    used = [0]
    for group in GROUPS:
        folder = devcarry / group
        if not folder.is_dir():
            raise SystemExit(f"{folder} is missing: build it first (tools/device/README.md)")
        for source in sorted(p for p in folder.iterdir() if p.is_file()):
            for name, offset, length in pieces(source, part_bytes):
                if used[-1] + length > call_bytes:
                    calls.append([])
                    used.append(0)
                target = out / f"{len(calls):02d}" / group / name
                target.parent.mkdir(parents=True, exist_ok=True)
                with source.open("rb") as src, target.open("wb") as dst:
                    src.seek(offset)
                    dst.write(src.read(length))
                calls[-1].append((group, name, length))
                used[-1] += length
    (out / f"{len(calls):02d}" / SUMS).write_text("".join(  # travels with the last folder
        f"{digest(source)}  {group}/{source.name}\n" for group in GROUPS
        for source in sorted(p for p in (devcarry / group).iterdir() if p.is_file())))
    return calls


def join(stage: Path) -> tuple[list[Path], list[str]]:
    """Join every file whose parts are all in `stage` (then drop the parts); returns the files joined and the
    files still missing (listed in SUMS once the last folder is in: [] when everything is there)."""
    joined = []
    groups: dict[Path, list[tuple[int, int, Path]]] = {}
    for part in stage.rglob("*"):
        if (match := PART_NAME.match(part.name)) is not None:
            groups.setdefault(part.with_name(match["base"]), []).append(
                (int(match["index"]), int(match["count"]), part))
    for base, parts in groups.items():
        parts.sort()
        if len(parts) != parts[0][1]:
            continue  # a later call brings the rest
        with base.open("wb") as out:
            for _, _, part in parts:
                out.write(part.read_bytes())
        for _, _, part in parts:
            part.unlink()
        joined.append(base)
    sums = stage / SUMS
    if not sums.exists():
        return joined, ["(the last stage folder)"]
    missing, bad = [], []
    for line in sums.read_text().splitlines():
        expected, name = line.split(maxsplit=1)
        path = stage / name
        if not path.exists():
            missing.append(name)
        elif digest(path) != expected:
            bad.append(name)
    if bad:
        raise SystemExit(f"staged files differ from their digests: {', '.join(bad)}")
    return joined, missing


def digest(path: Path) -> str:
    sha = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            sha.update(block)
    return sha.hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("devcarry", nargs="?", default=".devcarry", type=Path)
    parser.add_argument("--join", type=Path, metavar="STAGE", help="on the device: join the parts in STAGE")
    parser.add_argument("--part-mib", type=int, default=12, help="largest part of a cut file")
    parser.add_argument("--call-mib", type=int, default=0,
                        help="carry per call (0: 64 MiB less the tree and a slack)")
    args = parser.parse_args(argv)
    if args.join is not None:
        joined, missing = join(args.join)
        print(f"joined {len(joined)} files; " + (f"still missing: {', '.join(missing)}" if missing
                                                   else "stage complete, digests checked"))
        return 0
    repo = Path(__file__).resolve().parents[2]
    tree = tree_bytes(repo)
    call_bytes = args.call_mib * MIB or (CALL_LIMIT_MIB - SLACK_MIB) * MIB - tree
    if call_bytes < args.part_mib * MIB:
        print(f"the tree is {tree / MIB:.1f} MiB: {call_bytes / MIB:.1f} MiB left per call, less than a part",
              file=sys.stderr)
        return 1
    out = args.devcarry / "stage"
    shutil.rmtree(out, ignore_errors=True)
    calls = pack(args.devcarry, out, call_bytes, args.part_mib * MIB)
    print(f"tree {tree / MIB:.1f} MiB, {call_bytes / MIB:.1f} MiB per call: {len(calls)} stage calls")
    for index, files in enumerate(calls, 1):
        print(f"  {index:02d}: {sum(n for *_, n in files) / MIB:5.1f} MiB, {len(files)} files "
              f"(carry .devcarry/stage/{index:02d})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
