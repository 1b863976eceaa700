"""Self-distillation throughput: `poss distill` with transformers' batched `generate` against a vLLM server.

    python benchmarks/distill-server/measure.py --target $(poss fetch-target) \
        --prompts ../shared/data/specbench/mt_bench.jsonl --limit 64 --max-new-tokens 256 \
        --batch-sizes 16 32 --concurrency 8 32 --output-dir benchmarks/distill-server/run

Run with the main environment's python (transformers_poss installed). It starts `vllm serve TARGET` (fp32, eager,
on the loopback) with `--vllm` (default: .venv-vllm/bin/vllm, which `bash scripts/vllm_env.sh` builds) unless
`--server URL` names a server that already serves the target, and stops it at the end.

Every configuration answers the same prompts (the first turns of `--limit` questions, one answer each, greedy, fp32)
into a file of its own, with the library's own functions: `self_distill` (batches of `--batch-sizes`) and
`server_distill` (`--concurrency` requests in flight). Timed is the distillation alone (wall clock of that call: not
the target load, not the server start); each path first answers 2 prompts untimed (warm-up). tokens/s counts the
answer tokens (`generated_tokens`, the end-of-turn token excluded). "identical" counts the answers equal, text for
text (decoded from token ids by the same tokenizer), to the first configuration's; "h per 100k" is 100,000 answers of
this mean length at this rate. Writes `results.json` and `table.md` into `--output-dir` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository


def load_prompts(path: str, limit: int) -> list[dict]:
    """Records of one user turn each: the first turn of each Spec-Bench style question (`{"turns": [...]}`)."""
    records = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                question = json.loads(line)
                records.append({"id": str(question.get("question_id", len(records))),
                                "conversations": [{"from": "human", "value": question["turns"][0]}]})
    if len(records) < limit:
        raise SystemExit(f"{path} has {len(records)} questions, fewer than --limit {limit}")
    return records[:limit]


def answers(path: Path) -> dict[str, str]:
    with open(path, encoding="utf-8") as handle:
        return {r["id"]: r["conversations"][-1]["value"] for r in map(json.loads, handle)}


def start_vllm(vllm: str, target: str, log_path: Path, wait: float) -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")}
    command = [vllm, "serve", target, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
               "--enforce-eager", "--max-model-len", "4096"]
    log = open(log_path, "w")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + wait
    while True:
        if server.poll() is not None:
            raise SystemExit(f"vllm serve exited {server.returncode}; its log: {log_path}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return server, f"http://127.0.0.1:{port}/v1"
        except OSError:
            if time.monotonic() > deadline:
                stop(server)
                raise SystemExit(f"vllm serve did not come up in {wait:g} s; its log: {log_path}")
            time.sleep(2)


def stop(server: subprocess.Popen) -> None:
    try:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(server.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        server.wait(timeout=30)


def timed(label: str, setting: str, run, output: Path) -> dict:
    """Run `run(output)` (a distillation into the fresh file `output`) and time it."""
    output.unlink(missing_ok=True)
    print(f"[measure] {label} {setting} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    stats = run(str(output))
    seconds = time.perf_counter() - start
    if stats.get("failed") or stats.get("not_attempted"):
        raise SystemExit(f"{label} {setting}: {stats['failed']} requests failed, {stats['not_attempted']} not sent")
    return {"engine": label, "setting": setting, "answers": stats["answers"], "tokens": stats["generated_tokens"],
            "seconds": round(seconds, 2), "tokens_per_second": round(stats["generated_tokens"] / seconds, 2),
            "output": str(output)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--target", required=True, help="the target's folder (`poss fetch-target` prints it)")
    parser.add_argument("--prompts", default=str(ROOT.parent / "shared/data/specbench/mt_bench.jsonl"))
    parser.add_argument("--limit", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--server", default=None, help="a running server of the target (default: start vllm serve)")
    parser.add_argument("--vllm", default=str(ROOT / ".venv-vllm/bin/vllm"), help="the vllm command")
    parser.add_argument("--threads", type=int, default=None, help="torch threads of the local generate")
    parser.add_argument("--output-dir", default=None, help="default: a temporary folder")
    args = parser.parse_args(argv)

    import torch

    from transformers_poss.assets import load_target
    from transformers_poss.training import self_distill
    from transformers_poss.training.distill_server import server_distill

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.output_dir or tempfile.mkdtemp(prefix="distill_server_"))
    out.mkdir(parents=True, exist_ok=True)
    records = load_prompts(args.prompts, args.limit)
    common = {"max_new_tokens": args.max_new_tokens, "max_turns": 1, "progress": False}
    rows = []

    target, tokenizer = load_target(args.target, torch.float32)
    self_distill(target, tokenizer, records[:2], str(out / "warmup_local.jsonl"), batch_size=2, max_new_tokens=8,
                 progress=False)
    for size in args.batch_sizes:
        rows.append(timed("transformers generate", f"batch {size}",
                          lambda path: self_distill(target, tokenizer, records, path, batch_size=size, **common),
                          out / f"local_b{size}.jsonl"))
    del target

    server = None
    url = args.server
    if url is None:
        server, url = start_vllm(args.vllm, args.target, out / "vllm_serve.log", wait=600)
    try:
        server_distill(tokenizer, records[:2], str(out / "warmup_server.jsonl"), url, max_new_tokens=8,
                       progress=False)
        for concurrency in args.concurrency:
            rows.append(timed("vLLM server", f"concurrency {concurrency}",
                              lambda path: server_distill(tokenizer, records, path, url, concurrency=concurrency,
                                                          **common),
                              out / f"vllm_c{concurrency}.jsonl"))
    finally:
        if server is not None:
            stop(server)
    for path in out.glob("warmup_*.jsonl"):
        path.unlink()

    reference = answers(Path(rows[0]["output"]))
    for row in rows:
        mine = answers(Path(row["output"]))
        row["identical_to_first"] = sum(mine.get(rid) == text for rid, text in reference.items())
    lines = [f"{args.limit} prompts (first turns of {Path(args.prompts).name}) x up to {args.max_new_tokens} new "
             f"tokens, greedy, fp32, target {Path(args.target).name}", "",
             f"| engine | setting | answer tokens | seconds | tokens/s | identical to {rows[0]['engine']} "
             f"{rows[0]['setting']} | h per 100k answers |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        hours = 100_000 * row["tokens"] / row["answers"] / row["tokens_per_second"] / 3600
        lines.append(f"| {row['engine']} | {row['setting']} | {row['tokens']} | {row['seconds']:.1f} | "
                     f"{row['tokens_per_second']:.1f} | {row['identical_to_first']}/{len(reference)} | {hours:.0f} |")
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    (out / "table.md").write_text(text, encoding="utf-8")
    (out / "results.json").write_text(json.dumps({"command": sys.argv, "rows": rows}, indent=1) + "\n",
                                      encoding="utf-8")
    print(f"answers and results: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
