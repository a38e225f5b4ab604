"""Mutated records and the one property every one of them must keep, shared by the hypothesis
test (tests/test_record_fuzz.py, a few seconds in CI) and the long run by hand:

    python tests/_record_fuzz.py 2000 [SEED]          # every format for each case
    python tests/_record_fuzz.py 20000 SEED --rotate  # one format per case, cyclically

The prediction fields (``predictions.step_time``, each module's and collective's
``predicted_seconds``, as ``audit --gpu`` writes them) are fuzzed the same way, on scenario
records that carry them (:func:`with_predictions`), the mutations aimed at those fields:

    python tests/_record_fuzz.py 2000 SEED --predictions

A case takes a scenario record (tests/data/*/record.json), applies one to three mutations
(a value replaced by another type, NaN, Infinity, a huge int, a lone surrogate, deep nesting
or a formula-like string; a key dropped; a key added), and runs ``torchledger report`` in every
format and the ``--baseline`` load and comparison. Each must exit 0 with valid output (JSON and
SARIF parse as strict JSON, no NaN) or exit 2 with exactly one line on stderr.
"""
from __future__ import annotations

import glob
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SCENARIOS = sorted(glob.glob(os.path.join(HERE, "data", "*", "record.json")))
FORMATS = ("table", "json", "csv", "markdown", "sarif", "html")
SENTINEL = "@@FUZZ@@"

#: JSON texts put in place of a value (some of them json.dumps never writes).
LITERALS = [
    "NaN", "Infinity", "-Infinity", "1e400", "-1e400", "9" * 4000, "-" + "9" * 5000, str(2**63), str(-2**63 - 1),
    "-1", "0", "1", "1.5", "-0.5", "1e308", "true", "false", "null", '""', '"x"', '"\\ud800"', '"a\\udfffb"',
    '"=HYPERLINK(\\"http://x\\")"', '"+1"', '"-2"', '"@SUM(A1)"', '"\\tx"', '"\\rx"', '"a:0"', '"a:99999999999999"',
    '"   "', '":12"', '"./:3"', '"/dev/zero"', '"\\n\\n"', '"<script>"', "[]", "{}", "[1]", '["x"]', '{"a": 1}',
    "[" * 1100 + "]" * 1100, "[" * 40 + "]" * 40, '{"a":' * 40 + "1" + "}" * 40, '"' + "y" * 5000 + '"',
    '[null]', '[{}]', '{"available": true}', '{"\\ud800": 1}',
]
MUTATIONS = ("replace", "drop", "add")


def load(path: str) -> dict:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def paths(d, prefix=()) -> list:
    """Every value's path in ``d`` (objects by key, lists by index), the root excluded."""
    out = []
    items = d.items() if isinstance(d, dict) else enumerate(d) if isinstance(d, list) else ()
    for k, v in items:
        out.append(prefix + (k,))
        out += paths(v, prefix + (k,))
    return out


def _parent(d, path):
    for p in path[:-1]:
        d = d[p]
    return d


def mutate(record: dict, steps, under=None) -> str:
    """The record's JSON text after ``steps``: (kind, pick, literal) with pick a number that
    chooses the path (among those below one of the prefixes ``under``, when given); literals
    are substituted as raw text."""
    import copy
    d = copy.deepcopy(record)
    literals = []
    for kind, pick, literal in steps:
        all_paths = [p for p in paths(d) if under is None or any(p[:len(u)] == u and p != u for u in under)]
        if not all_paths:
            break
        path = all_paths[pick % len(all_paths)]
        parent = _parent(d, path)
        if kind == "drop":
            del parent[path[-1]]
        elif kind == "add":
            target = parent[path[-1]]
            if isinstance(target, dict):
                target[f"fuzz{len(literals)}"] = f"{SENTINEL}{len(literals)}"
            elif isinstance(target, list):
                target.append(f"{SENTINEL}{len(literals)}")
            else:
                parent[path[-1]] = f"{SENTINEL}{len(literals)}"
            literals.append(literal)
        else:
            parent[path[-1]] = f"{SENTINEL}{len(literals)}"
            literals.append(literal)
    text = json.dumps(d)
    for i, lit in enumerate(literals):
        text = text.replace(f'"{SENTINEL}{i}"', lit, 1)
    return text


