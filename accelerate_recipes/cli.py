"""Command-line entry point shared by the recipes."""

import ast
import copy
import dataclasses
import difflib
import inspect
import os
import re
import shutil
import sys
import textwrap
import types
import typing
from pathlib import Path

import fire

# every bar, whatever its front end, is listed in tqdm.std.tqdm._instances
from tqdm.std import tqdm

from accelerate_recipes.errors import PREEMPTED_EXIT_CODE, Preempted, RecipeError, first_line  # noqa: F401 (re-exported)
from accelerate_recipes.flags import choices_of


def address_in_use(err: Exception) -> bool:
    """Whether a socket or torch store error says the port is taken."""
    return "EADDRINUSE" in str(err) or "address already in use" in str(err).lower()


def port_in_use(address: str, port) -> RecipeError:
    """The error for a rendezvous port that another process holds."""
    return RecipeError(
        f"port {port} on {address} is in use (another run, or a stale process of an earlier one): "
        "pick another with --main_process_port / MASTER_PORT, or find it with `ss -ltnp | grep "
        f":{port}`"
    )


def _drop_legacy_local_rank(argv: list[str]) -> list[str]:
    # `python -m torch.distributed.launch` appends --local-rank=N (or --local_rank N); the rank also
    # arrives in the LOCAL_RANK environment variable, which Accelerate reads, so the flag carries
    # nothing we need.
    kept, skip_next = [], False
    for arg in argv:
        if skip_next:
            skip_next = False
            continue
        if arg.startswith(("--local-rank=", "--local_rank=")):
            continue
        if arg in ("--local-rank", "--local_rank"):
            skip_next = True
            continue
        kept.append(arg)
    return kept


def expand_preset(argv: list[str], presets: dict[str, dict]) -> list[str]:
    """`--preset NAME` stands for that preset's flags; a flag also given on the command line keeps
    the given value."""
    name = None
    for i, arg in enumerate(argv):
        if arg.startswith("--preset="):
            name = arg.split("=", 1)[1]
        elif arg == "--preset" and i + 1 < len(argv):
            name = argv[i + 1]
    if name is None:
        return argv
    if name not in presets:
        raise RecipeError(f"unknown --preset {name!r}; choose one of: {', '.join(presets) or 'none defined'}")
    given = {arg[2:].split("=", 1)[0].replace("-", "_") for arg in argv if arg.startswith("--")}
    return [f"--{flag}={value}" for flag, value in presets[name].items() if flag not in given] + argv


def _annotations(main) -> dict:
    try:
        return typing.get_type_hints(main)
    except Exception:  # an annotation that does not resolve: fall back to what the signature holds
        return {name: p.annotation for name, p in inspect.signature(main).parameters.items()}


def _flag_kind(annotation, default) -> str:
    """str (one text, or one of the texts a Literal allows), texts (a text, or several when the
    flag is repeated), bool, or other (fire parses it)."""
    if annotation is inspect.Parameter.empty:
        annotation = type(default) if default not in (None, inspect.Parameter.empty) else None
    choices = choices_of(annotation)
    if choices and all(isinstance(choice, str) for choice in choices):
        return "str"
    members = (
        set(typing.get_args(annotation))
        if typing.get_origin(annotation) in (typing.Union, types.UnionType)
        else {annotation}
    )
    members.discard(type(None))
    if members == {str}:
        return "str"
    if str in members and list[str] in members and len(members) == 2:
        return "texts"
    if members == {bool}:
        return "bool"
    return "other"


def _flags(main) -> dict[str, tuple[inspect.Parameter, str]]:
    hints = _annotations(main)
    return {
        name: (p, _flag_kind(hints.get(name, p.annotation), p.default))
        for name, p in inspect.signature(main).parameters.items()
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }


def _takes_any_flag(main) -> bool:
    return any(p.kind == p.VAR_KEYWORD for p in inspect.signature(main).parameters.values())


