"""The GPU check's measurements (issue 50 part 4): plain `generate` vs prompt lookup vs PosS-2, as markdown tables.

With the real default target and the shipped drafter, on one device:
1. fp32 identity: greedy speculative output == plain `generate`'s on a couple of prompts (batch 1 and a left-padded
   batch of them), at the shipped budget and at the paper's (depth 6 / top-k 10 / 60 tokens);
2. speed in the benchmark dtype (bf16 on CUDA): plain vs prompt lookup (`prompt_lookup_num_tokens=10`, batch 1 only:
   transformers refuses it on batches) vs PosS-2 at the shipped and at the paper's budget, at batch sizes 1 / 4 /
   16 / 64 (left-padded chat prompts), with tau, tree sizes and whether each row matched plain's;
3. the round's time split (`speculative_stats.time_split()`: draft / verify / bookkeeping per target forward);
4. a bitsandbytes 4-bit (NF4) target at batch 1 (CUDA with bitsandbytes only): PosS-2's rows against plain's with
   fp32 compute, and tokens/s with fp32 and bf16 compute.

Tables go to stdout and to `OUT/gpu_check.md` (+ `gpu_check.json`); OUT is `--out`, else `$OUT` (set by the device
tool), else `./gpu_check_out`. Only public APIs of the library are used.

    python benchmarks/scripts/gpu_check.py                                  # CUDA if present: the full check
    python benchmarks/scripts/gpu_check.py --device cpu --tiny --batch-sizes 1,2 --num-prompts 2 --max-new-tokens 16   # CI
"""

from __future__ import annotations

import argparse
import json
import copy
import math
import os
import platform
import sys
import tempfile
import time
import warnings
from pathlib import Path

# Idle OpenMP threads sleep instead of spinning (set before torch loads): on a busy CPU spinning threads make the
# small operations of the tiny run many times slower. The GPU run is unaffected.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

PAPER_BUDGET = {"tree_depth": 6, "tree_top_k": 10, "tree_total_tokens": 60}
LOOKUP_TOKENS = 10
KNOWN_SUMMARY = {"draft_mode", "rounds", "new_tokens", "lookup_tokens", "mean_acceptance_length",
                 "position_acceptance", "time_split_s"}
DEFAULT_PROMPTS = Path(__file__).resolve().parents[3] / "shared/data/specbench/mt_bench.jsonl"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="cuda / cpu (default: cuda when present)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="benchmark dtype (auto: bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--prompts", default=os.environ.get("GPU_CHECK_PROMPTS", str(DEFAULT_PROMPTS)),
                   help="Spec-Bench-style .jsonl (first turns are asked; default: ../shared MT-Bench)")
    p.add_argument("--target", default="default", help="'default' (SmolLM2-135M-Instruct) or a model folder")
    p.add_argument("--drafter", default="poss2", help="shipped drafter name (poss2 / single) or a drafter folder")
    p.add_argument("--tiny", action="store_true", help="a tiny random target, tokenizer and drafter (CI smoke run)")
    p.add_argument("--batch-sizes", default="1,4,16,64")
    p.add_argument("--num-prompts", type=int, default=8,
                   help="rows per batch size: ceil(N / b) batches of b prompts (at least one batch)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--methods", default="plain,lookup,poss-shipped,poss-paper")
    p.add_argument("--identity-prompts", type=int, default=2, help="fp32 identity check on this many (0: skip)")
    p.add_argument("--identity-new-tokens", type=int, default=64)
    p.add_argument("--bnb-4bit-prompts", type=int, default=2,
                   help="prompts for the bitsandbytes 4-bit target case (CUDA with bitsandbytes only; 0: skip)")
    p.add_argument("--budget-s", type=float, default=float(os.environ.get("GPU_CHECK_BENCH_BUDGET_S", 300)),
                   help="stop starting new batch sizes after this many seconds (tables keep what ran)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    p.add_argument("--out", default=None, help="output folder (default: $OUT, else ./gpu_check_out)")
    return p.parse_args(argv)


# ---- models ---------------------------------------------------------------------------------------------------------
def tiny_tokenizer():
    """A character-level tokenizer (printable ASCII, newline, ChatML markers) with a ChatML chat template."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(specials + chars)}, merges=[],
                                   unk_token="<unk>"))
    backend.add_special_tokens(specials)
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<|im_end|>",
                                        pad_token="<|im_end|>")
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return tokenizer


def tiny_models(device, dtype, seed: int = 0):
    """(target, tokenizer, drafter): a 2-layer random Llama and a random 3-specialist drafter at the shipped PosS-2's
    budget shape. No end-of-sequence token, so every row runs to `max_new_tokens`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from transformers_poss import PosSDrafter

    tokenizer = tiny_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=2048,
                         bos_token_id=None, eos_token_id=None, pad_token_id=tokenizer.pad_token_id)
    target = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    target.generation_config.eos_token_id = None
    target.generation_config.pad_token_id = tokenizer.pad_token_id
    drafter = PosSDrafter.from_target(target, num_specialists=3, positions_per_specialist=2, tree_depth=2,
                                      tree_top_k=4, tree_total_tokens=4, lookup_num_tokens=LOOKUP_TOKENS).eval()
    return target, tokenizer, drafter


