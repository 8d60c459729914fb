"""How far a requirement's judge agrees with a labelled set the user supplies.

A requirement that needs judgment (a style norm) is judged by a model or a user's callable
behind a `tg_jax.envs.Requirement` (a plug-in, `tg_jax.envs.plugins`); before its verdicts
steer training, measure them against turns a person labelled:

    python -m tg_jax.evaluation.judge_agreement \\
      --requirement=my_rules:report_in_markdown --labels=labelled.jsonl [--env_kind=coding]

`labelled.jsonl` holds one object per line: {"text": "<assistant turn>", "label": true|false}
(true = the turn meets the requirement). The output (printed, and written as JSON with
`--out`) is the accuracy, the confusion table (judged x labelled), the false-positive and
false-negative rates with 95% Wilson intervals, and the turns the judge could not judge (a
checker that raised or timed out) or found not applicable; those are left out of the rates.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from tg_jax.envs.base import Requirement, Unjudged


def wilson(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson score interval of a proportion (0, 1 with n = 0)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def agreement(requirement: Requirement, labelled: Sequence[tuple[str, bool]]) -> dict[str, Any]:
    """The judge's agreement with `labelled` (turn text, met) pairs (module docstring)."""
    table = {
        "judged_met": {"labelled_met": 0, "labelled_failed": 0},
        "judged_failed": {"labelled_met": 0, "labelled_failed": 0},
    }
    unjudged = not_applicable = 0
    for text, label in labelled:
        try:
            verdict = requirement.verdict(text)
        except Unjudged:
            unjudged += 1
            continue
        if verdict is None:
            not_applicable += 1
            continue
        row = table["judged_met" if verdict else "judged_failed"]
        row["labelled_met" if label else "labelled_failed"] += 1
    tp, fp = table["judged_met"]["labelled_met"], table["judged_met"]["labelled_failed"]
    fn, tn = table["judged_failed"]["labelled_met"], table["judged_failed"]["labelled_failed"]
    n = tp + fp + fn + tn
    return {
        "requirement": requirement.name,
        "num_labelled": len(labelled),
        "num_judged": n,
        "unjudged": unjudged,
        "not_applicable": not_applicable,
        "accuracy": (tp + tn) / n if n else None,
        "accuracy_ci": wilson(tp + tn, n),
        "false_positive_rate": fp / (fp + tn) if fp + tn else None,  # of labelled failed
        "false_positive_ci": wilson(fp, fp + tn),
        "false_negative_rate": fn / (fn + tp) if fn + tp else None,  # of labelled met
        "false_negative_ci": wilson(fn, fn + tp),
        "confusion": table,
    }


def read_labels(path: str) -> list[tuple[str, bool]]:
    """(text, label) pairs of a labelled JSONL file; a bad line is a ValueError naming it."""
    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: invalid JSON: {e}") from e
            if (
                not isinstance(obj, dict)
                or not isinstance(obj.get("text"), str)
                or not isinstance(obj.get("label"), bool)
            ):
                raise ValueError(f'{path}:{i}: expected {{"text": str, "label": true|false}}')
            out.append((obj["text"], obj["label"]))
    return out


def _rate(value: float | None, ci: Sequence[float]) -> str:
    return "n/a" if value is None else f"{value:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]"


def format_agreement(result: dict[str, Any]) -> str:
    """The agreement as a few lines of text (the confusion table in Markdown)."""
    met, failed = result["confusion"]["judged_met"], result["confusion"]["judged_failed"]
    return "\n".join(
        [
            f"requirement {result['requirement']}: {result['num_judged']} of "
            f"{result['num_labelled']} labelled turns judged ({result['unjudged']} unjudged, "
            f"{result['not_applicable']} not applicable)",
            f"accuracy {_rate(result['accuracy'], result['accuracy_ci'])}; false positives "
            f"{_rate(result['false_positive_rate'], result['false_positive_ci'])} of labelled "
            "failed; false negatives "
            f"{_rate(result['false_negative_rate'], result['false_negative_ci'])} of labelled met "
            "(95% Wilson intervals)",
            "",
            "| judged \\ labelled | met | failed |",
            "|---|---|---|",
            f"| met | {met['labelled_met']} | {met['labelled_failed']} |",
            f"| failed | {failed['labelled_met']} | {failed['labelled_failed']} |",
        ]
    )


def _environment(kind: str, requirement: str) -> Any:
    """An environment of `kind` judging `requirement` alone."""
    if kind == "swe":
        from tg_jax.envs.swe.env import SweEnv, SweEnvConfig  # noqa: PLC0415

        return SweEnv(SweEnvConfig(requirements=(requirement,)))
    from tg_jax.envs.coding import CodingEnv, CodingEnvConfig  # noqa: PLC0415

    return CodingEnv(CodingEnvConfig(requirements=(requirement,), executor="trusted"))


def main(argv: Sequence[str] | None = None) -> int:
    import argparse  # noqa: PLC0415

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requirement", required=True, help="a built-in name or module:attr")
    parser.add_argument("--labels", required=True, help="JSONL of {text, label}")
    parser.add_argument(
        "--env_kind",
        default="coding",
        choices=("coding", "swe"),
        help="the environment it belongs to",
    )
    parser.add_argument("--out", default="", help="also write the result as JSON here")
    args = parser.parse_args(argv)
    try:
        (req,) = _environment(args.env_kind, args.requirement).requirements
        result = agreement(req, read_labels(args.labels))
    except (ValueError, OSError) as e:
        print(f"error: {e}")
        return 2
    print(format_agreement(result))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