def flags_class(main):
    """The dataclass of flags `main(args)` takes (its one parameter's annotation), or None for a
    `main(**flags)`."""
    params = list(inspect.signature(main).parameters.values())
    if len(params) != 1 or params[0].kind in (params[0].VAR_POSITIONAL, params[0].VAR_KEYWORD):
        return None
    hint = _annotations(main).get(params[0].name)
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def as_command(main):
    """What the command line calls: `main` itself, or for `main(args: SomeFlags)` a function whose
    parameters are the dataclass's fields (the recipe's own first, then the shared ones) and whose
    docstring documents each field with the text of the most derived class that documents it;
    calling it builds the dataclass and calls `main`."""
    cls = flags_class(main)
    if cls is None:
        return main
    hints = typing.get_type_hints(cls)
    docs, text = {}, ""
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        own_text, own_docs = parse_arg_docs(klass.__doc__ if "__doc__" in vars(klass) else None)
        docs.update(own_docs)
        text = own_text or text
    inherited = {
        f.name for base in cls.__mro__[1:] if dataclasses.is_dataclass(base) for f in dataclasses.fields(base)
    }
    fields = dataclasses.fields(cls)
    ordered = [f for f in fields if f.name not in inherited] + [f for f in fields if f.name in inherited]
    params = [
        inspect.Parameter(
            f.name,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            annotation=hints[f.name],
            default=inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default,
        )
        for f in ordered
    ]

    signature = inspect.Signature(params)

    def command(*args, **kwargs):  # fire passes the values by position, in the signature's order
        return main(cls(**signature.bind(*args, **kwargs).arguments))

    command.__name__ = command.__qualname__ = main.__name__
    command.__signature__ = signature
    command.__annotations__ = {f.name: hints[f.name] for f in ordered}
    args = "\n".join(f"    {f.name}: {docs[f.name]}" for f in ordered if f.name in docs)
    command.__doc__ = f"{text}\n\nArgs:\n{args}\n"
    return command


TRUE_WORDS, FALSE_WORDS = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def _is_short_flag(arg: str) -> bool:
    # What fire would read as a one-letter flag; "-1" or "-0.5" are numbers.
    return re.match(r"^-[A-Za-z](=|$)", arg) is not None


def _is_flag(arg: str) -> bool:
    return arg.startswith("--") or _is_short_flag(arg)


def wants_help(argv: list[str]) -> bool:
    """-h or --help anywhere, also after fire's `--` separator."""
    return any(arg in ("-h", "--help") for arg in argv)


def prepare_argv(main, argv: list[str]) -> list[str]:
    """The command line rewritten so that fire gives `main` exactly what the user typed.

    Fire reads every value as a Python literal ("great, fun" becomes a tuple, "1e-3" a float) and
    invents one-letter flags (-h for --hsv); so a text flag's value is handed over as repr(value),
    which fire reads back as that very string, a one-letter flag is refused, and so is any flag
    `main` does not have.
    """
    flags = _flags(main)
    any_flag = _takes_any_flag(main)
    example = next(iter(flags), "flag")
    texts: dict[str, list[str]] = {}  # values of repeatable text flags, passed once as a list
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg == "--":  # fire's own flags (--trace, --verbose, ...) follow; leave them to fire
            out += argv[i - 1 :]
            break
        if _is_short_flag(arg):
            letter = arg[1]
            guess = next((name for name in flags if name.startswith(letter)), example)
            raise RecipeError(f"unknown flag {arg.split('=', 1)[0]}; flags are spelled out, e.g. --{guess}")
        if not arg.startswith("--"):
            raise RecipeError(
                f"unexpected argument {arg!r}: every value follows its flag (--{example} VALUE); "
                "quote a value that holds spaces"
            )
        name, has_value, value = arg[2:].partition("=")
        name = name.replace("-", "_")
        if name not in flags:
            if not has_value and name.startswith("no") and flags.get(name[2:], (None, ""))[1] == "bool":
                out.append(f"--{name}")
                continue
            if any_flag:
                out.append(arg)
                continue
            close = difflib.get_close_matches(name, list(flags), n=1)
            hint = f"did you mean --{close[0]}? " if close else ""
            raise RecipeError(f"unknown flag --{name}; {hint}--help lists them all")
        kind = flags[name][1]
        if not has_value:
            if i < len(argv) and not _is_flag(argv[i]):
                value, has_value = argv[i], True
                i += 1
            elif kind in ("str", "texts"):
                raise RecipeError(f"--{name} needs a value, e.g. --{name}=VALUE")
        if kind == "str":
            out.append(f"--{name}={value!r}")
        elif kind == "texts":
            texts.setdefault(name, []).append(value)
        elif kind == "bool" and has_value:
            if value.lower() not in TRUE_WORDS + FALSE_WORDS:
                raise RecipeError(
                    f"--{name} takes True or False, not {value!r}; e.g. --{name} False (or --no{name})"
                )
            out.append(f"--{name}={value.lower() in TRUE_WORDS}")
        elif has_value:
            out.append(f"--{name}={value}")
        else:
            out.append(f"--{name}")
    # One text stays a string; a repeated flag gives the list of its texts.
    lead = [f"--{name}={(values[0] if len(values) == 1 else values)!r}" for name, values in texts.items()]
    return lead + out