def load_models(args, device, dtype):
    """(target, tokenizer, drafter) in `dtype` on `device`, the drafter bound to the target."""
    if args.tiny:
        return tiny_models(device, dtype)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from transformers_poss import PosSDrafter
    from transformers_poss.assets import load_default_drafter, load_default_target

    if args.target == "default":
        target, tokenizer = load_default_target(dtype=dtype, device=device)
    else:
        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(args.target)
    if Path(args.drafter).is_dir():
        drafter = PosSDrafter.from_pretrained(args.drafter).eval()
        drafter.bind(target)
    else:
        drafter = load_default_drafter(args.drafter, target=target)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if target.generation_config.pad_token_id is None:
        target.generation_config.pad_token_id = tokenizer.pad_token_id
    return target, tokenizer, drafter


# ---- prompts --------------------------------------------------------------------------------------------------------
def load_prompts(path: str, tokenizer, tiny: bool) -> list[str]:
    """First turns of the set, categories interleaved (MT-Bench lists its categories one after another), as chat
    prompts in the tokenizer's chat template."""
    from transformers_poss.evaluation.prompts import load_prompt_file

    if not Path(path).is_file():
        raise SystemExit(f"--prompts {path}: no such file (on the device, the staged copy is .gpu_cache/prompts.jsonl)")
    questions = load_prompt_file(path)
    by_category: dict[str, list] = {}
    for question in questions:
        by_category.setdefault(question.category, []).append(question)
    ordered = []
    for rank in range(max(len(v) for v in by_category.values())):
        ordered += [group[rank] for group in by_category.values() if rank < len(group)]
    texts = []
    for question in ordered:
        content = question.turns[0][:160] if tiny else question.turns[0]  # char-level tiny prompts stay short
        texts.append(tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                   add_generation_prompt=True))
    return texts


def encode(tokenizer, texts: list[str], device):
    tokenizer.padding_side = "left"
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return {k: v.to(device) for k, v in batch.items() if k in ("input_ids", "attention_mask")}


# ---- one call -------------------------------------------------------------------------------------------------------
def sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def eos_ids(target) -> set[int]:
    eos = target.generation_config.eos_token_id
    return set() if eos is None else ({eos} if isinstance(eos, int) else set(eos))


def new_rows(sequences, width: int, eos: set[int]) -> list[list[int]]:
    """Each row's new tokens, cut after its first end-of-sequence token (padding after it dropped)."""
    rows = []
    for row in sequences[:, width:].tolist():
        cut = next((i + 1 for i, token in enumerate(row) if token in eos), len(row))
        rows.append(row[:cut])
    return rows


WARNINGS: dict[str, int] = {}  # what generate warned about (e.g. which budget a drafter used here), with counts


