"""`poss convert` (a research or EAGLE-3 checkpoint to a native folder) and `poss export` (a native folder to an
inference engine's layout)."""

from __future__ import annotations

import sys
import warnings

import torch

from ..hub import DEFAULT_LICENSE, guarded, write_card
from ..modeling_poss import PosSDrafter
from .eagle3 import convert_eagle3_checkpoint, is_eagle3_checkpoint
from .export import EXPORT_FORMATS, export_speculators, export_vllm
from .research import convert_research_checkpoint


def _run_convert(args) -> int:
    overrides = {"target_name_or_path": args.target_name_or_path} if args.target_name_or_path else {}
    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    convert = convert_eagle3_checkpoint if is_eagle3_checkpoint(args.source) else convert_research_checkpoint
    drafter = convert(
        args.source, args.destination, num_specialists=args.num_specialists,
        positions_per_specialist=args.positions_per_specialist, target=args.target, overwrite=args.overwrite,
        dtype=dtype, **overrides,
    )
    write_card(drafter, args.destination, overwrite=True, license=args.license)
    config = drafter.config
    print(
        f"wrote {args.destination}: {config.num_specialists} specialist(s), position groups {config.describe_groups()}, "
        f"target {config.target_name_or_path or 'not recorded (pass --target-name-or-path)'}"
    )
    return 0


def _run_export(args) -> int:
    drafter = PosSDrafter.from_pretrained(args.source)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        export = export_vllm if args.format == "vllm" else export_speculators
        export(drafter, args.destination, first_specialist=args.first_specialist, verifier=args.verifier,
               target=args.target, overwrite=args.overwrite)
    for warning in caught:
        print(f"poss export: warning: {warning.message}", file=sys.stderr)
    print(f"wrote {args.destination} ({args.format})")
    return 0


def add_subcommand(subparsers) -> None:
    """Register `poss convert` and `poss export`."""
    convert = subparsers.add_parser(
        "convert", help="convert an EAGLE/HASS/PosS or EAGLE-3 checkpoint to a native drafter folder",
        description="Convert a research checkpoint (EAGLE-1/2, HASS, PosS layout) or an EAGLE-3 checkpoint "
                    "(SafeAILab, SpecForge / SpecBundle, speculators, PosS on EAGLE-3) to a native PosS drafter "
                    "folder (safetensors, full config.json, model card). See transformers_poss.checkpoints.research "
                    "and transformers_poss.checkpoints.eagle3.",
    )
    convert.add_argument("source", help="research checkpoint folder or Hub repo id")
    convert.add_argument("destination", help="output folder (absent or empty)")
    convert.add_argument("--num-specialists", type=int, help="PosS layers (not recorded by PosS checkpoints)")
    convert.add_argument("--positions-per-specialist", type=int, help="the k of PosS-k")
    convert.add_argument("--target", help="local target model folder: check its embedding equals the stored one "
                         "(and, for EAGLE-3, give its depth for the default fused layers)")
    convert.add_argument("--target-name-or-path", help="the target's Hub id, recorded in config and card")
    convert.add_argument("--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"),
                         help="weights dtype (default: the checkpoint's)")
    convert.add_argument("--license", default=DEFAULT_LICENSE, help=f"card license (default {DEFAULT_LICENSE})")
    convert.add_argument("--overwrite", action="store_true", help="write into a non-empty destination")
    convert.set_defaults(func=guarded(_run_convert))

    export = subparsers.add_parser(
        "export", help="write a drafter in an inference engine's format (vllm: the poss_vllm plugin; speculators)",
        description="Export a drafter for an inference engine. --format vllm writes what the poss_vllm plugin "
                    "(integrations/vllm) serves: EAGLE-1/2- and EAGLE-3-style drafters, every position specialist. "
                    "--format speculators writes a one-specialist EAGLE-3 drafter for vLLM's own EAGLE-3 proposer "
                    "(several specialists are refused there unless --first-specialist). See "
                    "transformers_poss.checkpoints.export for both layouts.",
    )
    export.add_argument("--format", choices=EXPORT_FORMATS, default="speculators", help="output format")
    export.add_argument("source", help="drafter folder or Hub repo id (any layout PosSDrafter.from_pretrained reads)")
    export.add_argument("destination", help="output folder (absent or empty)")
    export.add_argument("--first-specialist", action="store_true",
                        help="export specialist 0 of a multi-specialist drafter alone (with a warning): for comparisons, "
                        "or where the format has one layer for every position")
    export.add_argument("--target", help="local target folder: checked against the drafter, gives the verifier's "
                        "architectures and is the verifier the export names (what `vllm serve EXPORT` loads)")
    export.add_argument("--verifier", help="the target's name or path written in the export (default: --target, "
                        "else the drafter's target_name_or_path)")
    export.add_argument("--overwrite", action="store_true", help="write into a non-empty destination")
    export.set_defaults(func=guarded(_run_export))
