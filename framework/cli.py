"""The `batchyard` command line.

    batchyard serve --config serve.toml [--server.port 8000 ...]
    batchyard generate "The capital of France is" --max-new-tokens 16
    batchyard plugins
    batchyard plugins new shortest --kind policy
    batchyard config --defaults
    batchyard experiment run exp.toml

Every setting is also a flag, named after its dotted path: ``--scheduler.max-prefill-tokens 4096``.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import sys
import types
import typing
from typing import Any

from framework.config import Settings, SettingsError, iter_fields, render_default_toml
from framework.preload import restart_with_tcmalloc


def _flag(dotted: str) -> str:
    return "--" + dotted.replace("_", "-")


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML settings file")
    group = parser.add_argument_group("settings (override the TOML file and BATCHYARD_* env)")
    for dotted, info, ann in iter_fields():
        # argparse formats help with %: a description's own ("~40 % of") must be escaped
        help_text = (info.description or "").replace("%", "%%")
        kwargs: dict[str, Any] = {"dest": "set:" + dotted, "default": argparse.SUPPRESS, "help": help_text,
                                  "metavar": dotted.rsplit(".", 1)[-1].upper()}  # (not the dest's SET:...)
        base = _strip_optional(ann)
        if base is bool:
            kwargs.update(type=_parse_bool, metavar="BOOL")
        elif typing.get_origin(base) is list:
            kwargs.update(nargs="*")
        group.add_argument(_flag(dotted), **kwargs)


def _strip_optional(ann):
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return ann


def settings_from_args(args: argparse.Namespace) -> Settings:
    overrides: dict[str, dict[str, Any]] = {}
    for key, value in vars(args).items():
        if not key.startswith("set:"):
            continue
        section, field = key[4:].split(".", 1)
        if value == [""]:  # a list flag given `""` alone: empty, as `""` empties it in TOML and env
            value = ""
        overrides.setdefault(section, {})[field] = value
    return Settings.load(args.config, **overrides)


def cmd_plugins(args) -> int:
    from framework.plugins import PluginManager

    if args.action == "new":
        from framework.scaffold import write_skeleton

        if not args.name:
            raise ValueError("plugins new: give the plugin's name, e.g. `batchyard plugins new shortest`")
        root = write_skeleton(args.name, args.kind or "policy", args.dir)
        print(f"wrote {root}; next: pip install -e {root} && pytest {root}")
        return 0
    from framework.plugins import ALL_KINDS

    if args.kind is not None and args.kind not in ALL_KINDS:
        raise ValueError(f"plugins --kind: one of {', '.join(ALL_KINDS)}, got {args.kind!r}")
    settings = settings_from_args(args)
    manager = PluginManager(settings)
    print(f"{'kind':<10}{'name':<16}{'active':<8}source")
    for kind, name, active, note in manager.describe():
        if args.kind is None or kind == args.kind:
            print(f"{kind:<10}{name:<16}{'*' if active else '':<8}{note}")
    return 0


def cmd_config(args) -> int:
    if args.defaults:
        sys.stdout.write(render_default_toml())
    else:
        from framework.plugins import PluginManager

        settings = settings_from_args(args)
        PluginManager(settings)  # the plugin selection and [plugin.*] sections, checked as at start-up
        dumped = json.loads(settings.model_dump_json(warnings=False))  # (plugin sections are models now)
        for section, name in (("server", "api_key"), ("parallel", "dist_secret")):
            if dumped[section].get(name):
                dumped[section][name] = "<redacted>"  # (as /get_server_info shows them)
        print(json.dumps(dumped, indent=2))
    return 0


def cmd_generate(args) -> int:
    from framework.engine import Engine

    settings = settings_from_args(args)
    with Engine(settings) as engine:
        prompt = args.prompt
        if args.chat:
            if getattr(engine.tokenizer, "chat_template", None) is None:
                raise ValueError("--chat needs a chat template, and this model's tokenizer has none "
                                 "(model.tokenizer_path names another tokenizer)")
            messages = [{"role": "user", "content": prompt}]
            prompt = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        params = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
        out = engine.generate(prompt, params)
    print(out["text"])
    print(json.dumps(out["meta_info"]), file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    settings = settings_from_args(args)
    try:
        from framework.server.launch import serve
    except ImportError:
        print("the HTTP server is not available in this build", file=sys.stderr)
        return 2
    return serve(settings)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> typing.NoReturn:
        """The error and where the options are, without the usage line: with every setting a
        flag, it ran to ~80 lines above the one that matters."""
        self.exit(2, f"{self.prog}: error: {message}\n(`{self.prog} --help` lists the options)\n")


def build_parser() -> argparse.ArgumentParser:
    # No abbreviations: `--server.por 8000` would set server.port, and a flag added later could
    # change what an abbreviation in someone's script means. Subparsers are of the same class.
    parser = _Parser(prog="batchyard", description="LLM serving engine with a plugin scheduler")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="start the HTTP server")
    add_settings_flags(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("generate", help="one-shot generation with the offline engine")
    p.add_argument("prompt")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_settings_flags(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser(
        "plugins", help="list installed plugins and mark the active ones; `plugins new NAME` writes a skeleton"
    )
    p.add_argument("action", nargs="?", choices=["new"], help="new: write a plugin package skeleton")
    p.add_argument("name", nargs="?", help="the new plugin's name (its entry point)")
    p.add_argument("--kind", default=None,
                   help="the new plugin's kind: policy (the default) or observer; listing: only that kind's plugins")
    p.add_argument("--dir", default=".", help="where to write the package folder")
    add_settings_flags(p)
    p.set_defaults(func=cmd_plugins)

    p = sub.add_parser("config", help="print the effective settings, or the commented defaults")
    p.add_argument("--defaults", action="store_true", help="print the commented default TOML")
    add_settings_flags(p)
    p.set_defaults(func=cmd_config)

    from framework.bench.cli import add_bench_parser  # imported here: bench.cli uses this module
    add_bench_parser(sub)
    from framework.sim.cli import add_sim_parser
    add_sim_parser(sub)
    from framework.experiment.cli import add_experiment_parser
    add_experiment_parser(sub)
    return parser


def command_parser(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The (sub)parser that `argv` selects: `batchyard bench offline ...` -> bench offline's."""
    for token in argv:
        subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not token.startswith("-") and subparsers and token in subparsers[0].choices:
            parser = subparsers[0].choices[token]
    return parser