def run_call(target, inputs, kwargs, max_new_tokens, device):
    """One greedy `generate`: (new-token rows, seconds, speculative record or None)."""
    sync(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = time.perf_counter()
        with torch.inference_mode():
            out = target.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                  return_dict_in_generate=True, **kwargs)
        sync(device)
        seconds = time.perf_counter() - start
    for warning in caught:
        text = f"{warning.category.__name__}: {warning.message}"
        WARNINGS[text] = WARNINGS.get(text, 0) + 1
    rows = new_rows(out.sequences, inputs["input_ids"].shape[1], eos_ids(target))
    return rows, seconds, speculative_record(out)


def speculative_record(out) -> dict | None:
    """What `out.speculative_stats` says of one call (public attributes only; absent ones read as None)."""
    stats = getattr(out, "speculative_stats", None)
    if stats is None:
        return None
    record = {"summary": {}}
    try:
        record["summary"] = stats.summary()
    except Exception as error:  # noqa: BLE001 - the stats API is being refactored: report, don't fail
        record["summary"] = {"error": repr(error)}
    record["acceptance_lengths"] = list(getattr(stats, "acceptance_lengths", []) or [])
    record["tree_sizes"] = list(getattr(stats, "tree_sizes", []) or [])
    split = stats.time_split() if hasattr(stats, "time_split") else {}
    record["time_split"] = {k: float(v) for k, v in split.items()}
    record["lookup_tokens"] = getattr(stats, "lookup_tokens", None)
    record["tree_depth"] = getattr(stats, "tree_depth", None)
    row_stats = getattr(out, "row_stats", None)
    # target forwards of the call: a batch's rows share each verification forward
    counts = [len(getattr(r, "acceptance_lengths", []) or []) for r in row_stats] if row_stats else []
    record["forwards"] = max(counts) if counts else len(record["acceptance_lengths"])
    return record


# ---- aggregation ----------------------------------------------------------------------------------------------------
def pool(entries: list[dict]) -> dict:
    """One (batch size, method) cell from its calls."""
    tokens = sum(sum(len(r) for r in e["rows"]) for e in entries)
    seconds = sum(e["seconds"] for e in entries)
    cell = {"calls": len(entries), "rows": sum(len(e["rows"]) for e in entries), "new_tokens": tokens,
            "seconds": seconds, "tokens_per_s": tokens / seconds if seconds else float("nan")}
    records = [e["spec"] for e in entries if e.get("spec")]
    if not records and any("spec" in e for e in entries):
        cell["notes"] = {"speculative_stats": "none on the output"}
    if records:
        accepted = [a for r in records for a in r["acceptance_lengths"]]
        sizes = [s for r in records for s in r["tree_sizes"]]
        cell["rounds"] = len(accepted)
        cell["tau"] = (sum(accepted) / len(accepted) + 1) if accepted else None
        cell["mean_tree_size"] = sum(sizes) / len(sizes) if sizes else None
        cell["max_tree_size"] = max(sizes) if sizes else None
        cell["forwards"] = sum(r["forwards"] for r in records)
        split = {}
        for r in records:
            for k, v in r["time_split"].items():
                split[k] = split.get(k, 0.0) + v
        cell["time_split"] = split
        depth = max((r["tree_depth"] or 0) for r in records)
        cell["position_acceptance"] = position_acceptance(accepted, depth)
        lookups = [r["lookup_tokens"] for r in records if r["lookup_tokens"] is not None]
        cell["lookup_tokens"] = sum(lookups) if lookups else None
        notes = {}
        for r in records:
            for k, v in r["summary"].items():
                if k not in KNOWN_SUMMARY:
                    notes[k] = v
        cell["notes"] = notes
    return cell


def position_acceptance(accepted: list[int], depth: int) -> list[float]:
    """alpha_p = P(position p accepted | positions 1..p-1 accepted)."""
    alphas = []
    for p in range(1, depth + 1):
        reached = sum(1 for a in accepted if a >= p - 1)
        if not reached:
            break
        alphas.append(sum(1 for a in accepted if a >= p) / reached)
    return alphas


