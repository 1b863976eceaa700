"""Write the drafter folders the vLLM tests serve (run with the main environment's python, not vLLM's).

    python tests_vllm/make_exports.py --target T --output DIR

DIR/poss2: the shipped PosS-2 (`poss export --format vllm --target T`); DIR/spec0: the same drafter's specialist 0
alone (`--first-specialist`), run by vLLM at every position; DIR/other_target: a PosS drafter for another (tiny,
random) Llama target that names T as its verifier. DIR/eagle3: a random EAGLE-3-style PosS drafter (2 specialists, 2 positions each, draft vocabulary
of 8192) for T. DIR/facts.json says how far apart the PosS-2 specialists are.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from transformers_poss import PosSDrafter, cli
    from transformers_poss.assets import default_drafter_path

    out = Path(args.output)
    shipped = str(default_drafter_path("poss2"))
    for name, extra in (("poss2", []), ("spec0", ["--first-specialist"])):
        code = cli.main(["export", "--format", "vllm", shipped, str(out / name), "--target", args.target,
                         "--overwrite", *extra])
        if code:
            raise SystemExit(f"poss export failed for {name}")
    drafter = PosSDrafter.from_pretrained(shipped)
    layers = drafter.specialists
    differences = {f"0-{i}": max((a - b).abs().max().item() for a, b in zip(layers[0].parameters(),
                                                                            layers[i].parameters()))
                   for i in range(1, len(layers))}
    torch.manual_seed(0)
    tiny = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                        num_key_value_heads=2, num_hidden_layers=2, vocab_size=96))
    other = PosSDrafter.from_target(tiny, num_specialists=2, positions_per_specialist=2)
    other.config.target_name_or_path = "tiny-random-llama"
    other.save_pretrained(out / "other_target_native")
    code = cli.main(["export", "--format", "vllm", str(out / "other_target_native"), str(out / "other_target"),
                     "--verifier", args.target, "--overwrite"])
    if code:
        raise SystemExit("poss export failed for other_target")
    target = LlamaForCausalLM.from_pretrained(args.target, dtype=torch.float32)
    torch.manual_seed(0)
    eagle3 = PosSDrafter.from_target(target, num_specialists=2, positions_per_specialist=2, drafter_type="eagle3",
                                     draft_vocab_size=8192)
    eagle3.config.target_name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    eagle3.save_pretrained(out / "eagle3_native")
    if cli.main(["export", "--format", "vllm", str(out / "eagle3_native"), str(out / "eagle3"), "--target",
                 args.target, "--overwrite"]):
        raise SystemExit("poss export failed for eagle3")
    facts = {"specialist_max_abs_difference": differences, "num_specialists": len(layers),
             "positions_per_specialist": drafter.config.positions_per_specialist}
    (out / "facts.json").write_text(json.dumps(facts, indent=1), encoding="utf-8")
    print(json.dumps(facts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
