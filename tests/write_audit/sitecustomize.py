"""Records which process writes what under a folder (tests/test_multiprocess_training.py puts this folder first on
PYTHONPATH). Every Python process started with WRITE_AUDIT_ROOT and WRITE_AUDIT_LOG set records each file it opens for
writing, renames or deletes under WRITE_AUDIT_ROOT (Python's audit events, and the writers that bypass them:
safetensors' and `torch.save`'s) and, at exit, writes them with its launcher RANK to WRITE_AUDIT_LOG/<pid>.json."""

import atexit
import json
import os
import sys

ROOT = os.environ.get("WRITE_AUDIT_ROOT")
LOG = os.environ.get("WRITE_AUDIT_LOG")
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
EVENTS = {"os.rename": "rename", "os.remove": "remove", "shutil.rmtree": "rmtree", "os.rmdir": "rmdir"}


def _install() -> None:
    writes = []

    def record(kind: str, path) -> None:
        if isinstance(path, (str, bytes, os.PathLike)):
            path = os.path.abspath(os.fsdecode(path))
            if path == ROOT or path.startswith(ROOT + os.sep):
                writes.append([kind, os.path.relpath(path, ROOT)])

    def hook(event: str, args: tuple) -> None:
        if event == "open" and args[2] is not None and args[2] & WRITE_FLAGS:
            record("open", args[0])
        elif event in EVENTS:
            record(EVENTS[event], args[0])

    def dump() -> None:
        with open(os.path.join(LOG, f"{os.getpid()}.json"), "w") as handle:
            json.dump({"rank": os.environ.get("RANK"), "writes": writes}, handle)

    import safetensors.torch
    import torch

    def audited(write, kind: str, path_name: str):
        """`write` recording its path argument, the second one (or `path_name=`)."""
        def wrapper(*args, **kwargs):
            record(kind, args[1] if len(args) > 1 else kwargs.get(path_name))
            return write(*args, **kwargs)
        return wrapper

    # Writers that bypass Python's open: safetensors (Rust) and torch.save to a path (C++).
    safetensors.torch.serialize_file = audited(safetensors.torch.serialize_file, "safetensors", "filename")
    torch.save = torch.serialization.save = audited(torch.save, "torch.save", "f")
    sys.addaudithook(hook)
    atexit.register(dump)


if ROOT and LOG:
    ROOT = os.path.abspath(ROOT)
    _install()