def unrecognized_message(unknown: list[str], parser: argparse.ArgumentParser) -> str:
    """argparse's "unrecognized arguments" with the flags each unknown one probably meant: a
    settings flag named by its last part (`--port` -> `--server.port`), else the closest spellings."""
    flags = sorted({s for a in parser._actions for s in a.option_strings if s.startswith("--")})
    hints = []
    for arg in unknown:
        name = arg.split("=", 1)[0]
        if not name.startswith("--"):
            continue
        meant = [f for f in flags if f.rsplit(".", 1)[-1] == name[2:] and "." in f]
        meant = meant or difflib.get_close_matches(name, flags, n=3, cutoff=0.75)
        if meant:
            hints.append(f"{name}: did you mean {' or '.join(meant)}?")
    return " ".join([f"unrecognized arguments: {' '.join(unknown)}", *[f"({h})" for h in hints]])


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the `batchyard` command itself, not a call from Python
        try:
            restart_with_tcmalloc()
        except ValueError as exc:
            print(f"batchyard: {exc}", file=sys.stderr)
            return 2
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        command = command_parser(parser, sys.argv[1:] if argv is None else argv)
        command.error(unrecognized_message(unknown, command))
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s %(name)s] %(message)s", datefmt="%H:%M:%S")
    try:
        return args.func(args)
    except (SettingsError, ValueError) as exc:
        print(f"batchyard: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: what was running has stopped (and cleaned up on its way out)
        print("batchyard: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
