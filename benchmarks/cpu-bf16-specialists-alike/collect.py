"""The forks' records and held-out accuracy:   python collect.py RUNS
Copies each finished run's training_record.json and train_log.jsonl (gzipped) into records/ and prints the table of
held-out top-1 / top-10 accuracy by draft position (the runs' last validation on feat-val), with the weights' size."""
import gzip
import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNS = Path(sys.argv[1])
records = HERE / "records"
records.mkdir(exist_ok=True)
print("| fork | steps | top-1, positions 1..6 | top-10, positions 1..6 | weights (MB) |")
print("|---|---|---|---|---|")
for name in ("single", "poss2", "groups134", "lora134"):
    record_path = RUNS / name / "training_record.json"
    if not record_path.is_file():
        print(f"| {name} | not finished | | | |")
        continue
    record = json.loads(record_path.read_text())
    shutil.copy(record_path, records / f"training_record-{name}.json")
    with open(RUNS / name / "train_log.jsonl", "rb") as source, gzip.open(records / f"train_log-{name}.jsonl.gz", "wb") as out:
        shutil.copyfileobj(source, out)
    validation = record["validation"]
    top1 = " ".join(f"{a:.3f}" for a in validation["position_accuracy"])
    top10 = " ".join(f"{a:.3f}" for a in validation["position_top_k_accuracy"])
    size = (RUNS / name / "model.safetensors").stat().st_size / 1e6
    print(f"| {name} | {record['steps']} | {top1} | {top10} | {size:.1f} |")
