"""The benchmark loop: every method on every turn of every question, interleaved, with per-turn figures.

For each question the methods run one after another (their order rotates from question to question), each holding
its own conversation: a later turn is asked after *that method's* answers to the earlier ones (MT-Bench style).
Per turn it records the new tokens, wall time, tokens/s, acceptance (PosS: per-round acceptance lengths; other
assisted methods: tau from the count of target forwards), draft/verify time, peak memory, and -- against the baseline's
answer to the same turn -- token identity and greedy consistency.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import torch

from .losslessness import compare_tokens, default_tolerance, greedy_consistency
from .methods import BASELINE, Method
from .prompts import Question, chat_prompt


@dataclass
class TurnRecord:
    """What one method did on one turn of one question."""

    dataset: str
    question_id: str | int
    category: str
    turn: int
    method: str
    prompt_tokens: int
    new_tokens: int
    seconds: float
    tokens_per_s: float
    target_forwards: int
    acceptance_lengths: list[int] | None = None  # PosS only: accepted draft tokens per round
    tau: float | None = None
    tau_source: str | None = None  # "rounds" (PosS stats) or "target_forwards"
    time_split: dict | None = None  # PosS only: draft / verify / bookkeeping seconds
    lookup_tokens: int | None = None  # PosS only: accepted draft tokens only the prompt-lookup branch proposed
    in_draft_vocab: int | None = None  # PosS with a draft vocabulary: answer tokens it could have drafted
    peak_memory_bytes: int | None = None
    identical: bool | None = None  # token identity with the baseline's answer (greedy only)
    first_mismatch: int | None = None
    consistent: bool | None = None  # greedy consistency of this answer (greedy only)
    max_gap: float | None = None
    tokens_over: int | None = None
    prompt_text: str = ""
    answer: str = ""
    output_ids: list[int] = field(default_factory=list, repr=False)


class ForwardCounter:
    """Counts forward calls of a module (target forwards during one `generate`)."""

    def __init__(self, module):
        self.count = 0
        self._handle = module.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.count += 1

    def remove(self):
        self._handle.remove()


class PeakMemory:
    """Peak memory during a block: `torch.cuda.max_memory_allocated` on GPU, peak RSS (Linux VmHWM) on CPU.

    On CPU the kernel's high-water mark is reset before each block (`/proc/self/clear_refs`); where that is not
    possible the process-wide peak RSS is reported (`per_call` is then False).
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.per_call = True
        self.value: int | None = None

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            try:
                with open("/proc/self/clear_refs", "w") as handle:
                    handle.write("5")
            except OSError:
                self.per_call = False
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
            self.value = int(torch.cuda.max_memory_allocated())
            return False
        self.value = _peak_rss_bytes()
        return False

    @property
    def kind(self) -> str:
        if self.cuda:
            return "torch.cuda.max_memory_allocated"
        return "peak RSS per call (VmHWM)" if self.per_call else "process peak RSS"


def _peak_rss_bytes() -> int | None:
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)
    except (ImportError, OSError):
        return None


@dataclass
class BenchmarkRun:
    records: list[TurnRecord]
    methods: list[Method]
    settings: dict

    def to_dicts(self) -> list[dict]:
        return [asdict(r) for r in self.records]


def _generate(target, input_ids, method: Method, max_new_tokens, sampling: dict, seed: int):
    """One timed `generate` call; returns (sequence `[L]`, seconds, target forwards, peak memory, the PosS
    `GenerationStats` or None)."""
    counter = ForwardCounter(target)
    memory = PeakMemory(input_ids.device)
    if sampling:
        torch.manual_seed(seed)
    try:
        with memory, torch.no_grad():
            if input_ids.device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                                  **sampling, **method.call_kwargs())
            if input_ids.device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
    finally:
        counter.remove()
    if isinstance(out, torch.Tensor):
        return out[0], seconds, counter.count, memory, None
    return out.sequences[0], seconds, counter.count, memory, getattr(out, "speculative_stats", None)


