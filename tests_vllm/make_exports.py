"""Write the drafter folders the vLLM tests serve (run with the main environment's python, not vLLM's).

    python tests_vllm/make_exports.py --target T --output DIR

DIR/poss2: the shipped PosS-2 (`poss export --format vllm --target T`); DIR/spec0: the same drafter's specialist 0
alone (`--first-specialist`), run by vLLM at every position; DIR/other_target: a PosS drafter for another (tiny,
random) Llama target that names T as its verifier. DIR/eagle3: a random EAGLE-3-style PosS drafter (2 specialists, 2 positions each, draft vocabulary
of 8192) for T. DIR/poss_e3_src: a random PosS-on-EAGLE-3 checkpoint for T in the PosS authors' SpecForge layout
(`write_poss_e3`: 3 layers, draft vocabulary of 8192, bf16), read by the library as it is; DIR/poss_e3: its export
(`poss export --format vllm DIR/poss_e3_src DIR/poss_e3 --target T`). DIR/facts.json says how far apart the PosS-2
specialists are.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def write_poss_e3(folder: Path, target: str, num_layers: int = 3, draft_vocab_size: int = 8192) -> None:
    """A PosS-on-EAGLE-3 checkpoint for `target` as the authors' training saves one (`transformers_poss.checkpoints.
    eagle3`): config.json with `architectures: [LlamaForCausalLMPosSEagle3]` and the draft Llama layer's settings (the
    target's widths), model.safetensors with `layers.{i}.*` (q/k/v reading 2H), `fc [H, 3H]`, `norm`, `lm_head
    [Vd, H]`, `d2t`, `t2d`, random bf16 weights."""
    import torch
    from safetensors.torch import save_file

    t = json.loads((Path(target) / "config.json").read_text(encoding="utf-8"))
    hidden, heads, kv_heads = t["hidden_size"], t["num_attention_heads"], t["num_key_value_heads"]
    head_dim, width, vocab = t.get("head_dim") or hidden // heads, t["intermediate_size"], t["vocab_size"]
    shapes = {"self_attn.q_proj.weight": (heads * head_dim, 2 * hidden),
              "self_attn.k_proj.weight": (kv_heads * head_dim, 2 * hidden),
              "self_attn.v_proj.weight": (kv_heads * head_dim, 2 * hidden),
              "self_attn.o_proj.weight": (hidden, heads * head_dim), "mlp.gate_proj.weight": (width, hidden),
              "mlp.up_proj.weight": (width, hidden), "mlp.down_proj.weight": (hidden, width),
              "input_layernorm.weight": (hidden,), "hidden_norm.weight": (hidden,),
              "post_attention_layernorm.weight": (hidden,)}
    generator = torch.Generator().manual_seed(0)

    def weight(shape, norm=False):
        if norm:
            return 0.5 + torch.rand(shape, generator=generator)
        return torch.randn(shape, generator=generator) * 0.02

    tensors = {f"layers.{i}.{name}": weight(shape, name.endswith("norm.weight"))
               for i in range(num_layers) for name, shape in shapes.items()}
    tensors.update({"fc.weight": weight((hidden, 3 * hidden)), "norm.weight": weight((hidden,), True),
                    "lm_head.weight": weight((draft_vocab_size, hidden))})
    tensors = {k: v.to(torch.bfloat16) for k, v in tensors.items()}
    used = torch.randperm(vocab, generator=generator)[:draft_vocab_size].sort().values
    tensors["d2t"] = used - torch.arange(draft_vocab_size)
    tensors["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill(0, used, True)
    config = {
        "architectures": ["LlamaForCausalLMPosSEagle3"], "model_type": "llama", "hidden_size": hidden,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "intermediate_size": width, "hidden_act": "silu", "rms_norm_eps": t.get("rms_norm_eps", 1e-5),
        "rope_theta": t.get("rope_theta") or (t.get("rope_parameters") or {}).get("rope_theta", 10000.0),
        "rope_scaling": None,
        "max_position_embeddings": t.get("max_position_embeddings", 2048), "num_hidden_layers": 1,
        "vocab_size": vocab, "draft_vocab_size": draft_vocab_size, "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1, "torch_dtype": "bfloat16",
    }
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")


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
    write_poss_e3(out / "poss_e3_src", args.target)
    if cli.main(["export", "--format", "vllm", str(out / "poss_e3_src"), str(out / "poss_e3"), "--target",
                 args.target, "--overwrite"]):
        raise SystemExit("poss export failed for poss_e3")
    facts = {"specialist_max_abs_difference": differences, "num_specialists": len(layers),
             "positions_per_specialist": drafter.config.positions_per_specialist}
    (out / "facts.json").write_text(json.dumps(facts, indent=1), encoding="utf-8")
    print(json.dumps(facts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