#: ``predictions.step_time`` as ``audit --gpu`` on a timed device writes it
#: (analyzers/steptime.py): every field the schema knows, set.
STEP_TIME = {
    "gpu": "H100 SXM", "seconds": 0.00263, "micro_batches": 1, "tokens_per_s_per_gpu": 97338.4,
    "mfu": 0.00128, "hfu": 0.00131, "measured_seconds": 0.0021, "predicted_over_measured": 1.252,
    "by_phase": {"forward": 0.000165, "backward": 0.000305, "recompute": 0.0, "optimizer": 0.00216},
    "by_kind": {"matmul": 0.000155, "attention": 2e-05, "memory_bound": 1.0e-05, "launch": 0.00244,
                "comm_exposed": 0.0, "bubble": 0.0},
    "comm_seconds": 0.0, "comm_exposed_seconds": 0.0, "bubble_seconds": 0.0, "matmul_fraction_of_peak": 0.0194,
    "compiled": False, "fusable_seconds": 0.00231,
    "assumptions": ["H100 SXM: dense fp32 peak 67.0 TFLOP/s", "eager: every elementwise op its own kernel"],
    "bound": "93% launch overhead, 6% matmul at 2% of peak, 1% attention",
}
#: Where the prediction fields are: the mutations of ``--predictions`` are aimed below these.
PREDICTION_PATHS = (("predictions", "step_time"), ("predictions", "comparisons"))
#: Values a prediction field may hold that the schema accepts, and some it does not.
PREDICTION_LITERALS = ["null", "0", "0.0", "-0.0", "5e-324", "1e-300", "1e308", "1.7976931348623157e308",
                       str(2**63 - 1), "1", "-1", "NaN", "Infinity", '"x"', '""', "true", "[]", "{}", '["x"]',
                       '{"a": 1}', '{"a": null}', "[null]"]


def with_predictions(record: dict) -> dict:
    """``record`` with :data:`STEP_TIME` and a ``predicted_seconds`` on each module and
    collective (a copy)."""
    import copy
    d = copy.deepcopy(record)
    d.setdefault("predictions", {})["step_time"] = copy.deepcopy(STEP_TIME)
    for i, row in enumerate(d.get("modules") or []):
        row["predicted_seconds"] = 1e-4 * (i + 1)
    for row in d.get("collectives") or []:
        row.update(predicted_seconds=2e-5, predicted_algorithm="ring")
    return d


def prediction_paths(record: dict) -> tuple:
    """:data:`PREDICTION_PATHS` and each module's and collective's ``predicted_seconds``."""
    rows = [(key, i, "predicted_seconds") for key in ("modules", "collectives")
            for i, row in enumerate(record.get(key) or []) if "predicted_seconds" in row]
    return PREDICTION_PATHS + tuple(rows)


def _strict(text: str):
    def no_constant(name):
        raise ValueError(f"{name} in output")
    return json.loads(text, parse_constant=no_constant)


def check_case(text: str, tmpdir: str, formats=FORMATS) -> list:
    """Problems (strings) with this record in ``formats`` and the baseline path; [] if none."""
    from click.testing import CliRunner
    from torchledger.cli import cli
    path = os.path.join(tmpdir, "r.json")
    with open(path, "w", encoding="utf-8", errors="surrogatepass") as fh:
        fh.write(text)
    problems = []
    runner = CliRunner()
    for fmt in formats:
        r = runner.invoke(cli, ["report", path, "--format", fmt])
        problems += _judge(r, fmt)
    problems += _baseline(path)
    return problems


def _judge(r, what: str) -> list:
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        import traceback
        tb = traceback.extract_tb(r.exc_info[2])[-1]
        return [f"{what}: {type(r.exception).__name__} at {os.path.basename(tb.filename)}:{tb.lineno} "
                f"({tb.name})"]
    if r.exit_code == 2:
        lines = r.stderr.strip().splitlines()
        return [] if len(lines) == 1 and r.stdout == "" else [f"{what}: exit 2 with {len(lines)} lines"]
    if r.exit_code != 0:
        return [f"{what}: exit {r.exit_code}"]
    out = r.stdout
    try:
        out.encode("utf-8")
        if what in ("json", "sarif"):
            log = _strict(out)
            if what == "sarif":
                _check_sarif(log)
        if what == "csv":
            _check_csv(out)
    except (ValueError, KeyError, IndexError, TypeError) as e:
        return [f"{what}: invalid output ({type(e).__name__}: {str(e)[:80]})"]
    except Exception as e:                              # noqa: BLE001 - csv.Error
        return [f"{what}: invalid output ({type(e).__name__}: {str(e)[:80]})"]
    return [] if out.strip() else [f"{what}: empty output"]