def run_benchmark(
    target,
    tokenizer,
    prompt_sets: dict[str, list[Question]],
    methods: list[Method],
    max_new_tokens: int = 128,
    temperature: float | None = None,
    warmup: int = 1,
    seed: int = 0,
    check_consistency: bool = True,
    tolerance: float | None = None,
    use_chat_template: bool = True,
    progress=None,
) -> BenchmarkRun:
    """Run every method on every turn of every question; greedy unless `temperature` is given.

    Args:
        prompt_sets: `{dataset: questions}` (see `load_prompt_sets`).
        methods: the first must be the baseline (`baseline_method()`); all others are compared with it.
        temperature: sample with this temperature (identity and consistency checks are then not applicable).
        warmup: untimed calls per method before timing (on the first turn of the first question, 16 tokens).
        tolerance: greedy-consistency logit tolerance (default by dtype: 0.5 bf16/fp16, 1e-3 fp32).
        progress: optional callable(str) for progress lines.
    """
    if not methods or methods[0].name != BASELINE:
        raise ValueError("the first method must be the baseline (plain target.generate)")
    if len({m.name for m in methods}) != len(methods):
        raise ValueError(f"method names must be unique: {[m.name for m in methods]}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature is not None and temperature <= 0:
        raise ValueError(f"temperature must be > 0 (leave it unset for greedy), got {temperature}")
    if not any(prompt_sets.values()):
        raise ValueError("no questions to run")
    greedy = temperature is None
    sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": temperature}
    device = target.get_input_embeddings().weight.device
    tolerance = default_tolerance(target.dtype) if tolerance is None else tolerance

    def encode(text):
        return tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"].to(device)

    first = next(q for questions in prompt_sets.values() for q in questions)
    warm_ids = encode(chat_prompt(tokenizer, first.turns, [], use_chat_template))
    for method in methods:
        for _ in range(warmup):
            _generate(target, warm_ids, method, min(16, max_new_tokens), sampling, seed)

    records: list[TurnRecord] = []
    index = 0
    for dataset, questions in prompt_sets.items():
        for question in questions:
            order = methods[index % len(methods):] + methods[: index % len(methods)]
            per_method: dict[str, list[TurnRecord]] = {}
            for method in order:
                per_method[method.name] = _run_conversation(
                    target, tokenizer, encode, question, method, max_new_tokens, sampling, seed + index,
                    use_chat_template,
                )
            baseline = per_method[BASELINE]
            for method in methods:  # checks after the timed calls, in the original method order
                for turn_record, reference in zip(per_method[method.name], baseline):
                    if greedy:
                        if method.name != BASELINE:
                            match = compare_tokens(reference.output_ids, turn_record.output_ids)
                            turn_record.identical = match["identical"]
                            turn_record.first_mismatch = match["first_mismatch"]
                        if check_consistency:
                            full = torch.tensor(turn_record.output_ids)
                            prompt = encode(turn_record.prompt_text)[0].cpu()
                            # plain generate's answer to the same prompt spares the check's own generate
                            same_prompt = turn_record.prompt_text == reference.prompt_text
                            check = greedy_consistency(target, torch.cat((prompt, full)), prompt.shape[0], tolerance,
                                                       reference=reference.output_ids if same_prompt else None)
                            turn_record.consistent = check["consistent"]
                            turn_record.max_gap = check["max_gap"]
                            turn_record.tokens_over = check["tokens_over"]
                    records.append(turn_record)
                if progress is not None:
                    last = per_method[method.name][-1]
                    progress(f"[{dataset} {question.question_id}] {method.name}: {last.tokens_per_s:.1f} tok/s"
                             + (f", tau {last.tau:.2f}" if last.tau is not None and not math.isnan(last.tau) else "")
                             + ("" if last.identical is None else f", identical={last.identical}"))
            index += 1

    settings = {
        "max_new_tokens": max_new_tokens, "temperature": temperature, "greedy": greedy, "warmup": warmup,
        "seed": seed, "consistency_tolerance": tolerance if greedy and check_consistency else None,
        "memory": PeakMemory(device).kind if device.type == "cuda" else _memory_kind(),
        "use_chat_template": use_chat_template,
    }
    return BenchmarkRun(records, methods, settings)


def _memory_kind() -> str:
    probe = PeakMemory(torch.device("cpu"))
    with probe:
        pass
    return probe.kind


def _run_conversation(target, tokenizer, encode, question: Question, method: Method, max_new_tokens, sampling, seed,
                      use_chat_template) -> list[TurnRecord]:
    """All turns of one question with one method; later turns see this method's own earlier answers."""
    answers, records = [], []
    for turn in range(len(question.turns)):
        text = chat_prompt(tokenizer, question.turns, answers, use_chat_template)
        input_ids = encode(text)
        sequence, seconds, forwards, memory, stats = _generate(target, input_ids, method, max_new_tokens, sampling,
                                                               seed * 16 + turn)
        output = sequence[input_ids.shape[1]:].tolist()
        answer = tokenizer.decode(output, skip_special_tokens=True)
        answers.append(answer)
        record = TurnRecord(
            dataset=question.dataset, question_id=question.question_id, category=question.category, turn=turn,
            method=method.name, prompt_tokens=input_ids.shape[1], new_tokens=len(output), seconds=seconds,
            tokens_per_s=len(output) / seconds if seconds > 0 else math.nan, target_forwards=forwards,
            peak_memory_bytes=memory.value, prompt_text=text, answer=answer, output_ids=output,
        )
        if stats is not None:
            record.acceptance_lengths = list(stats.acceptance_lengths)
            record.tau = stats.mean_acceptance_length
            record.tau_source = "rounds"
            record.time_split = stats.time_split()
            record.lookup_tokens = stats.lookup_tokens
            draft_vocab = getattr(method.drafter, "draft_to_target", None)
            if draft_vocab is not None:
                record.in_draft_vocab = int(torch.isin(torch.tensor(output, dtype=torch.long), draft_vocab.cpu()).sum())
        elif method.kind != "baseline" and forwards > 1:
            # prefill gives the first token; each later target forward is one round producing a + 1 tokens
            record.tau = (len(output) - 1) / (forwards - 1)
            record.tau_source = "target_forwards"
        records.append(record)
    return records
