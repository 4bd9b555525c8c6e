"""Every code block in README.md, docs/*.md and examples/*/README.md is checked as a user would
copy it, extracted from the markdown so the page and the check cannot drift.

A block's info string names what it is; its first word decides the check:

- `python`: compiled, then executed in a fresh namespace (imports and definitions must work).
- `toml`: parsed; a whole config is loaded with dora's config loader.
- `sh` (or `bash`, `shell`): each `dora ...` command parses with `dora.cli.build_parser` (a
  benchmark's flags must be ones its module defines), its config file's `key=value` settings load,
  `python -m MODULE` names a module that exists, and every repository path it names exists.
- `text`: output, diagrams, formulas, directory trees: not something to run; not checked.

`fragment` after the language (```python fragment, ```toml fragment, ```sh fragment) marks a
piece of a larger whole (a signature listing, a snippet that needs a model path or a cluster):
python fragments are still compiled, toml fragments still parsed, sh fragments not checked. A
block without an info string fails: each block says what it is.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from dora.cli import BENCHES, build_parser
from dora.config import load_config

ROOT = Path(__file__).resolve().parents[2]
PAGES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "examples").glob("*/README.md")),
]
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
SHELLS = {"sh", "bash", "shell"}
KINDS = {"python", "toml", "text", *SHELLS}
CONFIG_COMMANDS = {"run", "serve", "learn"}
TOP_LEVEL = {p.name for p in ROOT.iterdir() if not p.name.startswith(".")}
EXTRAS = {  # modules of the optional extras (pyproject.toml) that a page's example may import
    "openai": "openai",
    "openenv": "openenv",
    "reasoning_gym": "reasoning-gym",
    "tau2": "tau2",
    "trl": "trl",
    "verifiers": "verifiers",
}
FILE = re.compile(r"^[\w.-][\w./-]*\.(toml|py|sh|json|md|yaml|png)$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    kind: str
    fragment: bool
    code: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks_of(page: Path, text: str) -> list[Block]:
    out = []
    for m in FENCE.finditer(text):
        words = m.group(1).split()
        out.append(
            Block(
                page=page,
                line=text.count("\n", 0, m.start()) + 1,
                kind=words[0] if words else "",
                fragment="fragment" in words[1:],
                code=m.group(2),
            )
        )
    return out


ALL = [b for page in PAGES for b in blocks_of(page, page.read_text())]


def check_block(block: Block, tmp_path: Path) -> None:
    """Raises AssertionError (or the block's own error) where the block does not hold."""
    assert block.kind in KINDS, (
        f"{block.where}: a code block needs an info string, one of {sorted(KINDS)}"
    )
    if block.kind == "python":
        code = compile(block.code, block.where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        if not block.fragment:
            try:
                exec(code, {"__name__": "doc_block"})
            except Exception as exc:
                top = missing_extra(exc)
                if top is None:
                    raise
                # CI installs every extra, so there the block runs
                pytest.skip(
                    f"{block.where} needs the {EXTRAS[top]!r} extra ({top} is not installed)"
                )
    elif block.kind == "toml":
        tomllib.loads(block.code)
        if not block.fragment:
            path = tmp_path / "config.toml"
            path.write_text(block.code)
            load_config(path)
    elif block.kind in SHELLS and not block.fragment:
        for words in shell_commands(block.code):
            check_command(words, block)


def missing_extra(exc: BaseException | None) -> str | None:
    """The extra's module whose absence raised `exc` (directly, or as the cause of the clear error
    that dora raises for it), or None."""
    while exc is not None:
        if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] in EXTRAS:
            return (exc.name or "").split(".")[0]
        exc = exc.__cause__
    return None


def shell_commands(code: str) -> list[list[str]]:
    """The block's commands as words: lines joined at a trailing backslash (and while a quote is
    open), comments and leading `VAR=value` assignments dropped."""
    commands: list[list[str]] = []
    pending = ""
    for line in code.splitlines():
        pending += line[:-1] + " " if line.endswith("\\") else line + "\n"
        if line.endswith("\\"):
            continue
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # a quote spans lines
            continue
        pending = ""
        while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
            words = words[1:]
        if words:
            commands.append(words)
    assert not pending.strip(), f"unbalanced quotes in {code!r}"
    return commands


def check_command(words: list[str], block: Block) -> None:
    for word in words:
        check_path(word, block)
    program = Path(words[0]).name
    if program == "dora":
        check_dora(words[1:], block)
    elif program.startswith("python") and words[1:2] == ["-m"]:
        module = words[2]
        assert importlib.util.find_spec(module) is not None, f"{block.where}: no module {module}"


def check_path(word: str, block: Block) -> None:
    """A path into the repository (its first part a top-level entry) must exist; in an example's
    README, so must a file named relative to that folder."""
    if not FILE.match(word) or "<" in word:
        return
    first = word.split("/")[0]
    if first in TOP_LEVEL and first != word:
        assert (ROOT / word).exists(), f"{block.where}: {word} does not exist"
    elif block.page.parent != ROOT and block.page.parent.parent.name == "examples":
        assert (block.page.parent / word).exists(), f"{block.where}: {word} does not exist"


def check_dora(args: list[str], block: Block) -> None:
    try:
        ns = build_parser().parse_args(args)
    except SystemExit as exc:
        raise AssertionError(f"{block.where}: `dora {' '.join(args)}` does not parse") from exc
    command = getattr(ns, "command", None) or args[0]
    if command == "bench":
        module = BENCHES[ns.which][0]
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.origin is not None
        source = Path(spec.origin).read_text()
        for flag in (a.split("=")[0] for a in ns.args if a.startswith("--")):
            assert f'"{flag}"' in source, f"{block.where}: `dora bench {ns.which}` has no {flag}"
    elif command in CONFIG_COMMANDS or (command == "config" and args[1:2] == ["show"]):
        config = Path(ns.config)
        base = ROOT if config.parts[0] in TOP_LEVEL else block.page.parent
        if (base / config).exists():
            overrides = [o for o in ns.overrides if "$" not in o]
            load_config(base / config, overrides)


@pytest.mark.parametrize("block", ALL, ids=[b.where for b in ALL])
def test_doc_block(block: Block, tmp_path: Path) -> None:
    check_block(block, tmp_path)


BROKEN = [
    "```python\nfrom dora import Env, NoSuchName\n```\n",
    "```python\ndef f(:\n```\n",
    "```toml\n[learn]\nlr = -1\n```\n",
    "```toml\n[learn\n```\n",
    "```sh\ndora rnu examples/math/config.toml\n```\n",
    "```sh\ndora run examples/math/config.toml learn.lr=fast\n```\n",
    "```sh\ndora run examples/math/nothing.toml\n```\n",
    "```sh\ndora bench engine --no-such-flag\n```\n",
    "```sh\npython -m dora.no_such_module\n```\n",
    "```\ndora run examples/math/config.toml\n```\n",
]


@pytest.mark.parametrize("text", BROKEN)
def test_a_broken_block_fails(text: str, tmp_path: Path) -> None:
    """The check is not a formality: each of these, pasted into a page, fails it."""
    (block,) = blocks_of(ROOT / "docs" / "page.md", text)
    # each kind fails in its own way: an ImportError, a SyntaxError, a ConfigError, an assertion
    with pytest.raises(Exception):  # noqa: B017
        check_block(block, tmp_path)


def test_every_page_has_its_blocks_found() -> None:
    """The fence pattern sees the blocks: a page's fences pair up into the blocks found."""
    for page in PAGES:
        text = page.read_text()
        fences = len(re.findall(r"^```", text, re.MULTILINE))
        assert fences == 2 * len(blocks_of(page, text)), page


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_to_a_heading_find_it() -> None:
    """A link `page.md#anchor` between these pages names a heading that page has."""
    broken = []
    for page in PAGES:
        for target, anchor in re.findall(r"\]\(([\w./-]*\.md)#([\w-]+)\)", page.read_text()):
            linked = (page.parent / target).resolve()
            text = re.sub(r"^```.*?^```", "", linked.read_text(), flags=re.MULTILINE | re.DOTALL)
            headings = {slug(h) for h in re.findall(r"^#+ (.*)$", text, re.MULTILINE)}
            if anchor not in headings:
                broken.append(f"{page.relative_to(ROOT)} -> {target}#{anchor}")
    assert not broken, broken


SHOWN = re.compile(r"^<!-- file: (\S+) -->\n```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)


def test_a_block_that_shows_a_file_is_that_file() -> None:
    shown = [(page, *m) for page in PAGES for m in SHOWN.findall(page.read_text())]
    assert shown, "examples/guess's files are shown in docs/environments.md"
    for page, path, code in shown:
        assert code == (ROOT / path).read_text(), f"{page.relative_to(ROOT)} shows {path} changed"