# ---- tables ---------------------------------------------------------------------------------------------------------
def fmt(value, digits=2):
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(c) if not isinstance(c, str) else c for c in row) + " |" for row in rows]
    return "\n".join(lines)


def speed_table(cells: dict) -> str:
    rows = []
    for (batch, method), cell in cells.items():
        plain = cells.get((batch, "plain"))
        speedup = cell["tokens_per_s"] / plain["tokens_per_s"] if plain and plain["tokens_per_s"] else None
        rows.append([batch, method, cell["rows"], cell["new_tokens"], cell["seconds"], cell["tokens_per_s"],
                     speedup, cell.get("tau"), cell.get("mean_tree_size"),
                     f"{cell.get('same_as_plain', 0)}/{cell['rows']}" if method != "plain" else "-",
                     "; ".join(f"{k}={v}" for k, v in cell.get("notes", {}).items()) or "-"])
    return table(["batch", "method", "rows", "new tokens", "s", "tokens/s", "speedup", "tau", "mean tree",
                  "rows = plain", "notes"], rows)


def split_table(cells: dict) -> str:
    rows = []
    for (batch, method), cell in cells.items():
        if "time_split" not in cell:
            continue
        split, forwards = cell["time_split"], max(cell["forwards"], 1)
        measured = sum(split.values())
        other = cell["seconds"] - measured
        ms = {k: 1000 * split.get(k, 0.0) / forwards for k in ("draft", "verify", "bookkeeping")}
        share = {k: 100 * split.get(k, 0.0) / cell["seconds"] for k in ("draft", "verify", "bookkeeping")}
        alphas = " ".join(f"{a:.2f}" for a in cell.get("position_acceptance", [])) or "-"
        rows.append([batch, method, cell["forwards"], ms["draft"], ms["verify"], ms["bookkeeping"],
                     1000 * other / forwards, f"{share['draft']:.0f}/{share['verify']:.0f}/{share['bookkeeping']:.0f}",
                     cell.get("mean_tree_size"), cell.get("max_tree_size"), cell.get("tau"), alphas,
                     "; ".join(f"{k}={v}" for k, v in cell.get("notes", {}).items()) or "-"])
    return table(["batch", "method", "target forwards", "draft ms/fwd", "verify ms/fwd", "bookkeeping ms/fwd",
                  "other ms/fwd", "% draft/verify/bookk.", "mean tree", "max tree", "tau", "acceptance by position",
                  "notes"], rows)


# ---- the check ------------------------------------------------------------------------------------------------------
def method_kwargs(drafter, names: list[str], batch: int) -> dict:
    kwargs = {}
    for name in names:
        if name == "plain":
            kwargs[name] = {}
        elif name == "lookup":
            if batch == 1:  # transformers refuses prompt lookup on a batch
                kwargs[name] = {"prompt_lookup_num_tokens": LOOKUP_TOKENS}
        elif name == "poss-shipped":
            kwargs[name] = {"assistant_model": drafter}
        elif name == "poss-paper":
            kwargs[name] = {"assistant_model": drafter.with_generation_config(**PAPER_BUDGET)}
        else:
            raise SystemExit(f"unknown method {name!r}: plain, lookup, poss-shipped, poss-paper")
    return kwargs


def identity_row(label: str, method: str, plain: list[list[int]], spec: list[list[int]]) -> list:
    """[case, method, plain new tokens, speculative new tokens, identical rows, first differing token per row]."""
    firsts = []
    for a, b in zip(plain, spec):
        first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if first is None and len(a) != len(b):
            first = min(len(a), len(b))
        firsts.append(first)
    same = sum(f is None for f in firsts)
    return [label, method, sum(map(len, plain)), sum(map(len, spec)), f"{same}/{len(firsts)}",
            ", ".join("-" if f is None else str(f) for f in firsts)]


