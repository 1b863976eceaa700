"""Acceptance statistics of speculative decoding as an `evaluate` metric.

Load with `evaluate.load(transformers_poss.evaluation.ACCEPTANCE_METRIC_PATH)`. It uses the one definition of the
metrics in `transformers_poss.metrics`.
"""

import datasets
import evaluate

from transformers_poss.metrics import mean_acceptance_length, position_acceptance

_DESCRIPTION = """\
Acceptance statistics of speculative decoding, from the accepted draft tokens of every drafting round.
A round drafts some tokens, the target verifies them and accepts `a` of them (its own bonus token not counted).

- mean_acceptance_length (tau): mean over rounds of `a + 1` (tokens produced per target forward).
- position_acceptance (alpha_1..alpha_depth): alpha_p = P(position p accepted | positions 1..p-1 accepted)
  = count(rounds with a >= p) / count(rounds with a >= p - 1); NaN where no round reached p - 1.

Rounds of all generations are pooled.
"""

_KWARGS_DESCRIPTION = """\
Args:
    acceptance_lengths (`list` of `list` of `int`): per generation, the accepted draft tokens of each round
        (e.g. `output.speculative_stats.acceptance_lengths` of a `generate(..., return_dict_in_generate=True)` call).
    depth (`int`, *optional*): draft positions per round (length of `position_acceptance`); defaults to the longest
        acceptance seen.
Returns:
    mean_acceptance_length (`float`), position_acceptance (`list` of `float`), rounds (`int`), generations (`int`).
Example:
    >>> metric = evaluate.load(ACCEPTANCE_METRIC_PATH)
    >>> result = metric.compute(acceptance_lengths=[[0, 2, 3], [1]], depth=3)
    >>> result["mean_acceptance_length"], result["position_acceptance"], result["rounds"]
    (2.5, [0.75, 0.6666666666666666, 0.5], 4)
"""

_CITATION = """\
@article{huang2025poss,
  title={PosS: Position Specialist Generates Better Draft for Speculative Decoding},
  author={Huang, Langlin and Wu, Chengsong and Wang, Huayu and others},
  journal={arXiv preprint arXiv:2506.03566},
  year={2025}
}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class AcceptanceMetric(evaluate.Metric):
    """tau and per-position acceptance from per-round acceptance lengths."""

    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"acceptance_lengths": datasets.Sequence(datasets.Value("int32"))}),
        )

    def _compute(self, acceptance_lengths, depth=None):
        pooled = [int(a) for generation in acceptance_lengths for a in generation]
        return {
            "mean_acceptance_length": mean_acceptance_length(pooled),
            "position_acceptance": position_acceptance(pooled, depth),
            "rounds": len(pooled),
            "generations": len(acceptance_lengths),
        }
