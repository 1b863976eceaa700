"""Teacher-forced first-position diagnostic: how often the target's next-next greedy token is outside a drafter's
draft vocabulary, and how often it is among the drafter's top-k (k = 1, 3, 5, 10) at draft position 1.

    python first_position_topk.py PROMPTS.jsonl DRAFTER [DRAFTER ...]

The target (the default SmolLM2-135M-Instruct, fp32) answers the first turn of every question greedily
(128 new tokens); each drafter then reads the target's features of that text, as drafting does at depth 1.
"""
import json
import sys

import torch

from transformers_poss import PosSDrafter
from transformers_poss.assets import load_default_target


def main(prompts: str, drafters: list[str], max_new_tokens: int = 128) -> None:
    target, tokenizer = load_default_target(dtype=torch.float32)
    answers = []  # (prompt length, prompt + answer ids [L])
    with torch.no_grad():
        for line in open(prompts):
            question = json.loads(line)["turns"][0]
            inputs = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                                   return_tensors="pt", return_dict=True)
            output = target.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
            answers.append((inputs["input_ids"].shape[1], output[0]))
    for path in drafters:
        drafter = PosSDrafter.from_pretrained(path).bind_target(target).eval()
        inside = torch.zeros(target.config.vocab_size, dtype=torch.bool)
        inside[drafter.draft_to_target] = True
        hits, outside, tokens = {k: 0 for k in (1, 3, 5, 10)}, 0, 0
        with torch.no_grad():
            for prompt_length, ids in answers:
                features = target(ids[None], output_hidden_states=True).hidden_states[-1]
                predicted = drafter(ids[None, 1:], features[:, :-1]).features[0]  # [L - 1, H]: predicts ids[2:]
                truth = ids[prompt_length:]  # answer tokens, predicted from position prompt_length - 2 on
                logits = drafter.logits(predicted[prompt_length - 2: len(ids) - 2])
                top = drafter.to_target_ids(logits.topk(10).indices)
                for k in hits:
                    hits[k] += int((top[:, :k] == truth[:, None]).any(-1).sum())
                outside += int((~inside[truth]).sum())
                tokens += truth.numel()
        print(f"{path}: {tokens} answer tokens, outside the draft vocabulary {outside / tokens:.3f}, "
              + ", ".join(f"top-{k} {v / tokens:.3f}" for k, v in hits.items()))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
