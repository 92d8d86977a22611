"""The docs cannot rot: README.md and docs/*.md are checked as a reader would use them. Every Python example's
imports resolve and every keyword it passes to rldiag is one its function takes; the read-side example runs for
real on a store that `rldiag demo` wrote; every `rldiag COMMAND` and `make TARGET` shown is a real subcommand
(with real options) or Makefile target; every relative link points at a file (and heading) that exists."""

from __future__ import annotations

import ast
import contextlib
import inspect
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "bench" / "README.md"]
TEXT = {p.relative_to(REPO).as_posix(): p.read_text(encoding="utf-8") for p in PAGES}
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```", re.S | re.M)
BLOCKS = [(name, body) for name, text in TEXT.items() for lang, body in FENCE.findall(text) if lang.strip() == "python"]
def imported(tree: ast.Module) -> dict[str, object]:
    """name -> the object each `from rldiag... import name` of the block gives."""
    import importlib

    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rldiag"):
            mod = importlib.import_module(node.module)
            for a in node.names:
                out[a.asname or a.name] = getattr(mod, a.name)  # AttributeError: a page names a missing API
        elif isinstance(node, ast.Import):
            for a in node.names:
                importlib.import_module(a.name)
    return out


def accepted(obj) -> set[str] | None:
    """Keyword names `obj` takes (None: any). Monitor and RldiagCallback forward RunSession's options."""
    from rldiag.collectors.session import RunSession

    params = inspect.signature(obj).parameters
    names = {n for n, p in params.items() if p.kind is not p.VAR_KEYWORD}
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        if getattr(obj, "__name__", "") in ("Monitor", "RldiagCallback"):
            return names | set(inspect.signature(RunSession).parameters)
        return None
    return names


def test_pages_have_python_examples():
    assert len(BLOCKS) >= 4  # the loop, the Trainer callback, vLLM, the read side
    assert sum(name == "README.md" for name, _ in BLOCKS) >= 2  # the loop and the Trainer callback


@pytest.mark.parametrize("n", range(len(BLOCKS)), ids=[f"{name}:{i}" for i, (name, _) in enumerate(BLOCKS)])
def test_every_import_resolves_and_every_keyword_exists(n):
    name, block = BLOCKS[n]
    tree = ast.parse(block)
    names = imported(tree)
    # `with Monitor(...) as mon:` makes mon a Monitor: check its method calls too
    instances = {item.optional_vars.id: names[item.context_expr.func.id]
                 for node in ast.walk(tree) if isinstance(node, ast.With) for item in node.items
                 if isinstance(item.context_expr, ast.Call) and isinstance(item.context_expr.func, ast.Name)
                 and item.context_expr.func.id in names and isinstance(item.optional_vars, ast.Name)}
    checked = 0
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id in names:
            target = names[f.id]
        elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in instances:
            target = getattr(instances[f.value.id], f.attr)  # AttributeError: a page calls a missing method
        elif (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Call) and isinstance(f.value.func, ast.Name)
              and f.value.func.id in names):
            target = getattr(names[f.value.func.id], f.attr)  # RldiagCallback(...).attach(trainer)
        else:
            continue
        ok = accepted(target)
        kws = {k.arg for k in node.keywords if k.arg}
        assert ok is None or kws <= ok, f"{name} calls {ast.unparse(f)} with {sorted(kws - ok)}, which it does not take"
        checked += 1
    assert checked, f"no call of an rldiag API checked in this block of {name}"


@pytest.mark.slow
def test_the_read_side_example_runs_on_a_demo_store(tmp_path):
    blocks = [(n, b) for n, b in BLOCKS if "from rldiag.app import" in b]  # the read side's, each run in turn
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    env.pop("MLFLOW_TRACKING_URI", None)
    for nan_at in (None, 6):  # two runs: a clean one (the reference) and one with a NaN gradient
        cmd = [sys.executable, "-m", "rldiag.app.cli.main", "demo", "--steps", "12"]
        if nan_at is not None:
            cmd += ["--nan-at", str(nan_at)]
        subprocess.run(cmd, cwd=tmp_path, env=env, check=True, capture_output=True, timeout=300)
    out = io.StringIO()
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with contextlib.redirect_stdout(out):
            for name, block in blocks:
                exec(compile(block, name, "exec"), {})
    finally:
        os.chdir(cwd)
    assert len(blocks) >= 2, [n for n, _ in blocks]
    assert "non-finite gradients at step 6" in out.getvalue()
    assert "False nonfinite defaults" in out.getvalue()  # docs/reports.md: the one comparison
    assert "<html" in (tmp_path / "rldiag-report.html").read_text().lower()


def commands(name: str, text: str) -> list[str]:
    """Every shell command line a page shows: fenced shell blocks (bash, sh, console, unlabeled), indented code
    blocks, and inline code that starts with `rldiag`, `make` or `python`. Continuation lines are joined."""
    lines = []
    for lang, body in FENCE.findall(text):
        if lang.strip() in ("", "bash", "sh", "shell", "console"):
            lines += body.replace("\\\n", " ").splitlines()
    prose = FENCE.sub("", text)
    lines += [m.group(1) for m in re.finditer(r"^ {4,}((?:\S+=\S+ )*(?:rldiag|make|python) .*)$", prose, re.M)]
    lines += re.findall(r"`((?:rldiag|make|python|python3) [^`]+)`", prose)
    return [line.strip().removeprefix("$ ") for line in lines if line.strip()]


def words(line: str) -> list[list[str]]:
    """The simple commands of one line (split at && || ; |), env assignments and sudo dropped."""
    try:
        toks = shlex.split(line, comments=True)
    except ValueError:
        toks = line.split("#")[0].split()
    out, cur = [], []
    for t in toks:
        if t in ("&&", "||", ";", "|"):
            out.append(cur)
            cur = []
        else:
            cur.append(t.rstrip(";"))
    out.append(cur)
    for c in out:
        while c and (re.match(r"^[A-Z_][A-Z0-9_]*=", c[0]) or c[0] == "sudo"):
            c.pop(0)
    return [c for c in out if c]


SHOWN = [(name, line, cmd) for name, text in TEXT.items() for line in commands(name, text) for cmd in words(line)]


def option_names(tokens: list[str]) -> list[str]:
    """`--port`, `-e` ... as shown, with `[`, `]`, `=VALUE` and `,` taken off."""
    out = []
    for t in tokens:
        t = t.strip("[],")
        if re.match(r"^--?[A-Za-z]", t):
            out.append(t.split("=")[0])
    return out


def make_targets() -> set[str]:
    text = (REPO / "Makefile").read_text()
    return {m.group(1) for m in re.finditer(r"^([A-Za-z0-9][A-Za-z0-9_.-]*)\s*:(?!=)", text, re.M)}


def test_pages_show_commands():
    shown = {cmd[0].rsplit("/", 1)[-1] for _, _, cmd in SHOWN}
    assert {"rldiag", "make", "python"} <= shown, shown
    assert "make demo" in TEXT["README.md"] and "make test" in TEXT["README.md"]


@pytest.mark.parametrize("name,line,cmd", [s for s in SHOWN if s[2][0].rsplit("/", 1)[-1] == "make"],
                         ids=lambda v: v if isinstance(v, str) and len(v) < 60 else None)
def test_every_make_target_shown_exists(name, line, cmd):
    targets = [t for t in cmd[1:] if not t.startswith("-") and "=" not in t]
    missing = set(targets) - make_targets()
    assert not missing, f"{name} shows `{line}`, but the Makefile has no target {sorted(missing)}"


def _subcommands(parser):
    return next((a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"), None)


@pytest.mark.parametrize("name,line,cmd", [s for s in SHOWN if s[2][0].rsplit("/", 1)[-1] == "rldiag"],
                         ids=lambda v: v if isinstance(v, str) and len(v) < 60 else None)
def test_every_rldiag_command_shown_exists(name, line, cmd):
    """Each word down the subcommand tree is a real (sub)command and every option shown is the last one's."""
    from rldiag.app.cli.main import build_parser

    args = cmd[1:]
    if "..." in args:  # `rldiag ... --tracking-uri`: any command
        return
    parser, rest, words = build_parser([a for a in args if not a.startswith("-")][:1]), args, ["rldiag"]
    while (subs := _subcommands(parser)) is not None:
        word = next((a for a in rest if not a.startswith("-")), None)
        if word is None or word.isupper():  # `rldiag --help`, `rldiag COMMAND --help`
            break
        assert word in subs.choices, (f"{name} shows `{line}`, but `{' '.join(words)} {word}` is no command "
                                      f"(there: {sorted(subs.choices)})")
        parser, rest = subs.choices[word], rest[rest.index(word) + 1:]
        words.append(word)
    parser.format_help()  # the options its --help lists (an experiment's load when asked: app/cli/experiment.py)
    bad = [o for o in option_names(rest) if o not in parser._option_string_actions]
    assert not bad, f"{name} shows `{line}`: `{' '.join(words)}` has no option {bad}"


PY_SHOWN = [s for s in SHOWN if re.fullmatch(r"python[0-9.]*", s[2][0].rsplit("/", 1)[-1])]


@pytest.mark.parametrize("name,line,cmd", PY_SHOWN, ids=lambda v: v if isinstance(v, str) and len(v) < 60 else None)
def test_every_python_command_shown_exists(name, line, cmd):
    """`python -m bench.X --opt` names a module that exists and options its parser takes; `python FILE` a file."""
    import importlib.util

    args = cmd[1:]
    if args[:1] == ["-c"]:
        compile(args[1], "<-c>", "exec")
        return
    if args[:1] == ["-m"]:
        mod = args[1]
        if "<" in mod:  # `python -m bench.<name>`
            return
        assert importlib.util.find_spec(mod) is not None, f"{name} shows `{line}`, but there is no module {mod}"
        if mod.startswith("bench.") and option_names(args[2:]):
            parser = _bench_parser(mod)
            bad = [o for o in option_names(args[2:]) if o not in parser._option_string_actions]
            assert not bad, f"{name} shows `{line}`: {mod} has no option {bad}"
        return
    assert (REPO / args[0]).is_file(), f"{name} shows `{line}`, but {args[0]} is not a file"


class _Parsed(Exception):
    pass


def _bench_parser(mod: str):
    """The argparse parser a bench module's `main(argv)` builds, caught before it parses anything."""
    import argparse
    import importlib

    module = importlib.import_module(mod)
    caught = []

    def catch(self, *a, **k):
        caught.append(self)
        raise _Parsed

    old = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = catch
    try:
        module.main([])
    except _Parsed:
        pass
    finally:
        argparse.ArgumentParser.parse_args = old
    assert caught, f"{mod}.main() builds no argparse parser"
    return caught[0]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


LINKS = [(name, target) for name, text in TEXT.items()
         for target in re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", FENCE.sub("", text))
         if not re.match(r"^[a-z][a-z0-9+.-]*:", target)]


@pytest.mark.parametrize("index", ["README.md", "docs/README.md"])
def test_the_indexes_link_to_every_page(index):
    linked = {(REPO / Path(index).parent / t.partition("#")[0]).resolve() for n, t in LINKS if n == index}
    missing = [p.relative_to(REPO).as_posix() for p in PAGES if p.resolve() not in linked and p != REPO / index]
    assert not missing, f"{index} does not link to {missing}"


@pytest.mark.parametrize("name,target", LINKS)
def test_every_relative_link_points_at_a_file(name, target):
    path, _, anchor = target.partition("#")
    dest = (REPO / Path(name).parent / path).resolve() if path else REPO / name
    assert dest.exists(), f"{name} links to {target}, which does not exist"
    if anchor and dest.suffix == ".md":
        slugs = {_slug(h) for h in re.findall(r"^#+ (.*)$", FENCE.sub("", dest.read_text(encoding="utf-8")), re.M)}
        assert anchor in slugs, f"{name} links to {target}, but {dest.name} has no heading with that anchor"


@pytest.mark.parametrize("name", list(TEXT))
def test_every_code_fence_is_closed(name):
    fences = re.findall(r"^```", TEXT[name], re.M)
    assert len(fences) % 2 == 0, f"{name} has an unclosed ``` code block ({len(fences)} fence lines)"


def test_readme_stays_a_front_door():
    size = len(TEXT["README.md"].encode())
    assert size < 20_000, f"README.md is {size} bytes: move the detail to a page of docs/ and link it (goal < 20 KB)"


def test_bench_table_lands_in_bench_readme(tmp_path):
    """`python -m bench.run_all` splices its table between bench/README.md's markers."""
    from tests.helpers.bench_code import splice_readme

    copy = tmp_path / "README.md"
    copy.write_text(TEXT["bench/README.md"])
    assert splice_readme(copy, "| new table |\n")
    assert "| new table |" in copy.read_text() and "<!-- /bench-table -->" in copy.read_text()


def test_metrics_page_defines_every_canonical_key():
    from rldiag.collectors.keys import CANONICAL_METRICS

    missing = [k for k in CANONICAL_METRICS if f"`{k}`" not in TEXT["docs/metrics.md"]]
    assert not missing, f"docs/metrics.md has no definition of {missing}: add a row to its canonical keys table"


def test_metrics_page_alias_table_is_the_code_s():
    from rldiag.app.data.aliases_sources import aliases_markdown

    table = aliases_markdown().split("\n\nNot found in source:")[0]
    assert table in TEXT["docs/metrics.md"], (
        "docs/metrics.md's alias table differs from rldiag.app.data.aliases_sources.aliases_markdown(): "
        "paste that function's output in its place")
