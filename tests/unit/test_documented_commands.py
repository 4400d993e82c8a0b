"""Every command the documentation shows is one its parser accepts (issue 55).

The commands are read from the fenced code blocks of README.md and docs/*.md and from the flows' own docstrings:
each line (backslash continuations joined; in a block without a shell language, indented lines continue the one
above, as the CLI reference writes them) that runs ``sfm ...``, ``python -m sfm.cli ...`` or
``python flows/NAME.py ...``, after any ``VAR=value`` prefixes, one command per piece of an ``&&`` / ``;`` chain.
Each is checked against the real parsers:

- ``sfm``: :func:`sfm.cli.build_parser`, its subparsers walked: the subcommand exists, every flag is one of its
  options (spelled out: argparse would accept an abbreviation, the documentation should not), takes the values it
  is given, values from a ``choices`` list are in it, and every required option is there.
- a flow: its FlowSpec class (the module imported once, under a private name; nothing runs): the ``run``
  subcommand takes the flow's ``Parameter`` s, built as Metaflow builds them (a ``bool`` Parameter takes a value,
  so a bare ``--mirror`` is wrong) beside ``run``'s own options; the options before the subcommand are Metaflow's
  top-level ones (its click command ``metaflow.cli.start``), the flow's ``Config`` s as ``--config NAME FILE`` and
  the flow decorators' options; other subcommands (``resume``, ``card view``, ``argo-workflows create``) are
  Metaflow's click commands, walked the same way.

What a documented line may leave out: ``[...]`` and ``(a | b)`` are synopsis brackets; a value that is a
placeholder (``URL``, ``N``, ``<id>``, ``...``, ``$VAR``) is not checked against types or choices; a command with a
bare ``...`` in it ("and the rest, as above") is not held to the required options. Commands in a paragraph's
inline code are checked more loosely: their subcommand and flag names only.

The README's CLI reference must also name every ``sfm`` subcommand and every one of its flags, so the synopsis
cannot go stale; on a miss the failure shows argparse's usage line of that subcommand.

Three commands a new user copied from the README and the flows' docstrings and saw fail (issue 55) are kept
here as cases: the checker refuses each, and so does the real tool, in a process of its own.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Callable

import pytest
from metaflow._vendor import click  # Metaflow's own copy, the one its command line is made of

from sfm.cli import build_parser

PROJECT = Path(__file__).resolve().parents[2]
README = PROJECT / "README.md"
DOCS = [README, *sorted((PROJECT / "docs").glob("*.md"))]
FLOWS = sorted((PROJECT / "flows").glob("*_flow.py"))  # a checkout's entry points: python flows/NAME_flow.py
PACKAGED_FLOWS = PROJECT / "sfm" / "flows"  # the flows' code and docstrings: sfm flow NAME runs NAME_flow.py here
SHELLS = {"bash", "sh", "shell", "console", "zsh"}
VARIADIC = -1


# ---- commands in the documentation ----------------------------------------------------------------------


@dataclass
class Command:
    where: str  # file:line
    text: str
    tokens: list[str]
    strict: bool = True  # False: inline code in prose (names only)

    def __str__(self) -> str:
        return f"{self.where}: {self.text}"


def _logical_lines(lines: list[tuple[int, str]], indented_continues: bool) -> list[tuple[int, str]]:
    """Join backslash continuations (and, for a synopsis, indented lines) into one line each."""
    out: list[tuple[int, str]] = []
    joining = False
    for number, line in lines:
        continues = joining or (indented_continues and out and line[:1].isspace() and line.strip())
        if continues and out:
            out[-1] = (out[-1][0], out[-1][1] + " " + line.strip())
        else:
            out.append((number, line.strip()))
        joining = out[-1][1].endswith("\\")
        if joining:
            out[-1] = (out[-1][0], out[-1][1][:-1].rstrip())
    return out


def _split_chain(tokens: list[str], shell: bool) -> list[list[str]]:
    """The commands of a ``&&`` / ``||`` / ``;`` chain, each up to a redirection (and, in a shell block, a pipe)."""
    pieces: list[list[str]] = [[]]
    stopped = False
    for tok in tokens:
        if tok in ("&&", "||", ";") or tok.endswith(";") and not tok.endswith("\\;"):
            if tok.endswith(";") and len(tok) > 1 and not stopped:
                pieces[-1].append(tok[:-1])
            pieces.append([])
            stopped = False
        elif stopped:
            continue
        elif tok in (">", ">>", "<", "2>", "2>&1", "&>") or tok[:1] == ">" or tok[:2] == "2>" or (shell and tok == "|"):
            stopped = True
        else:
            pieces[-1].append(tok)
    return [p for p in pieces if p]


def _program(tokens: list[str]) -> list[str] | None:
    """The tokens from the program on (``sfm ...`` or ``python flows/X.py ...``), or None for other programs."""
    i = 0
    while i < len(tokens) and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", tokens[i]):
        i += 1
    rest = tokens[i:]
    if rest[:1] == ["sfm"]:
        return rest
    if rest[:1] and re.fullmatch(r"python3?(\.\d+)?", rest[0]):
        if rest[1:3] == ["-m", "sfm.cli"]:
            return ["sfm", *rest[3:]]
        if len(rest) > 1 and re.fullmatch(r"(\./)?flows/\w+\.py", rest[1]):
            return rest[1:]
    return None


def commands_in_lines(lines: list[tuple[int, str]], where: str, shell: bool, synopsis: bool) -> list[Command]:
    found = []
    for number, line in _logical_lines(lines, indented_continues=synopsis):
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:  # an unbalanced quote: not a command line
            continue
        for piece in _split_chain(tokens, shell):
            program = _program(piece)
            if program is not None:
                found.append(Command(f"{where}:{number}", line, program))
    return found


def commands_in_markdown(path: Path) -> list[Command]:
    """Commands of the fenced blocks (strict) and of inline code in prose, a span possibly over lines (loose)."""
    where = str(path.relative_to(PROJECT))
    found: list[Command] = []
    block: list[tuple[int, str]] | None = None
    language = ""
    prose: list[str] = []  # the text outside the blocks, a block's lines left empty (line numbers kept)
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fence = re.match(r"^\s*```(\w*)", line)
        if fence:
            if block is None:
                block, language = [], fence.group(1).lower()
            else:
                found += commands_in_lines(block, where, shell=language in SHELLS, synopsis=language not in SHELLS)
                block = None
        elif block is not None:
            block.append((number, line))
        prose.append(line if block is None and not fence else "")
    text = "\n".join(prose)
    for span in re.finditer(r"`([^`]+)`", text):
        number = text.count("\n", 0, span.start()) + 1
        for command in commands_in_lines([(number, " ".join(span.group(1).split()))], where, shell=True,
                                         synopsis=False):
            command.strict = False
            found.append(command)
    return found


def commands_in_flow_docstrings() -> list[Command]:
    import ast

    found = []
    for path in [*FLOWS, *sorted(PACKAGED_FLOWS.glob("*_flow.py"))]:
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
        lines = [(n + 2, line) for n, line in enumerate(doc.splitlines())]  # the docstring opens on line 1
        found += commands_in_lines(lines, str(path.relative_to(PROJECT)), shell=True, synopsis=False)
    return found


def documented_commands() -> list[Command]:
    return [c for path in DOCS for c in commands_in_markdown(path)] + commands_in_flow_docstrings()


# ---- the parsers, as tables of options ------------------------------------------------------------------


@dataclass
class Option:
    flag: str
    dest: str
    nargs: int  # 0: a flag; VARIADIC: up to the next option
    choices: tuple[str, ...] | None = None
    convert: Callable[[str], Any] | None = None  # raises on a value not of its type
    kind: str = ""  # that type's name: int, float, bool
    check: Callable[[list[str]], str | None] | None = None  # a problem with the values, or None
    repeatable: bool = False  # may be given more than once (argparse's append, click's multiple)


@dataclass
class Table:
    """The options of one (sub)command; ``subcommands`` when its first positional names one."""

    name: str
    options: dict[str, Option] = field(default_factory=dict)
    required: dict[str, str] = field(default_factory=dict)  # dest -> flag
    subcommands: dict[str, Callable[[], "Table"]] | None = None
    positional_choices: tuple[str, ...] | None = None  # of the first positional
    refuse: Callable[[set[str]], str | None] | None = None  # a problem with the top-level options given


def _argparse_nargs(action: argparse.Action) -> int:
    if action.nargs == 0 or isinstance(action, (argparse._StoreConstAction, argparse._CountAction)):
        return 0
    if action.nargs in (None, "?"):
        return 1
    if isinstance(action.nargs, int):
        return action.nargs
    return VARIADIC


def argparse_table(parser: argparse.ArgumentParser, name: str) -> Table:
    table = Table(name)
    for action in parser._actions:
        if action.help == argparse.SUPPRESS:
            continue  # an old spelling, kept for one release: the documentation must not use it
        if isinstance(action, argparse._HelpAction):
            table.options.update({flag: Option(flag, "help", 0) for flag in action.option_strings})
            continue
        if isinstance(action, argparse._SubParsersAction):
            table.subcommands = {sub: (lambda p=p, sub=sub: argparse_table(p, f"{name} {sub}"))
                                 for sub, p in action.choices.items()}
            continue
        if not action.option_strings:
            if action.choices is not None and table.positional_choices is None:
                table.positional_choices = tuple(str(c) for c in action.choices)
            continue
        choices = tuple(str(c) for c in action.choices) if action.choices is not None else None
        convert = action.type if action.type in (int, float) else None
        for flag in action.option_strings:
            table.options[flag] = Option(flag, action.dest, _argparse_nargs(action), choices, convert,
                                         convert.__name__ if convert else "",
                                         repeatable=isinstance(action, (argparse._AppendAction, argparse._CountAction)))
        if action.required:
            table.required[action.dest] = max(action.option_strings, key=len)
    return table


def _click_option(param: click.Option, table: Table) -> None:
    nargs = 0 if param.is_flag or param.count else param.nargs
    choices = tuple(param.type.choices) if isinstance(param.type, click.Choice) else None
    kinds = {click.types.IntParamType: "int", click.types.FloatParamType: "float", click.types.BoolParamType: "bool"}
    kind = kinds.get(type(param.type), "")
    convert = (lambda value: param.type.convert(value, param, None)) if kind else None
    for flag in param.opts + param.secondary_opts:
        if flag.startswith("-"):
            table.options[flag] = Option(flag, param.name, nargs if flag in param.opts else 0, choices, convert, kind,
                                         repeatable=bool(param.multiple or param.count))
    if param.required:
        table.required[param.name] = max(param.opts, key=len)


def click_table(command: click.Command, name: str, ctx: click.Context) -> Table:
    table = Table(name)
    for param in command.params:
        if isinstance(param, click.Option):
            _click_option(param, table)
    if hasattr(command, "list_commands"):  # a group, or Metaflow's collection of groups
        table.subcommands = {sub: (lambda sub=sub: click_table(command.get_command(ctx, sub), f"{name} {sub}", ctx))
                             for sub in command.list_commands(ctx)}
    return table


@cache
def flow_class(path: Path):
    """The FlowSpec class of a flow file, its module imported once under a private name (nothing runs: a flow
    file starts its flow only as __main__)."""
    from metaflow import FlowSpec

    spec = importlib.util.spec_from_file_location(f"_documented_{path.parent.parent.name}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    classes = [v for v in vars(module).values()
               if isinstance(v, type) and issubclass(v, FlowSpec) and v is not FlowSpec and v.__module__ == module.__name__]
    assert len(classes) == 1, f"{path}: expected one FlowSpec class, found {classes}"
    return classes[0]


def flow_parameter_option(param) -> click.Option:
    """The click option Metaflow makes of a flow ``Parameter`` (metaflow.parameters.add_custom_parameters), from
    the arguments the flow gave it: its type (given, or the default's), whether it is required. Defaults that
    come from the job config (``config_expr``) are resolved only when a run starts, and a checker does not need
    them."""
    given = {k: v for k, v in param._override_kwargs.items() if v is not None}
    default = given.get("default")
    kind = given.get("type") or (type(default) if default is not None and not callable(default)
                                 and type(default) in (str, int, float, bool) else str)
    return click.Option(("--" + param.name,), type=kind, required=bool(given.get("required")))


def flow_table(path: Path, joined_set: bool = False) -> Table:
    """``python flows/X.py [top-level options] SUBCOMMAND ...``: Metaflow's click command with this flow's
    configs, decorators' options and, for ``run``, its parameters (``joined_set``: under ``sfm flow``, which
    joins a repeated ``--set``)."""
    import metaflow.cli
    from metaflow.decorators import flow_decorators

    flow = flow_class(path)
    ctx = click.Context(metaflow.cli.start)
    table = click_table(metaflow.cli.start, path.name, ctx)
    params = [p for _, p in flow._get_parameters()]
    configs = tuple(p.name for p in params if p.IS_CONFIG_PARAMETER)
    if configs:  # metaflow.user_configs.config_options: --config NAME FILE, --config-value NAME VALUE
        def config_name(values: list[str], flag: str = "--config") -> str | None:
            if values and not _placeholder(values[0]) and values[0] not in configs:
                return (f"{flag} takes NAME FILE, the name one of {', '.join(configs)} (e.g. {flag} "
                        f"{configs[0]} my.toml), not {values[0]!r}")
            return None

        for flag in ("--config", "--config-value"):
            table.options[flag] = Option(flag, flag[2:].replace("-", "_"), 2,
                                         check=lambda v, flag=flag: config_name(v, flag))
    for deco in flow_decorators(flow):
        for option, kwargs in deco.options.items():
            _click_option(click.Option(("--" + option,), **kwargs), table)
    subcommands = dict(table.subcommands or {})

    def run() -> Table:
        run_table = subcommands["run"]()
        for p in params:
            if not p.IS_CONFIG_PARAMETER:
                _click_option(flow_parameter_option(p), run_table)
        if joined_set and "--set" in run_table.options:
            run_table.options["--set"].repeatable = True
        return run_table

    table.subcommands = {**subcommands, "run": run}
    table.refuse = lambda given: ("--config and --config-value cannot be used with resume (Metaflow reuses the "
                                  "original run's configs)" if given & {"config", "config_value"} else None)
    return table


def sfm_table() -> Table:
    return argparse_table(build_parser(), "sfm")


# ---- checking one command -------------------------------------------------------------------------------


def _placeholder(value: str) -> bool:
    """A value the documentation leaves to the reader: URL, N, <id>, ..., $VAR, {a,b}, NAME[:vN]."""
    return (value in ("...", "…") or any(c in value for c in "<>${}") or "..." in value
            or bool(re.fullmatch(r"[A-Z][A-Z0-9_]*(\[.*\])?(:[A-Za-z]+)?", value)))


def _is_option(token: str) -> bool:
    return token.startswith("-") and len(token) > 1 and not re.fullmatch(r"-\d+(\.\d+)?", token)


def _strip(token: str) -> str:
    """A synopsis token without its brackets: ``[--parts`` -> ``--parts``, ``K]]`` -> ``K``."""
    return token.lstrip("[(").rstrip("])") if token not in ("[", "]", "(", ")") else ""


def _value_problem(opt: Option, value: str) -> str | None:
    if _placeholder(value):
        return None
    for alternative in value.split("|"):  # a synopsis's choice: each one checked
        if _placeholder(alternative):
            continue
        if opt.choices is not None and alternative not in opt.choices:
            return f"{opt.flag} {alternative!r} is not one of {', '.join(opt.choices)}"
        if opt.convert is not None:
            try:
                opt.convert(alternative)
            except (ValueError, TypeError, click.BadParameter):
                return f"{opt.flag} takes a{'n' if opt.kind == 'int' else ''} {opt.kind} value, not {alternative!r}"
    return None


def check_command(tokens: list[str], table: Table, strict: bool = True) -> list[str]:
    """What is wrong with ``tokens`` (the program's arguments) for ``table``; [] when nothing is."""
    tokens = [t for t in (_strip(t) for t in tokens) if t]
    elliptical = False
    problems: list[str] = []
    given: set[str] = set()
    last = ""
    positionals: list[str] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok in ("...", "…", "|"):
            elliptical |= tok != "|"
            if tok == "|":  # [--mirror | --no-mirror]: the option before is one of two, not given with the next
                given.discard(last)
            i += 1
            continue
        if _is_option(tok):
            flag, eq, inline = tok.partition("=")
            opt = table.options.get(flag)
            if opt is None:
                problems.append(f"{table.name}: no such option {flag}")
                i += 1
                continue
            if opt.dest in given and not opt.repeatable and strict:
                problems.append(f"{table.name}: {flag} is given twice, and the parser keeps only the last (a flow's "
                                "--set takes several keys in one, separated by ';')")
            given.add(opt.dest)
            last = opt.dest
            if opt.nargs == 0:
                if eq:
                    problems.append(f"{table.name}: {flag} is a flag, it takes no value")
                i += 1
                continue
            values, j = ([inline] if eq else []), i + 1
            want = VARIADIC if opt.nargs == VARIADIC else opt.nargs
            while j < len(tokens) and (want == VARIADIC or len(values) < want) and not _is_option(tokens[j]):
                values.append(tokens[j])
                j += 1
            if strict and want != VARIADIC and len(values) < want:
                also = f" (a {opt.kind} option: {flag} True or {flag} False)" if opt.kind == "bool" else ""
                problems.append(f"{table.name}: {flag} takes {want} value(s), given {len(values)}{also}")
            for value in values:
                problem = _value_problem(opt, value)
                if problem:
                    problems.append(f"{table.name}: {problem}")
            if opt.check is not None and (problem := opt.check(values)):
                problems.append(f"{table.name}: {problem}")
            i = j
            continue
        if table.subcommands is not None:
            if _placeholder(tok):
                return problems  # sfm COMMAND ...: nothing below to check
            if tok not in table.subcommands:
                return problems + [f"{table.name}: no subcommand {tok!r} (one of {', '.join(sorted(table.subcommands))})"]
            refused = table.refuse(given) if table.refuse is not None and tok == "resume" else None
            return problems + ([f"{table.name}: {refused}"] if refused else []) + \
                check_command(tokens[i + 1:], table.subcommands[tok](), strict)
        positionals.append(tok)
        i += 1
    if table.positional_choices is not None and positionals and not _placeholder(positionals[0]):
        for alternative in positionals[0].split("|"):
            if alternative not in table.positional_choices:
                problems.append(f"{table.name}: {alternative!r} is not one of {', '.join(table.positional_choices)}")
    if table.subcommands is not None and strict and not elliptical:
        problems.append(f"{table.name}: no subcommand given")
    if strict and not elliptical:
        missing = [flag for dest, flag in table.required.items() if dest not in given]
        if missing:
            problems.append(f"{table.name}: the required {', '.join(missing)} is missing")
    return problems


def problems_of(command: Command) -> list[str]:
    program, args = command.tokens[0], command.tokens[1:]
    if program == "sfm":
        at = next((i for i, t in enumerate(args) if not _is_option(_strip(t))), len(args))
        if (_strip(args[at]) if at < len(args) else "") != "flow":
            return check_command(args, sfm_table(), command.strict)
        # sfm flow NAME ARGS: sfm's own options and the flow's name, then ARGS as the packaged flow file takes them
        name = _strip(args[at + 1]) if at + 1 < len(args) else ""
        problems = check_command(args[:at + 2], sfm_table(), command.strict)
        if problems or not name or _placeholder(name) or "|" in name:
            return problems
        return check_command(args[at + 2:], flow_table(PACKAGED_FLOWS / f"{name}_flow.py", joined_set=True),
                             command.strict)
    path = PROJECT / program.removeprefix("./")
    if _placeholder(path.stem.removesuffix("_flow")):
        return []  # python flows/NAME_flow.py: any flow
    if not path.is_file():
        return [f"{program}: no such flow file"]
    return check_command(args, flow_table(path), command.strict)


# ---- the tests ------------------------------------------------------------------------------------------


def test_the_documentation_shows_commands_of_every_kind():
    commands = documented_commands()
    programs = {c.tokens[0] for c in commands if c.strict}
    assert {"sfm", "flows/pretrain_flow.py", "flows/finetune_flow.py", "flows/predict_flow.py"} <= programs, programs
    assert len([c for c in commands if c.strict]) >= 30


def test_every_documented_command_is_accepted_by_its_parser():
    wrong = [f"{command}\n    " + "\n    ".join(problems) for command in documented_commands()
             if (problems := problems_of(command))]
    assert not wrong, "documented commands the parsers refuse:\n" + "\n".join(wrong)


def cli_reference() -> list[list[str]]:
    """The ``sfm`` entries of the README's CLI reference (the code blocks of its "CLI reference" section)."""
    text = README.read_text()
    match = re.search(r"^## CLI reference\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, "README.md has no '## CLI reference' section"
    start = text[:match.start(1)].count("\n") + 1
    lines = [(start + n, line) for n, line in enumerate(match.group(1).splitlines())]
    block, entries = None, []
    for number, line in lines:
        if line.lstrip().startswith("```"):
            if block is not None:
                entries += [c.tokens for c in commands_in_lines(block, "README.md", shell=False, synopsis=True)]
            block = None if block is not None else []
        elif block is not None:
            block.append((number, line))
    return entries


def test_the_cli_reference_names_every_subcommand_and_flag():
    parser = build_parser()
    entries = [e for e in cli_reference() if e[0] == "sfm"]
    named = {f for e in entries for t in e for f in re.findall(r"--[\w-]+", t)}
    missing = [f for a in parser._actions for f in a.option_strings if f.startswith("--") and f != "--help"
               and f not in named]
    stale = [f"sfm's own {', '.join(missing)}: `sfm [{' '.join(missing)}] COMMAND ...`"] if missing else []
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subparsers.choices.items():
        lines = [e for e in entries if [t for t in (_strip(t) for t in e[1:]) if t and not _is_option(t)][:1] == [name]]
        flags = {f for e in lines for t in e for f in re.findall(r"--[\w-]+", t)}
        words = {w for e in lines for t in e for w in _strip(t).split("|")}
        wanted = [f for a in sub._actions for f in a.option_strings if f.startswith("--") and f != "--help"
                  and a.help != argparse.SUPPRESS]
        choices = [str(c) for a in sub._actions if not a.option_strings and a.choices for c in a.choices]
        absent = [f for f in wanted if f not in flags] + [c for c in choices if c not in words]
        if not lines or absent:
            stale.append(f"sfm {name}: {'no entry' if not lines else 'missing ' + ', '.join(absent)}; its usage:\n"
                         f"    {' '.join(sub.format_usage().split())}")
    assert not stale, "README.md's CLI reference is stale:\n" + "\n".join(stale)


def test_the_cli_reference_names_every_flow_parameter():
    entries = cli_reference()
    stale = []
    for path in FLOWS:
        name = path.stem.removesuffix("_flow")
        lines = [e for e in entries if e[0] == f"flows/{path.name}" or
                 (e[0] == "sfm" and [_strip(t) for t in e[1:3]] == ["flow", name])]
        flags = {f for e in lines for t in e for f in re.findall(r"--[\w-]+", t)}
        params = [p for _, p in flow_class(path)._get_parameters()]
        wanted = ["--" + p.name for p in params if not p.IS_CONFIG_PARAMETER]
        wanted += ["--config"] if any(p.IS_CONFIG_PARAMETER for p in params) else []
        absent = [f for f in wanted if f not in flags]
        if not lines or absent:
            stale.append(f"flows/{path.name}: {'no entry' if not lines else 'missing ' + ', '.join(absent)}")
    assert not stale, "README.md's CLI reference is stale:\n" + "\n".join(stale)


# the commands of issue 55, as a user copied them, and the same commands fixed
ISSUE_55 = [
    ("sfm train --surveys s3://bucket/x.mdio --data-root s3://bucket/sfm", "--run-root",
     "sfm train --surveys s3://bucket/x.mdio --data-root s3://bucket/sfm --run-root s3://bucket/sfm/checkpoints/x"),
    ("python flows/finetune_flow.py run --surveys survey.sgy --labels faults.sgy --config my.toml", "--config",
     "python flows/finetune_flow.py --config config sfm/default.toml run --surveys survey.sgy --labels faults.sgy"),
    ("python flows/predict_flow.py run --model sfm-faults:v3 --survey s3://b/sfm/surveys/ID.zarr "
     "--out s3://b/sfm/predictions/ID-faults.zarr --parts 8 --mirror", "--mirror",
     "python flows/predict_flow.py run --model sfm-faults:v3 --survey s3://b/sfm/surveys/ID.zarr "
     "--out s3://b/sfm/predictions/ID-faults.zarr --parts 8 --mirror True"),
]


def as_command(text: str) -> Command:
    (command,) = commands_in_lines([(1, text)], "test", shell=False, synopsis=False)
    return command


@pytest.mark.parametrize("wrong,flag,right", ISSUE_55, ids=["train-run-root", "finetune-config", "predict-mirror"])
def test_the_checker_refuses_the_commands_of_issue_55(wrong, flag, right):
    problems = problems_of(as_command(wrong))
    assert problems and any(flag in p for p in problems), problems
    assert problems_of(as_command(right)) == []


def test_the_checker_knows_what_the_parsers_know():
    """Flags that do not exist, missing values, bad choices, a config name, a missing subcommand."""
    cases = {
        "sfm predict --model m --survey s --out o --mirrror": "no such option --mirrror",
        "sfm predict --model m --survey s --out o --output probabilities": "'probabilities' is not one of",
        "sfm predict --model m --survey s --out o --parts many": "takes an int value",
        "sfm registry lst": "'lst' is not one of",
        "sfm trian --run-root r": "no subcommand 'trian'",
        "sfm ingest-labels labels.npy": "--survey is missing",
        "sfm ingest a.sgy --out sfm_data": "no such option --out",  # the old spelling, not to be documented
        "sfm registry show --model sfm-mae --version 3": "no such option --model",
        "python flows/pretrain_flow.py run --set train.lr=1e-3 --set data.batch_size=4": "--set is given twice",
        "sfm train --run-root r --dry-run=yes": "takes no value",
        "python flows/pretrain_flow.py --config my.toml run": "--config takes NAME FILE",
        "python flows/pretrain_flow.py run --max-steps": "takes 1 value(s)",
        "python flows/pretrain_flow.py --config config my.toml resume": "cannot be used with resume",
        "python flows/pretrain_flow.py --with kubernetes": "no subcommand given",
        "python flows/pretrain_flow.py card veiw evaluate": "no subcommand 'veiw'",
        "python flows/predict_flow.py run --model m --survey s": "--out is missing",
        "python flows/finetune_flow.py run --held-out 0.2 --tsk binary": "no such option --tsk",
        "sfm flow predict run --model m --survey s": "--out is missing",
        "sfm flow finetune run --held-out 0.2 --tsk binary": "no such option --tsk",
        "sfm flow pretrian run": "'pretrian' is not one of",
        "sfm flow pretrain --config my.toml run": "--config takes NAME FILE",
        "sfm flow pretrain --with kubernetes": "no subcommand given",
    }
    for text, expected in cases.items():
        problems = problems_of(as_command(text))
        assert any(expected in p for p in problems), (text, problems)
    fine = ["sfm registry list|show|promote|load [MODEL] [--data-root DATA_ROOT]",
            "sfm train --run-root r --set train.lr=1e-3 --set data.batch_size=4",
            "sfm flow pretrain run --set train.lr=1e-3 --set data.batch_size=4",
            "python flows/pretrain_flow.py run --set 'train.lr=1e-3;data.batch_size=4'",
            "sfm train (--data-root ROOT [--held-out NAMES] | --surveys STORES) --run-root URL [--nodes N]",
            "python flows/pretrain_flow.py --config config sfm/configs/hyperpod_p5en.toml --with kubernetes run --nodes 2",
            "python flows/pretrain_flow.py --datastore s3 argo-workflows create --only-json",
            "python flows/pretrain_flow.py resume",
            "python flows/predict_flow.py run ... --with kubernetes:gpu=1",
            "sfm --allow-insecure-s3 registry list",
            "sfm flow pretrain --config config quality_cpu run --max-steps 5",
            "sfm --allow-insecure-s3 flow predict resume",
            "sfm flow pretrain|finetune|predict [--config config FILE|NAME] run|resume ..."]
    for text in fine:
        assert problems_of(as_command(text)) == [], text


def _real_tool(text: str, cwd: Path) -> subprocess.Popen:
    args = shlex.split(text)
    if args[0] == "sfm":
        args = [sys.executable, "-m", "sfm.cli", *args[1:]]
    else:
        args = [sys.executable, str(PROJECT / args[1]), *args[2:]]
    env = {**os.environ, "METAFLOW_USER": os.environ.get("METAFLOW_USER", "dev"),
           "PYTHONPATH": os.pathsep.join([str(PROJECT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_the_real_tools_agree_on_the_commands_of_issue_55(tmp_path):
    """Each command of issue 55 fails in the tool itself, naming the flag; each fixed one parses (a flow's with
    --help appended, which Metaflow answers once every option is parsed and before anything runs; sfm's by
    argparse in this process)."""
    parser = build_parser()
    wrong_sfm, flag, right_sfm = ISSUE_55[0]
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(shlex.split(wrong_sfm)[1:])
    assert exit_.value.code == 2
    parser.parse_args(shlex.split(right_sfm)[1:])
    wrong = {text: _real_tool(text, tmp_path) for text, _, _ in ISSUE_55[1:]}
    right = {text: _real_tool(text.replace("sfm/default.toml", str(PROJECT / "sfm/default.toml")) + " --help",
                              tmp_path) for _, _, text in ISSUE_55[1:]}
    for (text, proc), (_, flag, _) in zip(wrong.items(), ISSUE_55[1:]):
        out = proc.communicate(timeout=120)[0]
        assert proc.returncode == 2 and flag in out, (text, out[-2000:])
    for text, proc in right.items():
        out = proc.communicate(timeout=120)[0]
        assert proc.returncode == 0 and "Usage:" in out, (text, out[-2000:])


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation other than - and _ dropped, spaces as -."""
    text = re.sub(r"^\s*```.*?^\s*```", "", path.read_text(), flags=re.S | re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", text, re.M)}


def test_every_guide_is_in_the_contents_and_every_link_resolves():
    contents = re.search(r"^## Contents\n(.*?)(?=^## )", README.read_text(), re.S | re.M)
    assert contents, "README.md has no '## Contents' section"
    listed = set(re.findall(r"\]\((docs/[\w-]+\.md)\)", contents.group(1)))
    assert listed == {f"docs/{p.name}" for p in DOCS[1:]}, "the contents must link every guide in docs/"
    broken = []
    for path in [*DOCS, PROJECT / "BENCHMARKS.md"]:
        prose = re.sub(r"^\s*```.*?^\s*```", "", path.read_text(), flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if re.match(r"\w+://", target):
                continue
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in _anchors(linked)):
                broken.append(f"{path.relative_to(PROJECT)}: {target}")
    assert not broken, "links that lead nowhere:\n" + "\n".join(broken)


def test_the_readme_stays_a_short_guide():
    assert len(README.read_text().splitlines()) <= 320