def identity_check(args, device, texts: list[str], log) -> list[list]:
    """fp32: greedy speculative == plain, per prompt at batch 1 and as one left-padded batch."""
    target, tokenizer, drafter = load_models(args, device, torch.float32)
    views = {"poss-shipped": drafter, "poss-paper": drafter.with_generation_config(**PAPER_BUDGET)}
    cases = [(f"prompt {i + 1}, batch 1", [t]) for i, t in enumerate(texts)]
    if len(texts) > 1:
        cases.append((f"prompts 1-{len(texts)}, one left-padded batch", texts))
    rows = []
    for label, group in cases:
        inputs = encode(tokenizer, group, device)
        plain, _, _ = run_call(target, inputs, {}, args.identity_new_tokens, device)
        for name, view in views.items():
            spec, _, _ = run_call(target, inputs, {"assistant_model": view}, args.identity_new_tokens, device)
            rows.append(identity_row(label, name, plain, spec))
        log(f"  identity {label}: done")
    del target, drafter
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()
    return rows


BNB4_COMPUTE_DTYPES = (torch.float32, torch.bfloat16)  # fp32: rows against plain's; bf16: the speed that matters


def target_folder(args, target) -> str:
    """A folder of the target's weights, which `from_pretrained` can quantize on load."""
    if args.tiny:
        folder = tempfile.mkdtemp(prefix="gpu_check_tiny_target_")
        target.save_pretrained(folder)
        return folder
    if args.target == "default":
        from transformers_poss.assets import convert_default_target

        return str(convert_default_target())
    return args.target


def bnb4_check(args, device, texts: list[str], log) -> tuple[list[list], str | None]:
    """A bitsandbytes 4-bit (NF4) target, batch 1, greedy: plain vs PosS-2 per compute dtype (`BNB4_COMPUTE_DTYPES`).
    Returns the table rows and why the case was skipped (None when it ran)."""
    if not args.bnb_4bit_prompts:
        return [], "--bnb-4bit-prompts 0"
    if not str(device).startswith("cuda"):
        return [], "bitsandbytes 4-bit targets run on CUDA here"
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        return [], "bitsandbytes is not installed (pip install bitsandbytes)"
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    target, tokenizer, drafter = load_models(args, device, torch.float32)
    folder, generation_config = target_folder(args, target), copy.deepcopy(target.generation_config)
    del target
    rows = []
    for dtype in BNB4_COMPUTE_DTYPES:
        quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
        quantized = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, quantization_config=quantization,
                                                         device_map={"": device}).eval()
        quantized.generation_config = copy.deepcopy(generation_config)
        entries = {"plain": [], "poss-shipped": []}
        for index, text in enumerate(texts[:args.bnb_4bit_prompts]):
            inputs = encode(tokenizer, [text], device)
            for name, kwargs in (("plain", {}), ("poss-shipped", {"assistant_model": drafter})):
                if index == 0:  # warm-up
                    run_call(quantized, inputs, kwargs, min(8, args.max_new_tokens), device)
                new, seconds, spec = run_call(quantized, inputs, kwargs, args.max_new_tokens, device)
                entries[name].append({"rows": new, "seconds": seconds, **({"spec": spec} if kwargs else {})})
        plain, poss = pool(entries["plain"]), pool(entries["poss-shipped"])
        same = sum(a["rows"] == b["rows"] for a, b in zip(entries["plain"], entries["poss-shipped"]))
        speedup = poss["tokens_per_s"] / plain["tokens_per_s"] if plain["tokens_per_s"] else None
        rows.append([str(dtype).replace("torch.", ""), plain["rows"], plain["tokens_per_s"], poss["tokens_per_s"],
                     speedup, poss.get("tau"), f"{same}/{plain['rows']}"])
        log(f"  bnb 4-bit target, {dtype} compute: {same}/{plain['rows']} rows = plain")
        del quantized
    return rows, None