def _check_sarif(log: dict) -> None:
    for res in log["runs"][0]["results"]:
        for loc in res["locations"]:
            phys = loc["physicalLocation"]
            line = phys["region"]["startLine"]
            if not (type(line) is int and 1 <= line < 2**31) or not phys["artifactLocation"]["uri"]:
                raise ValueError(f"bad SARIF location {str(phys)[:60]}")


def _check_csv(text: str) -> None:
    import csv
    import io
    for row in csv.reader(io.StringIO(text)):         # csv.Error on a malformed file
        for cell in row:
            if cell[:1] in ("=", "+", "@", "\t", "\r") or (cell[:1] == "-" and not _number(cell)):
                raise ValueError(f"CSV cell starts like a formula: {cell[:30]!r}")


def _number(cell: str) -> bool:
    try:
        float(cell)
        return True
    except ValueError:
        return False


_GOOD = None


def _baseline(path: str) -> list:
    """What ``audit --baseline path`` does with it: load (one line, exit 2) or compare and render."""
    import click
    from torchledger.cli.audit import BASELINE_TOTALS, load_record
    from torchledger.cli.types import InputError
    from torchledger.record import StepRecord
    from torchledger.render import render
    from torchledger.settings import compare_baseline
    global _GOOD
    if _GOOD is None:
        _GOOD = load(os.path.join(HERE, "data", "cruncher-copy", "record.json"))
    try:
        base = load_record(path, f"--baseline {path}", BASELINE_TOTALS)
    except (InputError, click.ClickException) as e:
        msg = e.format_message()
        return [] if len(msg.strip().splitlines()) == 1 else ["baseline: refusal of several lines"]
    except Exception as e:                              # noqa: BLE001 - what the fuzz looks for
        return [f"baseline load: {type(e).__name__}: {str(e)[:80]}"]
    try:
        from torchledger.analyzers.steptime import compare_step_time
        now = StepRecord.from_dict(with_predictions(_GOOD))
        findings, rows = compare_baseline(now, base, 0.01)
        findings += compare_step_time(now, base, 0.01)      # audit --gpu --baseline
        now.meta["baseline_diff"] = rows
        for fmt in ("json", "sarif", "table"):
            text = render(now, findings, fmt)
            if fmt != "table":
                _strict(text)
    except Exception as e:                              # noqa: BLE001
        import traceback
        tb = traceback.extract_tb(e.__traceback__)[-1]
        return [f"baseline: {type(e).__name__} at {os.path.basename(tb.filename)}:{tb.lineno}"]
    return []


def main(n: int, seed: int = 0, rotate: bool = False, predictions: bool = False) -> int:
    """``n`` cases from ``seed``; ``rotate``: case i runs one format (the i-th, cyclically)
    and the baseline path, for a long run in less time (CSV through pandas costs the most);
    ``predictions``: records with predictions, the mutations aimed at their fields."""
    import collections
    import random
    rng = random.Random(seed)
    records = [load(p) for p in SCENARIOS]
    if predictions:
        records = [with_predictions(r) for r in records]
    literals = PREDICTION_LITERALS + LITERALS if predictions else LITERALS
    places, failed = collections.Counter(), 0
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(n):
            rec = rng.choice(records)
            steps = [(rng.choice(MUTATIONS), rng.randrange(1 << 30), rng.choice(literals))
                     for _ in range(rng.randint(1, 3))]
            formats = (FORMATS[i % len(FORMATS)],) if rotate else FORMATS
            under = prediction_paths(rec) if predictions else None
            problems = check_case(mutate(rec, steps, under), tmp, formats)
            if problems:
                failed += 1
                places.update(problems)
            if (i + 1) % 1000 == 0:
                print(f"{i + 1} cases, {failed} with problems", file=sys.stderr, flush=True)
    each = f"{n // len(FORMATS):,}+ per format" if rotate else "every format"
    print(f"cases run: {n:,} ({each}, and --baseline for each); cases with a problem: {failed}; "
          f"tracebacks and bad outputs by place:")
    for place, count in places.most_common():
        print(f"  {count:6d}  {place}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(HERE))
    args = [a for a in sys.argv[1:] if a not in ("--rotate", "--predictions")]
    sys.exit(main(int(args[0]) if args else 2000, int(args[1]) if len(args) > 1 else 0,
                  rotate="--rotate" in sys.argv, predictions="--predictions" in sys.argv))
