"""The documentation stays true to the repository: links resolve inside it, and docs/architecture.md
names modules that exist and, for each concept, names that those modules define."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [
    REPO / "README.md",
    REPO / "BENCHMARKS.md",
    *sorted(REPO.glob("docs/*.md")),
    *sorted(REPO.glob("*/README.md")),
    REPO / "models/demo/README.md",
]
ARCHITECTURE = REPO / "docs/architecture.md"
# setup.py's packaging rule: the top-level folders besides src/ installed into the specinfer namespace
# (kernels/, services/<name>/); run_path reads the rule without running setup()
PACKAGE_DIRS = {
    name: folder
    for name, folder in runpy.run_path(str(REPO / "setup.py"))["package_dirs"](REPO).items()
    if name != "specinfer"
}
LINK = re.compile(r"\]\(([^)\s]+)\)")
MODULE = re.compile(r"`(specinfer(?:\.\w+)+)")
IDENTIFIER = re.compile(r"`([A-Za-z_]\w*)`")


def module_path(name: str) -> Path | None:
    """The file or package folder of module ``name``, or None."""
    for prefix, folder in PACKAGE_DIRS.items():
        if name == prefix or name.startswith(prefix + "."):
            rel = Path(folder, *name[len(prefix) + 1 :].split(".")) if name != prefix else Path(folder)
            break
    else:
        rel = Path("src", *name.split("."))
    for candidate in (REPO / rel.with_suffix(".py"), REPO / rel / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def longest_module(dotted: str) -> tuple[str, str]:
    """Split ``specinfer.a.b.Name`` into the longest existing module and the rest."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        if module_path(".".join(parts[:cut])) is not None:
            return ".".join(parts[:cut]), ".".join(parts[cut:])
    return dotted, ""


def module_sources(name: str) -> str:
    path = module_path(name)
    files = sorted(path.parent.glob("*.py")) if path.name == "__init__.py" else [path]
    return "\n".join(f.read_text() for f in files) + "\n" + "\n".join(f"def {f.stem}" for f in files)


@pytest.mark.parametrize("doc", [d for d in DOCS if d.is_file()], ids=lambda d: str(d.relative_to(REPO)))
def test_relative_links_resolve_inside_the_repository(doc):
    for target in LINK.findall(doc.read_text()):
        if re.match(r"^[a-z]+://|^#|^mailto:", target):
            continue
        path = (doc.parent / target.split("#")[0]).resolve()
        assert path.exists(), f"{doc.name}: link {target!r} resolves to nothing"
        assert REPO in path.parents or path == REPO, f"{doc.name}: link {target!r} points outside the repository"


def test_no_doc_points_outside_the_repository():
    # the development machines' files that docs once named: a clone has none of them (the inflation tool is
    # bench/inflate_llm.py)
    outside = ("shared/DESIGN.md", "/work/shared", "shared/tools/")
    for doc in DOCS:
        if doc.is_file():
            text = doc.read_text()
            for path in outside:
                assert path not in text, f"{doc.name} names {path}, which a clone does not have"


def test_architecture_names_existing_modules_and_their_definitions():
    text = ARCHITECTURE.read_text()
    named = set(MODULE.findall(text))
    assert len(named) > 30
    for dotted in sorted(named):
        module, rest = longest_module(dotted)
        assert module_path(module) is not None, f"docs/architecture.md names {dotted}, which does not exist"
        if rest:
            assert re.search(rf"\b{re.escape(rest.split('.')[0])}\b", module_sources(module)), (
                f"{module} defines no {rest}"
            )
    rows = [
        line for line in text.splitlines() if line.startswith("| ") and "`specinfer." in line and line.count("|") == 4
    ]
    assert len(rows) > 25
    for row in rows:
        _, modules, names = row.strip().strip("|").split("|")  # concept | module(s) | what to look for
        sources = "\n".join(module_sources(longest_module(m)[0]) for m in MODULE.findall(modules))
        for name in IDENTIFIER.findall(names):
            assert re.search(rf"(def|class) {name}\b|^{name}\b|\b{name} =", sources, re.M), (
                f"{name} is not defined in {modules.strip()}"
            )


