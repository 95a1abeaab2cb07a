"""Read the junit XML files of scripts/peer_suites.sh: per-test outcome lists, the ids to re-run, the summary table.

    python summarize.py outcomes RUN.xml RUN.outcomes.tsv    one line per test: outcome, test id, properties, message
    python summarize.py failed TESTS_DIR RUN.xml...          node ids (paths under TESTS_DIR) failed in any of the runs
    python summarize.py table OUT_DIR                        passed / failed / skipped per run, as a table and JSON
    python summarize.py classify OUT_DIR                     every failure's class from known_failures.tsv, per run

A test id is ``<file relative to the suite's root>::<name>``, the same in every mode, so the lists can be joined.
"""

from __future__ import annotations

import collections
import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def _cases(xml_path: Path):
    """(test id, outcome, properties, message) for every <testcase> of a junit file."""
    for case in ET.parse(xml_path).iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                message = (child.get("message") or child.text or "").strip().splitlines()[0:1]
                message = message[0][:300] if message else ""
                if child.tag == "skipped" and child.get("type") == "pytest.xfail":
                    outcome = "xfailed"
                break
        properties = {p.get("name"): p.get("value") for p in case.iter("property")}
        yield classname.replace(".", "/") + "::" + name, outcome, properties, message


def outcomes(xml_path: str, out_path: str) -> None:
    rows = sorted(_cases(Path(xml_path)))
    with open(out_path, "w") as out:
        out.write("# outcome\ttest id (module path::name)\tproperties\tfirst line of the message\n")
        for test_id, outcome, properties, message in rows:
            props = ",".join(f"{k}={v}" for k, v in sorted(properties.items()))
            out.write(f"{outcome}\t{test_id}\t{props}\t{message}\n")


def failed(tests_dir: str, *xml_paths: str) -> None:
    """Print the pytest node ids, as paths under ``tests_dir``, of the tests that failed or errored in any run."""
    root = Path(tests_dir).resolve()
    ids = set()
    for xml_path in xml_paths:
        if not Path(xml_path).is_file():
            continue
        for test_id, outcome, _, _ in _cases(Path(xml_path)):
            if outcome in ("failed", "error"):
                ids.add(test_id)
    for test_id in sorted(ids):
        dotted, name = test_id.split("::", 1)
        parts = dotted.split("/")
        if parts and parts[0] == root.name:
            parts = parts[1:]  # classname starts with the package (tests_pytorch)
        # the module is the longest prefix that is a file; what follows is a test class
        for cut in range(len(parts), 0, -1):
            module = root.joinpath(*parts[:cut]).with_suffix(".py")
            if module.is_file():
                print("::".join([str(module), *parts[cut:], name]))
                break


COLUMNS = (
    "run",
    "tests",
    "passed",
    "failed",
    "error",
    "skipped",
    "xfailed",
    "trained_under_zenflow",
    "leaked_workers",
    "unclosed_engines",
)
"""The summary table's columns: the counts of outcomes, then of the plugins' per-test properties."""


def _read_outcomes(outcomes_path: Path):
    for line in outcomes_path.read_text().splitlines()[1:]:
        yield line.split("\t", 3)


def _subsets(run: str, test_id: str) -> str:
    """The row a test counts in: a torch run's tests of ZenFlowAdamW and of torch.optim.AdamW are two rows."""
    if run.startswith("torch_"):
        return f"{run} ZenFlowAdamW" if "ZenFlowAdamW" in test_id else f"{run} AdamW (reference)"
    return run


def table(out_dir: str) -> None:
    rows: dict[str, dict] = {}
    for outcomes_path in sorted(Path(out_dir).glob("*.outcomes.tsv")):
        run = outcomes_path.name.removesuffix(".outcomes.tsv")
        for outcome, test_id, props, _ in _read_outcomes(outcomes_path):
            name = _subsets(run, test_id)
            row = rows.setdefault(name, {"run": name, **dict.fromkeys(COLUMNS[1:], 0)})
            row["tests"] += 1
            row[outcome] = row.get(outcome, 0) + 1
            row["trained_under_zenflow"] += "zenflow=1" in props
            row["leaked_workers"] += "leaked_workers=" in props
            row["unclosed_engines"] += "unclosed_engines=" in props
    rows = list(rows.values())
    Path(out_dir, "summary.json").write_text(json.dumps(rows, indent=2) + "\n")
    columns = COLUMNS
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) if rows else len(c) for c in columns]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(str(r[c]).ljust(w) for c, w in zip(columns, widths)) for r in rows]
    Path(out_dir, "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _rules():
    rows = []
    for line in (Path(__file__).parent / "known_failures.tsv").read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        klass, group, id_regex, message_regex, reason = line.split("\t")
        rows.append(
            (
                klass,
                group,
                re.compile(id_regex) if id_regex else None,
                re.compile(message_regex) if message_regex else None,
                reason,
            )
        )
    return rows


def classify(out_dir: str) -> None:
    """Each run's failures counted by class and group (known_failures.tsv); failures no row matches are listed: they
    are new, to be looked at. Writes OUT_DIR/classification.tsv (run, outcome, class, group, test id)."""
    rules = _rules()
    lines = ["# run\toutcome\tclass\tgroup\ttest id"]
    unmatched = []
    for outcomes_path in sorted(Path(out_dir).glob("*.outcomes.tsv")):
        run = outcomes_path.name.removesuffix(".outcomes.tsv")
        if run.startswith("recheck_"):
            continue
        counts: collections.Counter = collections.Counter()
        for outcome, test_id, _, message in _read_outcomes(outcomes_path):
            if outcome not in ("failed", "error"):
                continue
            match = next(
                (
                    (klass, group)
                    for klass, group, id_regex, message_regex, _ in rules
                    if (id_regex is None or id_regex.search(test_id))
                    and (message_regex is None or message_regex.search(message))
                ),
                ("?", "unclassified"),
            )
            counts[match] += 1
            lines.append(f"{run}\t{outcome}\t{match[0]}\t{match[1]}\t{test_id}")
            if match[0] == "?":
                unmatched.append(f"{run}\t{test_id}\t{message}")
        summary = ", ".join(f"{klass}:{group} {n}" for (klass, group), n in sorted(counts.items()))
        print(f"{run}: {sum(counts.values())} failed or errored; {summary or 'none'}")
    Path(out_dir, "classification.tsv").write_text("\n".join(lines) + "\n")
    if unmatched:
        print(f"\n{len(unmatched)} failures match no row of known_failures.tsv:")
        print("\n".join(unmatched))


if __name__ == "__main__":
    command, *arguments = sys.argv[1:]
    {"outcomes": outcomes, "failed": failed, "table": table, "classify": classify}[command](*arguments)
