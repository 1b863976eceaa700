"""`poss bench`: run plain generate, prompt lookup, an assistant model and PosS drafters side by side.

Example (the default target and the shipped drafters, two questions of each Spec-Bench set):

    poss bench --target default --drafter default --prompts path/to/specbench --limit 2 --max-new-tokens 32
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..assets import DTYPES, runtime_options
from .._cli_common import typed_command
from ..plotting import require_matplotlib


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--target", default="default",
                        help="'default' (SmolLM2-135M-Instruct from the package registry), a model folder or a "
                             ".gguf file")
    parser.add_argument("--drafter", action="append", default=[], metavar="NAME=PATH",
                        help="a PosS drafter folder, as NAME=PATH or PATH; 'default' = the shipped drafters; "
                             "repeatable")
    parser.add_argument("--assistant", default=None, metavar="PATH",
                        help="a small model with the target's tokenizer for transformers' assisted generation")
    parser.add_argument("--assistant-tokens", type=int, default=None,
                        help="num_assistant_tokens for the assistant (transformers' default schedule if unset)")
    parser.add_argument("--prompt-lookup", type=int, default=10, metavar="N",
                        help="prompt_lookup_num_tokens for transformers' prompt lookup; 0 leaves it out")
    parser.add_argument("--modes", default="tree,chain", help="PosS draft modes to run, comma separated")
    parser.add_argument("--tree-depth", type=int, default=None, help="override every drafter's tree_depth")
    parser.add_argument("--tree-top-k", type=int, default=None, help="override every drafter's tree_top_k")
    parser.add_argument("--tree-total-tokens", type=int, default=None,
                        help="override every drafter's tree_total_tokens")
    parser.add_argument("--lookup-tokens", type=int, default=None, metavar="N",
                        help="override every drafter's lookup_num_tokens (prompt-lookup branch grafted onto the tree; "
                             "0 turns it off)")
    parser.add_argument("--int8-draft-weights", choices=("on", "off"), default=None,
                        help="draft on 8-bit weight copies (CPU) or not, for every drafter (default: each drafter's "
                             "own choice; the shipped PosS-2 has it on)")
    parser.add_argument("--prompts", action="append", default=[], metavar="SPEC",
                        help="a .jsonl file, a folder of them, registry:NAME (mt_bench, humaneval, nq, xsum, asdiv) or "
                             "a Hub dataset id[:split]; repeatable")
    parser.add_argument("--datasets", default=None, help="only these dataset names (comma separated)")
    parser.add_argument("--limit", type=int, default=None, help="questions per dataset")
    parser.add_argument("--per-category", type=int, default=None, metavar="N",
                        help="the first N questions of each category of a dataset (a balanced sample; MT-Bench's "
                             "first ten questions are all writing), before --limit")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=None, help="sample at this temperature (default: greedy)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="auto",
                        help="auto: bfloat16 where the hardware computes it natively, else float32")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls per method before timing")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-consistency", action="store_true",
                        help="skip the teacher-forced greedy-consistency check")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="greedy-consistency logit tolerance (default 0.5 in bf16/fp16, 1e-3 in fp32)")
    parser.add_argument("--no-chat-template", action="store_true", help="feed the turns as plain text")
    parser.add_argument("--output-dir", default=None,
                        help="where results.json, results.md and the plots go (default runs/bench-TIME)")
    parser.add_argument("--no-plots", action="store_true", help="write no PNG plots (matplotlib not needed)")
    parser.add_argument("--quiet", action="store_true", help="no per-question progress lines")
    parser.add_argument("--batch-size", default=None, metavar="LIST",
                        help="comma-separated batch sizes (e.g. 1,2,4,8,16): measure throughput of plain batched "
                             "generate and each drafter in tree mode on left-padded batches of first turns instead "
                             "(greedy; prompt lookup and --assistant are left out: transformers does not batch them; "
                             "writes batch.json, batch.md, batch.png)")
    return parser


def parse_drafter_specs(specs: list[str]) -> list[tuple[str, Path]]:
    """`NAME=PATH` / `PATH` / `default` -> [(name, folder)]; raises ValueError / FileNotFoundError before any work."""
    from ..assets import DEFAULT_DRAFTERS, available_default_drafters, default_drafter_path

    parsed = []
    for spec in specs:
        if spec == "default":
            shipped = available_default_drafters()
            if not shipped:
                raise FileNotFoundError(
                    "--drafter default: this installation ships no drafters yet (looked for "
                    + ", ".join(str(default_drafter_path(n)) for n in DEFAULT_DRAFTERS)
                    + "). Train one (`poss train`) or pass --drafter NAME=PATH."
                )
            parsed.extend(shipped.items())
            continue
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = Path(spec).name, spec
        if not name or not path:
            raise ValueError(f"--drafter {spec!r}: expected NAME=PATH")
        folder = Path(path).expanduser()
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"--drafter {spec!r}: {folder} is not a drafter folder (no config.json)")
        parsed.append((name, folder))
    names = [n for n, _ in parsed]
    if len(set(names)) != len(names):
        raise ValueError(f"drafter names must be unique, got {names}")
    return parsed


def _check_args(args) -> None:
    if not args.prompts:
        raise ValueError("--prompts is required (a .jsonl file, a folder, registry:NAME or a Hub dataset id)")
    for flag, value in (("--limit", args.limit), ("--per-category", args.per_category)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.temperature is not None and args.temperature <= 0:
        raise ValueError(f"--temperature must be > 0, got {args.temperature}")
    for name in ("tree_depth", "tree_top_k", "tree_total_tokens", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - {"tree", "chain"}:
        raise ValueError(f"--modes takes tree and/or chain, got {args.modes!r}")
    if args.prompt_lookup < 0:
        raise ValueError(f"--prompt-lookup must be >= 0, got {args.prompt_lookup}")
    if args.lookup_tokens is not None and args.lookup_tokens < 0:
        raise ValueError(f"--lookup-tokens must be >= 0, got {args.lookup_tokens}")
    if args.assistant is not None and not Path(args.assistant).expanduser().exists():
        raise FileNotFoundError(f"--assistant {args.assistant}: no such file or folder")
    if args.batch_size is not None:
        _batch_sizes(args.batch_size)
        if args.temperature is not None:
            raise ValueError("--batch-size measures greedy decoding: leave out --temperature")
        if not args.drafter:
            raise ValueError("--batch-size needs at least one --drafter")
    if args.target != "default" and not Path(args.target).expanduser().exists():
        raise FileNotFoundError(f"--target {args.target}: no such file or folder (or use 'default')")
    if not args.no_plots:
        try:
            require_matplotlib("poss bench's plots")
        except ImportError:
            raise RuntimeError('poss bench\'s plots needs matplotlib: pip install "transformers-poss[bench]", or pass '
                               "--no-plots") from None


def run_bench(args) -> int:
    from ..assets import load_causal_lm, load_drafter, load_target
    from ..devices import device_kind
    from .methods import assistant_method, baseline_method, poss_methods, prompt_lookup_method
    from .prompts import load_prompt_sets
    from .report import environment, markdown_table, summarize, write_json, write_plots
    from .runner import run_benchmark
    from .turns import has_follow_ups, plot_turns, split, turn_table

    try:
        _check_args(args)
        drafter_specs = parse_drafter_specs(args.drafter)
        prompt_sets = {}
        for spec in args.prompts:
            prompt_sets.update(load_prompt_sets(spec, limit=args.limit, per_category=args.per_category))
        if args.datasets:
            wanted = [d for d in args.datasets.split(",") if d]
            missing = set(wanted) - set(prompt_sets)
            if missing:
                raise ValueError(f"--datasets {sorted(missing)} not among the loaded sets {sorted(prompt_sets)}")
            prompt_sets = {name: prompt_sets[name] for name in wanted}
        questions = sum(len(q) for q in prompt_sets.values())
        if args.batch_size and max(_batch_sizes(args.batch_size)) > questions:
            raise ValueError(f"--batch-size {args.batch_size} needs at least {max(_batch_sizes(args.batch_size))} "
                             f"questions; the prompt sets give {questions}")
    except (ValueError, FileNotFoundError, RuntimeError) as error:
        print(f"poss bench: error: {error}", file=sys.stderr)
        return 2

    device, dtype = runtime_options(args.threads, args.device, args.dtype)
    log = (lambda message: None) if args.quiet else (lambda message: print(message, file=sys.stderr, flush=True))
    log(f"loading target {args.target} ({str(dtype).removeprefix('torch.')}, {device}) ...")
    target, tokenizer = load_target(args.target, dtype, device)

    methods = [baseline_method()]
    if args.prompt_lookup:
        methods.append(prompt_lookup_method(args.prompt_lookup))
    if args.assistant:
        assistant, assistant_tokenizer = load_causal_lm(args.assistant, dtype=dtype, device=device)
        if assistant_tokenizer.get_vocab() != tokenizer.get_vocab():
            print("poss bench: error: --assistant does not share the target's tokenizer", file=sys.stderr)
            return 2
        if args.assistant_tokens:
            assistant.generation_config.num_assistant_tokens = args.assistant_tokens
        methods.append(assistant_method(assistant, source=str(args.assistant)))
    budget = {"tree_depth": args.tree_depth, "tree_top_k": args.tree_top_k, "tree_total_tokens": args.tree_total_tokens,
              "lookup_num_tokens": args.lookup_tokens}
    kernels = {} if args.int8_draft_weights is None else {"int8_draft_weights": args.int8_draft_weights == "on"}
    modes = [m for m in args.modes.split(",") if m]
    kind = device_kind(target.device, target.dtype)
    for name, folder in drafter_specs:
        drafter = load_drafter(folder, **kernels)
        drafter.bind(target)  # checked against the target, moved beside its lm_head
        methods.extend(poss_methods(name, drafter, modes, source=str(folder), device_kind=kind, **budget))

    if args.batch_size:
        return _run_batch_bench(args, target, tokenizer, prompt_sets, methods, dtype, log)
    questions = sum(len(q) for q in prompt_sets.values())
    log(f"{len(methods)} methods x {questions} questions in {sorted(prompt_sets)}: {[m.name for m in methods]}")
    started = time.time()
    run = run_benchmark(
        target, tokenizer, prompt_sets, methods, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        warmup=args.warmup, seed=args.seed, check_consistency=not args.no_consistency, tolerance=args.tolerance,
        use_chat_template=not args.no_chat_template, progress=log,
    )
    rows = summarize(run)
    env = environment(target, dtype)
    env["wall_seconds"] = round(time.time() - started, 1)
    env["command"] = typed_command()
    output = Path(args.output_dir or f"runs/bench-{time.strftime('%Y%m%d-%H%M%S')}")
    table = markdown_table(rows)
    print(table)
    json_path = write_json(output / "results.json", run, rows, env)
    (output / "results.md").write_text(table + "\n")
    plots = [] if args.no_plots else write_plots(output, rows)
    if has_follow_ups(run.to_dicts()):  # new questions and follow-ups apart (`poss turns`)
        turns = split(run.to_dicts())
        print("\n" + turn_table(turns))
        (output / "results.md").write_text(table + "\n\n" + turn_table(turns) + "\n")
        if not args.no_plots:
            plots.append(plot_turns(turns, env, output / "turns.png"))
    log(f"wrote {json_path}" + "".join(f", {p}" for p in plots))
    return 0


def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part]
    except ValueError:
        raise ValueError(f"--batch-size takes comma-separated integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--batch-size values must be >= 1, got {text!r}")
    return sizes


def _run_batch_bench(args, target, tokenizer, prompt_sets, methods, dtype, log) -> int:
    from .batching import batch_table, run_batch_benchmark, write_batch_results
    from .report import environment

    drafters = {m.name.removesuffix("-tree"): m.generate_kwargs["assistant_model"] for m in methods
                if m.kind == "poss" and m.mode == "tree"}
    questions = [q for qs in prompt_sets.values() for q in qs]
    rows = run_batch_benchmark(target, tokenizer, questions, drafters, _batch_sizes(args.batch_size),
                               max_new_tokens=args.max_new_tokens, warmup=args.warmup,
                               use_chat_template=not args.no_chat_template, progress=log)
    env = environment(target, dtype)
    env["command"] = typed_command()
    output = Path(args.output_dir or f"runs/bench-batch-{time.strftime('%Y%m%d-%H%M%S')}")
    print(batch_table(rows))
    written = write_batch_results(output, rows, env, plots=not args.no_plots)
    log("wrote " + ", ".join(str(p) for p in written))
    return 0


def build_parser() -> argparse.ArgumentParser:
    return add_arguments(argparse.ArgumentParser(prog="poss bench", description=__doc__.splitlines()[0]))


def main(argv: list[str] | None = None) -> int:
    return run_bench(build_parser().parse_args(argv))


def add_subcommand(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="benchmark PosS drafters against plain generate and other methods",
                                   description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.set_defaults(func=run_bench)