def package_modules() -> list[str]:
    """Every module of the installed ``specinfer`` namespace (generated protobuf code left out)."""
    roots = {"specinfer": "src/specinfer", **PACKAGE_DIRS}
    out = set()
    for prefix, folder in roots.items():
        for path in (REPO / folder).rglob("*.py"):
            parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join([prefix, *parts])
            if name == "specinfer":  # the namespace's root: README.md and this page describe it
                continue
            if prefix == "specinfer" and (parts[:1] == ["v1"] or any(name.startswith(p) for p in PACKAGE_DIRS)):
                continue
            out.add(name)
    return sorted(out)


def test_architecture_names_every_module_in_a_row():
    """A module is in a row when the row names it, a module inside it, or its package with the
    module's own name in backticks (``specinfer.serving`` ... `config`)."""
    rows = [line for line in ARCHITECTURE.read_text().splitlines() if line.startswith("| ") and "`specinfer." in line]
    unnamed = []
    for module in package_modules():
        package, leaf = module.rsplit(".", 1)
        for row in rows:
            named = MODULE.findall(row)
            if any(n == module or n.startswith(module + ".") for n in named) or (
                package in named and f"`{leaf}`" in row
            ):
                break
        else:
            unnamed.append(module)
    assert not unnamed, f"docs/architecture.md: no row of its tables names {unnamed}"


def readme_commands() -> list[list[str]]:
    """Each ``specinfer SUBCOMMAND ...`` command (at the start of a line or after ``;``, ``&&``, ``|``,
    past ``VAR=value`` settings) of the README's shell blocks, as words (continued lines joined,
    comments and the usage notation's brackets dropped)."""
    import shlex

    blocks, fence = [], None  # fence: the language of the open block
    for line in (REPO / "README.md").read_text().splitlines():
        if line.startswith("```"):
            fence = line[3:].strip() if fence is None else None
            if fence in ("bash", "sh", "shell"):
                blocks.append("")
        elif fence in ("bash", "sh", "shell"):
            blocks[-1] += line + "\n"
    out = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            for command in re.findall(r"(?:^|[;&|(]\s*)(?:[A-Z_]+=\S*\s+)*(specinfer\s+[a-z][a-z-]*.*)", line.strip())[
                :1
            ]:
                words = shlex.split(command.replace("[", " ").replace("]", " "), comments=True)
                out.append(words)
    return out


def test_readme_commands_name_subcommands_and_flags_that_exist():
    from specinfer.cli import build_parser

    parser = build_parser()
    (subcommands,) = [a for a in parser._actions if isinstance(a.choices, dict)]
    commands = readme_commands()
    assert len(commands) >= 10 and {"up", "generate", "tune", "train-ssm", "boost-tune", "train-demo"} <= {
        c[1] for c in commands
    }
    for words in commands:
        assert words[1] in subcommands.choices, f"README: `{' '.join(words)}`: no subcommand {words[1]!r}"
        flags = subcommands.choices[words[1]]._option_string_actions
        for word in words[2:]:
            if word.startswith("--"):
                assert word.split("=", 1)[0] in flags, (
                    f"README: `{' '.join(words)}`: specinfer {words[1]} has no flag {word}"
                )


def test_the_file_by_file_flow_names_files_that_exist():
    """The architecture page's "how a request flows" table: each file, as written (from the repository,
    from ``src/specinfer/``, or beside the row's previous file), exists."""
    text = ARCHITECTURE.read_text()
    table = text.split("How a request flows, file by file", 1)[1].split("\n\n")[1]
    files = 0
    for row in table.splitlines()[2:]:
        folder = REPO
        for name in re.findall(r"`([\w/]+\.py)`", row):
            found = [p for p in (REPO / name, REPO / "src/specinfer" / name, folder / name) if p.is_file()]
            assert found, f"docs/architecture.md: the flow names {name}, which is no file"
            folder, files = found[0].parent, files + 1
    assert files > 20