def parse_arg_docs(doc: str | None) -> tuple[str, dict[str, str]]:
    """A Google-style docstring split into its text outside "Args:" and each argument's full
    description.

    An entry starts at a line indented exactly one level deeper than "Args:" that reads `name: text`
    (or
    `name (type): text`); deeper lines continue it, whatever they hold (fire's own parser ends an
    entry at a wrapped line holding a colon).
    """
    lines = inspect.cleandoc(doc or "").splitlines()
    text, docs, i = [], {}, 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if line.strip() not in ("Args:", "Arguments:"):
            text.append(line)
            continue
        base = len(line) - len(line.lstrip())
        level, name = None, None
        while i < len(lines):
            line = lines[i]
            indent = len(line) - len(line.lstrip())
            if line.strip() and indent <= base:
                break
            i += 1
            if not line.strip():
                continue
            level = indent if level is None else level
            entry = (
                re.match(r"(\w+)\s*(?:\([^)]*\))?:(?:\s+(.*)|$)", line.strip()) if indent == level else None
            )
            if entry:
                name = entry.group(1)
                docs[name] = entry.group(2) or ""
            elif name is not None:
                docs[name] = f"{docs[name]} {line.strip()}".strip()
    return "\n".join(text).strip(), docs


def _metavar(kind: str, annotation, default) -> str:
    choices = choices_of(annotation)
    if choices:
        return "|".join(map(str, choices))
    if kind in ("str", "texts"):
        return "TEXT"
    if kind == "bool":
        return "[True|False]"
    if isinstance(default, tuple) and default:
        return ",".join(type(v).__name__.upper() for v in default)
    members = [a for a in (typing.get_args(annotation) or (annotation,)) if a is not type(None)]
    names = [getattr(a, "__name__", str(a)).upper() for a in members if a is not inspect.Parameter.empty]
    return "|".join(names) or "VALUE"


def _shown_default(default) -> str:
    if isinstance(default, tuple):
        return ",".join(map(str, default))
    if isinstance(default, str) and (not default or default != default.strip() or "," in default):
        return repr(default)
    return str(default)


def format_help(main, prog: str) -> str:
    """Help built from `main`'s signature and docstring: a usage line, the description, every flag
    in full."""
    width = max(60, min(shutil.get_terminal_size((100, 24)).columns, 120))
    text, docs = parse_arg_docs(main.__doc__)
    hints = _annotations(main)
    flags = _flags(main)
    required = [f"--{name} VALUE" for name, (p, _) in flags.items() if p.default is inspect.Parameter.empty]
    lines = [f"usage: {prog} {' '.join(required + ['[--flag VALUE ...]'])}".rstrip(), ""]
    if text:
        lines += [text, ""]
    lines += [
        textwrap.fill(
            "Flags are spelled out in full: --flag VALUE or --flag=VALUE. A true/false flag: "
            "--flag (True), --flag False or --noflag. A TEXT value is taken as typed, commas and "
            "digits included.",
            width,
        ),
        "",
        "flags:",
    ]
    for name, (param, kind) in flags.items():
        default = (
            "required"
            if param.default is inspect.Parameter.empty
            else f"default: {_shown_default(param.default)}"
        )
        lines.append(
            f"  --{name} {_metavar(kind, hints.get(name, param.annotation), param.default)}  ({default})"
        )
        lines.append(
            textwrap.fill(
                docs.get(name, "(not documented)"),
                width,
                initial_indent=" " * 6,
                subsequent_indent=" " * 6,
                break_long_words=False,
                break_on_hyphens=False,
            )
        )
    return "\n".join(lines)


def _close_progress_bars() -> None:
    """End any open tqdm bar, so that the message that follows starts on a line of its own."""
    for bar in list(getattr(tqdm, "_instances", [])):
        bar.close()


