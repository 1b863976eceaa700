"""Hub integration: model cards for PosS drafters, pushing with the card, and `poss card`.

**Card.** `render_card` fills the template `transformers_poss/hub_cards/drafter_card.md` (the one copy of the
template text; the repository's top-level `hub_cards/` points to it) through `huggingface_hub.ModelCard`: YAML
metadata (`library_name: transformers-poss`, `base_model` = the target when it is a Hub id, tags including
`speculative-decoding`, `license`, `pipeline_tag: text-generation`, and `model-index` results with tau and speedup
per dataset when a benchmark is given), a usage snippet, the drafter's configuration, its training record
(`training_record.json`) and the benchmark table. `write_card` writes it as `README.md` when the folder has none (an
existing README is never replaced): `poss card`, `poss convert` and the end of `poss train` call it, and
`PosSDrafter.push_to_hub` / `save_pretrained(..., push_to_hub=True)` upload it.

**Benchmark JSON** (what `poss card --benchmark` reads and the benchmark runner writes)::

    {
      "results": [
        {"dataset": "mt_bench", "method": "poss", "tokens_per_s": 41.2, "speedup": 1.83,
         "mean_acceptance_length": 2.91, "position_acceptance": [0.74, 0.61, 0.52]},
        {"dataset": "mt_bench", "method": "plain", "tokens_per_s": 22.5, "speedup": 1.0,
         "mean_acceptance_length": null, "position_acceptance": []}
      ],
      "environment": {"device": "cpu", "dtype": "bfloat16", "transformers": "5.24.0"}
    }

- `results`: one row per (dataset, method). `dataset` and `method` are non-empty strings; `tokens_per_s` and
  `speedup` (tokens/s over plain `generate` tokens/s, same run) are numbers; `mean_acceptance_length` (tau, see
  `transformers_poss.metrics`) is a number, or null for methods that draft nothing; `position_acceptance` is the list
  `[alpha_1, ..., alpha_depth]` (numbers; NaN or null where no round reached the position; empty when not drafting).
  Other keys in a row are allowed and ignored.
- Rows whose `method` starts with `"poss"` (case-insensitive) are this drafter's results: they go into
  `model-index`. Other rows (`"plain"`, `"prompt_lookup"`, `"eagle2"`, ...) appear in the table for comparison.
- `environment`: an object of free-form key/value pairs (device, dtype, versions, threads, prompts, ...), listed
  under the table.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import tempfile
from importlib import resources
from pathlib import Path

import torch

from .configuration_poss import PosSConfig
from .generation_config import PosSGenerationConfig, resolve_budget
from .checkpoints.native import read_drafter_files
from .modeling_poss import PosSDrafter

TEMPLATE_NAME = "drafter_card.md"
LIBRARY_NAME = "transformers-poss"
DEFAULT_LICENSE = "apache-2.0"
CARD_TAGS = ("speculative-decoding", "poss", "eagle", "draft-model", "transformers")
DRAFTER_METHOD_PREFIX = "poss"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def template_path() -> Path:
    """Path of the card template shipped with the package."""
    return Path(str(resources.files("transformers_poss") / "hub_cards" / TEMPLATE_NAME))


# ---- benchmark JSON -----------------------------------------------------------------------------------------------
def _number_or_none(value, where: str, allow_none: bool) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"benchmark {where} must be a number{' or null' if allow_none else ''}, got {value!r}")
    return float(value)


def load_benchmark(source: str | os.PathLike | dict) -> dict:
    """Read and check a benchmark JSON (path or already-parsed dict); see the module docstring for the format."""
    if isinstance(source, dict):
        data = source
    else:
        path = Path(source)
        if not path.is_file():
            raise ValueError(f"benchmark file {path} does not exist")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise ValueError(f"benchmark file {path} is not valid JSON: {error}") from None
    if not isinstance(data, dict) or not isinstance(data.get("results"), list) or not data["results"]:
        raise ValueError('a benchmark must be an object with a non-empty "results" list')
    environment = data.get("environment", {})
    if not isinstance(environment, dict):
        raise ValueError('benchmark "environment" must be an object')
    rows = []
    for i, row in enumerate(data["results"]):
        where = f"results[{i}]"
        if not isinstance(row, dict):
            raise ValueError(f"benchmark {where} must be an object")
        for key in ("dataset", "method"):
            if not isinstance(row.get(key), str) or not row[key].strip():
                raise ValueError(f"benchmark {where}.{key} must be a non-empty string, got {row.get(key)!r}")
        alphas = row.get("position_acceptance", [])
        if not isinstance(alphas, list):
            raise ValueError(f"benchmark {where}.position_acceptance must be a list")
        rows.append({
            **row,
            "tokens_per_s": _number_or_none(row.get("tokens_per_s"), f"{where}.tokens_per_s", allow_none=False),
            "speedup": _number_or_none(row.get("speedup"), f"{where}.speedup", allow_none=False),
            "mean_acceptance_length": _number_or_none(
                row.get("mean_acceptance_length"), f"{where}.mean_acceptance_length", allow_none=True
            ),
            "position_acceptance": [
                _number_or_none(a, f"{where}.position_acceptance[{j}]", allow_none=True) for j, a in enumerate(alphas)
            ],
        })
    return {"results": rows, "environment": environment}


def _finite(value) -> bool:
    return value is not None and math.isfinite(value)


def _is_drafter_method(method: str, prefixes: tuple[str, ...]) -> bool:
    return method.lower().startswith(tuple(p.lower() for p in prefixes))


# ---- the card -----------------------------------------------------------------------------------------------------
def drafter_description(source) -> tuple[PosSConfig, PosSGenerationConfig, dict[str, dict]]:
    """`(config, generation_config, records)` of a `PosSDrafter`, a `PosSConfig` (default settings, no records) or a
    native drafter folder (read without its weights)."""
    if isinstance(source, PosSConfig):
        return source, PosSGenerationConfig(), {"training_record": {}, "tuning_record": {}}
    if isinstance(getattr(source, "config", None), PosSConfig):
        return source.config, source.generation_config, {
            "training_record": source.training_record, "tuning_record": source.tuning_record,
        }
    path = Path(source)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} is not a drafter folder (no config.json)")
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    if config.get("model_type") != PosSConfig.model_type:
        raise ValueError(
            f"{path} is not a native PosS drafter folder (model_type {config.get('model_type')!r}); convert research "
            "checkpoints first with `poss convert`"
        )
    files = read_drafter_files(path)
    return PosSConfig.from_pretrained(str(path)), files.generation_config, files.records


def _parameter_count(config: PosSConfig) -> int:
    with torch.device("meta"):
        model = PosSDrafter(config)
    return sum(p.numel() for p in model.parameters())


def _human(count: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.2f}{unit} ({count:,})"
    return f"{count:,}"


def _record_value(value) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text.replace("|", "\\|").replace("\n", " ")


def _fmt(value, spec: str, suffix: str = "") -> str:
    return f"{value:{spec}}{suffix}" if _finite(value) else "–"


def is_hub_id(name: str | None) -> bool:
    """Whether `name` looks like a Hub repo id (`org/name`) and is not a local path."""
    return bool(name) and bool(_HUB_ID.match(name)) and not Path(name).exists()


def render_card(
    source, benchmark: str | os.PathLike | dict | None = None, *, model_id: str | None = None,
    license: str = DEFAULT_LICENSE, tags: list[str] | tuple[str, ...] = (),
    drafter_methods: tuple[str, ...] = (DRAFTER_METHOD_PREFIX,),
):
    """The model card (`huggingface_hub.ModelCard`) of a drafter.

    Args:
        source: a `PosSDrafter`, its `PosSConfig`, or a native drafter folder.
        benchmark: benchmark JSON path or dict (module docstring); adds the table and `model-index` results.
        model_id: what the usage snippet passes to `PosSDrafter.from_pretrained` (repo id or folder); defaults to
            the folder when `source` is one.
        license: the card's license (match the target's terms where they apply).
        tags: extra tags besides `CARD_TAGS`.
        drafter_methods: benchmark `method` prefixes that are this drafter's results (for `model-index`).
    """
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

    config, generation_config, records = drafter_description(source)
    if model_id is None:
        model_id = str(source) if isinstance(source, (str, os.PathLike)) else "path/to/this/drafter"
    target = config.target_name_or_path
    name = Path(model_id.rstrip("/")).name or "poss-drafter"
    results, rows, environment_rows, positions = [], [], [], []
    if benchmark is not None:
        bench = load_benchmark(benchmark)
        mine = [r for r in bench["results"] if _is_drafter_method(r["method"], drafter_methods)]
        if not mine:
            methods = sorted({r["method"] for r in bench["results"]})
            raise ValueError(
                f"the benchmark has no rows for this drafter (methods starting with {drafter_methods}); "
                f"it has {methods}"
            )
        for r in mine:
            common = dict(task_type="text-generation", task_name="Speculative decoding",
                          dataset_type=r["dataset"], dataset_name=r["dataset"])
            if _finite(r["mean_acceptance_length"]):
                results.append(EvalResult(**common, metric_type="mean_acceptance_length",
                                          metric_name=f"Mean acceptance length tau ({r['method']})",
                                          metric_value=round(r["mean_acceptance_length"], 4)))
            if _finite(r["speedup"]):
                results.append(EvalResult(**common, metric_type="speedup",
                                          metric_name=f"Speedup over plain generate ({r['method']})",
                                          metric_value=round(r["speedup"], 4)))
        depth = max(len(r["position_acceptance"]) for r in bench["results"])
        positions = list(range(1, depth + 1))
        for r in bench["results"]:
            alphas = r["position_acceptance"] + [None] * (depth - len(r["position_acceptance"]))
            rows.append({
                "dataset": r["dataset"].replace("|", "\\|"), "method": r["method"].replace("|", "\\|"),
                "tokens_per_s": _fmt(r["tokens_per_s"], ".1f"), "speedup": _fmt(r["speedup"], ".2f", "x"),
                "tau": _fmt(r["mean_acceptance_length"], ".2f"),
                "alphas": [_fmt(None if a is None else 100 * a, ".1f", "%") for a in alphas],
            })
        environment_rows = [(k, _record_value(v)) for k, v in bench["environment"].items()]
    card_data = ModelCardData(
        library_name=LIBRARY_NAME,
        base_model=target if is_hub_id(target) else None,
        tags=list(dict.fromkeys([*CARD_TAGS, *tags])),
        license=license,
        pipeline_tag="text-generation",
        model_name=name,
        eval_results=results or None,
    )
    record = dict(records["training_record"])
    return ModelCard.from_template(
        card_data,
        template_path=str(template_path()),
        title=f"{name}: PosS drafter" + (f" for {target}" if target else ""),
        target=target,
        target_url=f"https://huggingface.co/{target}" if is_hub_id(target) else target,
        model_id=model_id,
        config=config,
        # the budget of device kinds without a tuned entry, beside the entries
        generation=generation_config.updated(**resolve_budget(generation_config, None)[0]),
        tuning=records["tuning_record"],
        parameters=_human(_parameter_count(config)),
        training_rows=[(k, _record_value(v)) for k, v in record.items()],
        converted="converted_from" in record,
        converted_from=record.get("converted_from"),
        benchmark_rows=rows,
        positions=positions,
        environment_rows=environment_rows,
    )


def write_card(
    source, folder: str | os.PathLike, *, overwrite: bool = False, model_id: str | None = None, **card_kwargs,
) -> Path | None:
    """Write `folder/README.md` unless one exists (or `overwrite`); returns the path written, or `None`."""
    path = Path(folder) / "README.md"
    if path.exists() and not overwrite:
        return None
    card = render_card(source, model_id=model_id if model_id is not None else str(folder), **card_kwargs)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(str(card), encoding="utf-8")
    return path


# ---- pushing -----------------------------------------------------------------------------------------------------
def push_drafter_to_hub(
    model, repo_id: str, *, folder: str | os.PathLike | None = None, commit_message: str | None = None,
    commit_description: str | None = None, private: bool | None = None, token: str | bool | None = None,
    revision: str | None = None, create_pr: bool = False, tags: list[str] | None = None, benchmark=None,
    license: str = DEFAULT_LICENSE, api=None, **save_kwargs,
):
    """`PosSDrafter.push_to_hub` (and `save_pretrained(..., push_to_hub=True)`): save the drafter, add its card, upload.

    The drafter is saved with `save_pretrained(**save_kwargs)` (e.g. `max_shard_size`) into `folder`, which is kept (as
    `save_pretrained(push_to_hub=True)` keeps it), or into a temporary folder. A README.md the Hub repo already has
    is kept (only `tags` are added to it); otherwise this drafter's card is uploaded, with the repo id in its usage
    snippet. `api` defaults to `huggingface_hub.HfApi()`.
    """
    options = dict(token=token, private=private, revision=revision, create_pr=create_pr, tags=tags,
                   commit_message=commit_message, commit_description=commit_description, benchmark=benchmark,
                   license=license, api=api)

    def save(target_folder):
        model.save_pretrained(target_folder, **save_kwargs)

    if folder is not None:
        return push_folder(model, folder, repo_id, save=save, **options)
    with tempfile.TemporaryDirectory() as temporary:
        return push_folder(model, temporary, repo_id, save=save, **options)


def _remote_card(api, repo_id: str, revision: str | None, token):
    """The README.md already in the Hub repo (at `revision`, else the default branch), or `None`."""
    from huggingface_hub import ModelCard
    from huggingface_hub.errors import RevisionNotFoundError

    for rev in dict.fromkeys([revision, None]):
        try:
            if api.file_exists(repo_id, "README.md", revision=rev, token=token):
                path = api.hf_hub_download(repo_id=repo_id, filename="README.md", revision=rev, token=token)
                return ModelCard.load(path)
            return None
        except RevisionNotFoundError:
            continue
    return None


def push_folder(
    model, folder, repo_id: str, *, save, token=None, private: bool | None = None, revision: str | None = None,
    create_pr: bool = False, commit_message: str | None = None, commit_description: str | None = None,
    tags: list[str] | None = None, benchmark=None, license: str = DEFAULT_LICENSE, api=None,
):
    """Create the repo, `save(folder)`, add the card when absent, and commit the files that saving wrote.

    Uploaded: every file written or changed by `save` (as transformers does) and README.md: the repo's own README
    when it has one (with `tags` added), else the folder's README.md (this drafter's card unless the user wrote one).
    """
    from huggingface_hub import CommitOperationAdd, HfApi

    api = api or HfApi()
    repo_id = api.create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    before = {p: p.stat().st_mtime for p in folder.rglob("*") if p.is_file()}
    save(folder)
    write_card(model, folder, model_id=repo_id, benchmark=benchmark, license=license, tags=tags or ())
    remote_card = _remote_card(api, repo_id, revision, token)
    operations = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        relative = path.relative_to(folder).as_posix()
        if relative == "README.md" or any(part.startswith(".") for part in path.relative_to(folder).parts):
            continue
        if path not in before or path.stat().st_mtime > before[path]:
            operations.append(CommitOperationAdd(path_in_repo=relative, path_or_fileobj=str(path)))
    if remote_card is None:
        operations.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=str(folder / "README.md")))
    elif tags and not set(tags) <= set(remote_card.data.tags or []):
        remote_card.data.tags = list(dict.fromkeys([*(remote_card.data.tags or []), *tags]))
        operations.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=str(remote_card).encode()))
    if revision is not None and not revision.startswith("refs/pr"):
        api.create_branch(repo_id=repo_id, branch=revision, token=token, exist_ok=True)
    return api.create_commit(
        repo_id=repo_id, operations=operations, commit_message=commit_message or "Upload PosS drafter",
        commit_description=commit_description, token=token, create_pr=create_pr, revision=revision,
    )


# ---- `poss card` and `poss convert` -------------------------------------------------------------------------------
def _run_card(args) -> int:
    card = render_card(
        args.folder, args.benchmark, model_id=args.model_id, license=args.license,
        drafter_methods=tuple(args.method) if args.method else (DRAFTER_METHOD_PREFIX,),
    )
    if args.output == "-":
        sys.stdout.write(str(card))
        return 0
    output = Path(args.output) if args.output else Path(args.folder) / "README.md"
    if output.exists() and not args.force:
        raise ValueError(f"{output} exists; pass --force to replace it or --output to write elsewhere")
    output.write_text(str(card), encoding="utf-8")
    print(f"wrote {output}")
    return 0


def guarded(run):
    def wrapped(args) -> int:
        try:
            return run(args)
        except ValueError as error:
            print(f"poss {args.command}: error: {error}", file=sys.stderr)
            return 2

    return wrapped


def add_subcommand(subparsers) -> None:
    """Register `poss card`."""
    card = subparsers.add_parser(
        "card", help="write the model card (README.md) of a drafter folder",
        description="Render the model card of a native PosS drafter folder, optionally with benchmark results.",
    )
    card.add_argument("folder", help="native PosS drafter folder (config.json + weights)")
    card.add_argument("--benchmark", help="benchmark JSON (format: transformers_poss.hub docstring)")
    card.add_argument("--model-id", help="repo id for the usage snippet (default: the folder)")
    card.add_argument("--license", default=DEFAULT_LICENSE, help=f"license metadata (default {DEFAULT_LICENSE})")
    card.add_argument("--method", action="append", help="benchmark method prefix of this drafter's rows (default poss)")
    card.add_argument("--output", help="where to write (default FOLDER/README.md; '-' prints the card)")
    card.add_argument("--force", action="store_true", help="replace an existing README.md")
    card.set_defaults(func=guarded(_run_card))