def environment(device, dtype, args, drafter, target) -> list[list]:
    import transformers

    import transformers_poss

    if str(device).startswith("cuda"):
        name = torch.cuda.get_device_name(device)
    else:
        cpuinfo = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []
        models = [line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")]
        name = models[0] if models else platform.processor() or "cpu"
    from transformers_poss.devices import device_kind
    from transformers_poss.generation_config import resolve_budget

    settings = drafter.generation_config
    budget = {"draft_mode": settings.draft_mode, **resolve_budget(settings, device_kind(device, dtype))[0]}
    rows = [["device", f"{device}: {name}"],
            ["torch / transformers", f"{torch.__version__} / {transformers.__version__}"],
            ["transformers_poss", getattr(transformers_poss, "__version__", "?")],
            ["dtype (speed tables)", str(dtype).replace("torch.", "")]]
    size = f"{sum(p.numel() for p in target.parameters()) / 1e6:.1f}M parameters"
    rows += [["target", f"tiny random Llama ({size})" if args.tiny else f"{args.target} ({type(target).__name__}, "
                                                                          f"{size})"],
             ["drafter", "tiny random PosS (3 specialists)" if args.tiny else args.drafter],
             ["drafter budget on this device kind (shipped settings; resolve_budget)",
              ", ".join(f"{k}={v}" for k, v in budget.items())],
             ["paper budget", ", ".join(f"{k}={v}" for k, v in PAPER_BUDGET.items())],
             ["prompts", f"{args.prompts} (first turns, categories interleaved, chat template)"],
             ["max new tokens", str(args.max_new_tokens)]]
    if not str(device).startswith("cuda"):
        rows.append(["CPU capability", str(torch.backends.cpu.get_cpu_capability())])
    return rows


def render(args, dtype, report: dict, cells: dict, elapsed: float) -> str:
    dtype_name = str(dtype).replace("torch.", "")
    sections = [("Environment", table(["", ""], report["environment"]))]
    identity = report["identity"]
    if identity is None:  # the benchmark itself ran in fp32: its rows against plain's are the identity check
        identity = [[f"batch {b}, {c['rows']} rows", n, cells[(b, "plain")]["new_tokens"] if (b, "plain") in cells
                     else "n/a", c["new_tokens"], f"{c['same_as_plain']}/{c['rows']}",
                     "-" if c["same_as_plain"] == c["rows"] else "see the speed table"]
                    for (b, n), c in cells.items() if n != "plain"]
    sections.append(("fp32 identity (greedy: speculative rows == plain generate's)",
                     table(["case", "method", "plain new tokens", "speculative new tokens", "identical rows",
                            "first differing token per row"], identity) if identity else "(not run)"))
    sections.append((f"Speed ({dtype_name}, greedy, at most {args.max_new_tokens} new tokens; speedup = tokens/s over "
                     "plain's at the same batch size; rows = plain: rows token-identical to plain's)",
                     speed_table(cells)))
    sections.append(("The round's time split (`speculative_stats.time_split()` per target forward; other = the rest of "
                     "the call: prefill, generate's own loop)", split_table(cells)))
    bnb4_rows, bnb4_skipped = report["bnb4"]
    sections.append(("A bitsandbytes 4-bit (NF4) target (batch 1, greedy, PosS-2 at its shipped budget; rows = plain "
                     "with fp32 compute is reported, not part of the exit code: bitsandbytes may multiply one token "
                     "and several with different kernels)",
                     f"(skipped: {bnb4_skipped})" if bnb4_skipped else
                     table(["compute dtype", "prompts", "plain tokens/s", "PosS tokens/s", "speedup", "tau",
                            "rows = plain"], bnb4_rows)))
    if WARNINGS:
        sections.append(("Warnings from generate (count)",
                         "\n".join(f"- ({n}x) {text}" for text, n in WARNINGS.items())))
    if report["skipped"]:
        sections.append(("Skipped", f"batch sizes {report['skipped']}: the time budget ({args.budget_s:.0f} s) "
                                    "was spent"))
    markdown = f"# GPU check ({time.strftime('%Y-%m-%d %H:%M:%S')}, {elapsed:.0f} s)\n\n"
    return markdown + "\n\n".join(f"## {title}\n\n{body}" for title, body in sections) + "\n"


def identity_failures(report: dict, cells: dict) -> int:
    if report["identity"] is None:
        return sum(c["rows"] - c["same_as_plain"] for (_, n), c in cells.items() if n != "plain")
    return sum(int(row[4].split("/")[1]) - int(row[4].split("/")[0]) for row in report["identity"])


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.dtype == "auto":
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    else:
        dtype = getattr(torch, args.dtype)
    out_dir = Path(args.out or os.environ.get("OUT") or "gpu_check_out")
    out_dir.mkdir(parents=True, exist_ok=True)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    methods = [m for m in args.methods.split(",") if m]

    def log(message):
        print(f"[{time.perf_counter() - started:6.1f} s] {message}", flush=True)

    target, tokenizer, drafter = load_models(args, device, dtype)
    texts = load_prompts(args.prompts, tokenizer, args.tiny)
    log(f"{len(texts)} prompts; target and drafter on {device} in {dtype}")
    report = {"environment": environment(device, dtype, args, drafter, target), "identity": [], "cells": {},
              "skipped": [], "bnb4": ([], "not run yet")}
    cells, entries = {}, {}

    def write() -> str:  # after every step: a run stopped by its time limit keeps what it measured
        markdown = render(args, dtype, report, cells, time.perf_counter() - started)
        (out_dir / "gpu_check.md").write_text(markdown)
        report["cells"] = {f"{b}/{n}": c for (b, n), c in cells.items()}
        report["warnings"] = dict(WARNINGS)
        (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
        return markdown

    if not args.identity_prompts:
        report["identity"] = []
    elif dtype != torch.float32:
        report["identity"] = identity_check(args, device, texts[:args.identity_prompts], log)
    else:
        report["identity"] = None
    write()

    for batch in batch_sizes:
        if time.perf_counter() - started > args.budget_s:
            report["skipped"].append(batch)
            log(f"batch {batch}: skipped (time budget {args.budget_s:.0f} s spent)")
            continue
        kwargs = method_kwargs(drafter, methods, batch)
        batches = max(1, math.ceil(args.num_prompts / batch))
        groups = [[texts[(i * batch + j) % len(texts)] for j in range(batch)] for i in range(batches)]
        warm = encode(tokenizer, groups[0], device)
        for kw in kwargs.values():  # warm-up: kernels, allocator, the drafter's one-time setup
            run_call(target, warm, kw, min(8, args.max_new_tokens), device)
        for group in groups:
            inputs = encode(tokenizer, group, device)
            plain_rows = None
            for name, kw in kwargs.items():  # interleaved per batch: drift hits every method alike
                rows, seconds, spec = run_call(target, inputs, kw, args.max_new_tokens, device)
                if name == "plain":
                    plain_rows = rows
                same = sum(a == b for a, b in zip(rows, plain_rows)) if plain_rows is not None else 0
                entry = {"rows": rows, "seconds": seconds, "same": same}
                if "assistant_model" in kw:
                    entry["spec"] = spec
                entries.setdefault((batch, name), []).append(entry)
        for name in kwargs:
            cell = pool(entries[(batch, name)])
            cell["same_as_plain"] = sum(e["same"] for e in entries[(batch, name)])
            cells[(batch, name)] = cell
        write()
        log(f"batch {batch}: {batches} x {batch} rows: "
            + ", ".join(f"{n} {cells[(batch, n)]['tokens_per_s']:.1f} tok/s" for n in kwargs))

    report["bnb4"] = bnb4_check(args, device, texts, log)
    print(write(), flush=True)
    failures = identity_failures(report, cells)
    if failures:
        log(f"fp32 identity FAILED on {failures} row(s): see the table in {out_dir}/gpu_check.md")
        return 1
    log(f"tables written to {out_dir}/gpu_check.md and gpu_check.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