def _print_line(line: str) -> None:
    """`line` and its newline to stderr in one write. The processes of a run that fail together
    print at the same moment into one stream; print() writes the newline separately when stderr is
    unbuffered (PYTHONUNBUFFERED, python -u), and another process's line landing between the two
    would fuse both lines into one."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


# A program that runs a recipe in its own process and goes on after it (an audit, a notebook) sets
# this to False.
EXIT_WHEN_DONE = True


def _exit_after_distributed_run() -> None:
    """End a finished multi-process run here, with exit code 0, once its output is flushed.

    DistributedDataParallel keeps a reference to its process group that outlives
    `destroy_process_group` (torch 2.15: the gloo worker threads still run after the model is freed
    and the group destroyed), so the group is torn down, if at all, during interpreter exit. There a
    finished 2-process run was seen to abort after saving everything ("terminate called without an
    active exception", exit -6), which a launcher, SLURM or a CI job reads as a failed run. The
    recipes save, finish their trackers and destroy the group (`end_training`) before returning, so
    the interpreter's teardown has nothing left to do.
    """
    if not EXIT_WHEN_DONE or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    _close_progress_bars()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _help_for(main, prog: str, argv: list[str]) -> str | None:
    """The text that -h/--help asks for (or that a script of sub-commands prints when none is
    named), else None."""
    if isinstance(main, dict):  # sub-commands: `prog NAME --flags` runs main[NAME]
        if not argv or (argv[0] not in main and wants_help(argv)):
            return (
                f"usage: {prog} {{{','.join(main)}}} [--flags]; `{prog} NAME --help` shows a command's flags"
            )
        if argv[0] not in main:
            return None
        prog, main, argv = f"{prog} {argv[0]}", main[argv[0]], argv[1:]
    return format_help(as_command(main), prog) if wants_help(argv) else None


def _imported_flag_classes(tree: ast.Module, folder: Path | None, wanted: set[str], here: Path | None = None):
    """The definitions of flag classes a script imports from a module beside it or from a package
    there (`from chat.model import ChatModelFlags`), read from that module's source, with the bases
    they import in turn (also relatively, from the package's own modules): base classes first.
    `here` is the folder of the module `tree` is."""
    found: list[ast.ClassDef] = []
    if folder is None:
        return found
    here = here or folder
    sources = {
        alias.asname or alias.name: (here if node.level else folder)
        / f"{(node.module or '').replace('.', '/')}.py"
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.module and node.level <= 1
        for alias in node.names
    }
    for name in sorted(wanted):
        path = sources.get(name)
        if path is None or not path.is_file():
            continue
        module = ast.parse(path.read_text(encoding="utf-8"))
        node = next((n for n in module.body if isinstance(n, ast.ClassDef) and n.name == name), None)
        if node is not None:
            bases = {b.id for b in node.bases if isinstance(b, ast.Name)} - {"TrainingFlags"}
            found += _imported_flag_classes(module, folder, bases, path.parent) + [node]
    return found


def _is_literal_alias(node: ast.stmt) -> bool:
    """Whether a statement names a Literal: `Name = Literal[...]`."""
    return (
        isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Subscript)
        and isinstance(node.value.value, ast.Name)
        and node.value.value.id == "Literal"
    )


def _commands_in_source(source: str, folder: Path | None = None) -> dict | None:
    """The function(s) a script's `run(...)` call names, rebuilt from its source without running its
    imports.

    Each is a stand-in with the real signature and docstring and an empty body. None when the call
    or a signature cannot be rebuilt this way (a default that is a name defined in the script, say).
    A flags class may extend one that a module beside the script (in `folder`) defines.
    """
    tree = ast.parse(source)
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "run"
        and node.args
    ]
    if len(calls) != 1:
        return None
    target = calls[0].args[0]
    if isinstance(target, ast.Name):
        names = {None: target.id}
    elif isinstance(target, ast.Dict) and all(
        isinstance(k, ast.Constant) and isinstance(v, ast.Name) for k, v in zip(target.keys, target.values)
    ):
        names = {k.value: v.id for k, v in zip(target.keys, target.values)}
    else:
        return None
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    # A flags dataclass is rebuilt with what its definition
    # may use: dataclass, field and the shared flags.
    preamble = ast.parse(
        "from dataclasses import dataclass, field\nfrom typing import Literal, get_args\n"
        "from accelerate_recipes.flags import TrainingFlags"
    ).body
    # and the choices the script names (`DatasetName = Literal[...]`)
    preamble += [node for node in tree.body if _is_literal_alias(node)]
    commands = {}
    for key, name in names.items():
        node = functions[name]
        doc = ast.get_docstring(node, clean=False)
        body = [ast.Expr(ast.Constant(doc))] if doc is not None else []
        stub = copy.copy(node)
        stub.body, stub.decorator_list, stub.returns = body + [ast.Pass()], [], None
        annotations = {arg.annotation.id for arg in node.args.args if isinstance(arg.annotation, ast.Name)}
        flag_classes = [classes[n] for n in annotations if n in classes]
        bases = {b.id for c in flag_classes for b in c.bases if isinstance(b, ast.Name)} - set(classes)
        flag_classes = _imported_flag_classes(tree, folder, bases - {"TrainingFlags"}) + flag_classes
        module = ast.fix_missing_locations(ast.Module(body=preamble + flag_classes + [stub], type_ignores=[]))
        namespace: dict = {}
        # names the script defines raise NameError here
        exec(compile(module, "<signature>", "exec"), namespace)
        commands[key] = namespace[name]
    return commands[None] if None in commands else commands


def run_mode(args, modes: dict, otherwise):
    """Run the one mode a flag names, or `otherwise` (training) when none is given.

    `modes` maps a flag's name to the function of the flags that serves it, in the order the error
    names them: `run_mode(args, {"predict": predict, "eval_only": evaluate}, otherwise=train)`. A
    flag is given when it is set (not None, not False); two given stop with one line.
    """
    given = [name for name in modes if getattr(args, name) not in (None, False)]
    if len(given) > 1:
        flags = [f"--{name}" for name in modes]
        if len(flags) == 2:
            raise RecipeError(f"give {flags[0]} or {flags[1]}, not both")
        both = " and ".join(f"--{name}" for name in given)
        raise RecipeError(f"give one of {', '.join(flags[:-1])} and {flags[-1]}, not {both}")
    return modes[given[0]](args) if given else otherwise(args)


def run(main, presets: dict[str, dict] | None = None) -> None:
    """Run `main` as a command-line program: flags come from its signature and docstring
    (python-fire).

    The command line goes through prepare_argv first, and -h/--help prints format_help, so that
    every flag reads the same in every script and its help is shown in full.

    `presets` maps a name to flag values that `--preset NAME` applies (see expand_preset).
    """
    argv = _drop_legacy_local_rank(sys.argv[1:])
    prog = os.path.basename(sys.argv[0])
    try:
        help_text = _help_for(main, prog, argv)
        if help_text is not None:
            print(help_text)
            return
        if isinstance(main, dict):  # sub-commands: `prog NAME --flags` runs main[NAME]
            if argv[0] not in main:
                raise RecipeError(f"unknown command {argv[0]!r}; choose one of: {', '.join(main)}")
            prog, main, argv = f"{prog} {argv[0]}", main[argv[0]], argv[1:]
        main = as_command(main)
        argv = prepare_argv(main, expand_preset(argv, presets or {}))
        fire.Fire(main, command=argv, name=prog)
        _exit_after_distributed_run()
    except RecipeError as err:
        _close_progress_bars()
        rank = os.environ.get("RANK", "0")
        prefix = "error" if rank == "0" else f"error (rank {rank})"
        _print_line(f"{prefix}: {err}")
        sys.exit(2)
    except Preempted as stop:
        _close_progress_bars()
        if os.environ.get("RANK", "0") == "0":
            _print_line(f"stopped: {stop}")
        sys.exit(PREEMPTED_EXIT_CODE)
    except Exception as err:
        if "torch" not in sys.modules:
            raise
        from accelerate_recipes.compiling import TROUBLESHOOTING, compile_failure, failure_cause

        if not compile_failure(err):
            raise
        # a compilation asked for (--compile, a launcher's
        # --dynamo_backend) that failed: one line, no traceback
        _close_progress_bars()
        rank = os.environ.get("RANK", "0")
        prefix = "error" if rank == "0" else f"error (rank {rank})"
        cause = failure_cause(err)
        _print_line(
            f"{prefix}: torch.compile failed ({cause}); see {TROUBLESHOOTING}, or run without --compile"
        )
        sys.exit(2)
