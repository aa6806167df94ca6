"""Every number the README quotes as a result is in a committed result file (``benchmarks/results/*.txt``).

What is checked:

1. every number in the rows of the README's ``## Numbers`` table (inline code such as a file name excluded);
2. every number elsewhere in the README, outside code blocks and inline code, that carries a unit of
   measurement: ``×``, ``x``, ``%``, ``s``, ``ms``, ``MiB`` or ``samples/s`` (versions, option values and
   step numbers carry none);
3. every line of a ```` ```text ```` block (an excerpt of a command's output) appears verbatim in one file.

A number "appears" in a file when it stands there as a number of its own (``1.36`` matches ``1.36x``,
not ``11.36`` or ``1.365``). Files are those git tracks, so a result must be committed to count.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

from tests.helpers import REPO

NUMBER = r"(?<![\w.])\d+(?:\.\d+)?(?![\w.]*\d)"
WITH_UNIT = re.compile(r"(?<![\w.\-])(\d+(?:\.\d+)?)\s?(?:×|x\b|%|ms\b|s\b|MiB\b|samples/s\b)")


def _results() -> dict[str, str]:
    listed = subprocess.run(["git", "ls-files", "benchmarks/results"], cwd=REPO, capture_output=True, text=True)
    names = [n for n in listed.stdout.split() if n.endswith(".txt")] if listed.returncode == 0 else []
    return {name: (REPO / name).read_text() for name in names}


def _blocks(readme: str) -> tuple[str, list[str]]:
    """The README's prose (code blocks removed) and the bodies of its ```text blocks."""
    prose, texts, inside, lang, body = [], [], False, "", []
    for line in readme.splitlines():
        if line.startswith("```"):
            if inside and lang == "text":
                texts.append("\n".join(body))
            inside, lang, body = not inside, line[3:].strip(), []
            continue
        (body if inside else prose).append(line)
    return "\n".join(prose), texts


def _no_inline_code(text: str) -> str:
    return re.sub(r"`[^`]*`", " ", text)


def _appears(number: str, results: dict[str, str]) -> bool:
    pattern = re.compile(r"(?<![\d.])" + re.escape(number) + r"(?!\d|\.\d)")
    return any(pattern.search(text) for text in results.values())


def _numbers_table(prose: str) -> list[str]:
    section = prose.split("\n## Numbers\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|") and not set(line) <= set("|-: ")]
    return rows[1:]  # the header row names columns


def test_every_readme_number_is_in_a_committed_result():
    readme = (REPO / "README.md").read_text()
    results = _results()
    assert results, "no committed benchmarks/results/*.txt"
    prose, texts = _blocks(readme)
    rows = _numbers_table(prose)
    in_table = [(n, row) for row in rows for n in re.findall(NUMBER, _no_inline_code(row))]
    assert len(in_table) >= 5, f"the numbers table yields too few numbers to check: {rows}"
    with_unit = [(m[1], line) for line in _no_inline_code(prose).splitlines() for m in WITH_UNIT.finditer(line)]
    missing = [(n, where) for n, where in in_table + with_unit if not _appears(n, results)]
    assert not missing, "README numbers found in no committed benchmarks/results file:\n" + "\n".join(
        f"  {n}  in: {where.strip()[:120]}" for n, where in missing)
    for block in texts:
        for line in filter(str.strip, block.splitlines()):
            assert any(line in text.splitlines() for text in results.values()), f"output line not in any result: {line!r}"


def test_the_checker_finds_what_it_must():
    """The extraction itself: a made-up number in the table, or with a unit in prose, is caught."""
    results = {"x.txt": "throughput: 1.36x (paper: 3.7x)\nrecovery 0.85 s\n"}
    assert _appears("1.36", results) and _appears("3.7", results) and _appears("0.85", results)
    assert not _appears("1.3", results) and not _appears("36", results) and not _appears("0.8", results)
    prose, texts = _blocks("a\n```text\nrecovery 0.85 s\n```\n## Numbers\n\n| what | result |\n|---|---|\n"
                           "| `demo.txt` run | 2.61× |\n\n## Next\nrecovered in 9.5 s, Python 3.10\n")
    assert texts == ["recovery 0.85 s"]
    assert [re.findall(NUMBER, _no_inline_code(r)) for r in _numbers_table(prose)] == [["2.61"]]
    assert [m[1] for m in WITH_UNIT.finditer(prose)] == ["2.61", "9.5"]


def _listed(*flags: str) -> dict[str, str]:
    """What ``rerecord.py FLAGS --list`` would run: each result's name and its command, or ``not here (...)``."""
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "rerecord.py"), *flags, "--list"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return dict(line.split(": ", 1) for line in proc.stdout.splitlines() if ": " in line and " " not in line.split(": ")[0])


def test_make_bench_can_record_every_result_the_readme_cites_again():
    listed = _listed("--readme")
    assert "memory" in listed and "sim_ettr" in listed  # the table's files are found
    cannot = [n for n, what in listed.items() if what.startswith("not here")]
    assert not cannot, f"README results whose recorded command cannot run here as written: {cannot}"
    memory = shlex.split(listed["memory"])
    assert memory[0] == sys.executable and "--reports" not in memory  # this interpreter; measured again, not read


def test_make_bench_runs_every_result_that_fits_this_machine():
    """``make bench`` (``rerecord.py --all``) takes every result file; only those written for another machine are left
    out, listed and not failing the call, while a result named on the command line that cannot run here fails it."""
    listed = _listed("--all")
    assert sorted(listed) == sorted(p.stem for p in (REPO / "benchmarks" / "results").glob("*.txt"))
    left_out = [n for n, what in listed.items() if what.startswith("not here")]
    assert "gpu" in left_out and "sim_ettr" not in left_out  # a GPU machine's result is not run here
    firsts = [shlex.split(what)[0] for n, what in listed.items() if n not in left_out]
    interpreters = [f for f in firsts if re.fullmatch(r"(?:\S*/)?python3?", f)]
    assert interpreters and set(interpreters) == {sys.executable}  # a recorded interpreter becomes this one
    # named, it must run here: it cannot, so the call fails (having run nothing)
    refused = subprocess.run([sys.executable, str(REPO / "benchmarks" / "rerecord.py"), "gpu"],
                             cwd=REPO, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "gpu: not here" in refused.stdout and "not run here (1): gpu" in refused.stdout
