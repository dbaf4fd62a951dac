"""The `kubetrain` command: parse arguments, call the library, print. No logic of its own."""

from __future__ import annotations

import errno
import json
import os
import sys
import traceback
from typing import Any, NoReturn

import typer

from kubetrain.distributed.peers import lost_peer
from kubetrain.errors import (
    EXIT_BAD_INPUT,
    EXIT_FAILURE,
    KubetrainError,
    TrainingFailed,
    TrainingStopped,
    UserInputError,
)
from kubetrain.launch.elastic import last_error, record_worker_error, worker_exit_code

app = typer.Typer(
    name="kubetrain",
    help="Train and fine-tune decoder-only language models from one YAML config.",
    no_args_is_help=False,
    add_completion=False,
    pretty_exceptions_enable=False,
    # click's plain help: typer's rich panels print a "<bool>" value hint after every flag (--help too)
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        import torch

        from kubetrain import __version__

        typer.echo(f"kubetrain {__version__} (torch {torch.__version__}, Python {sys.version.split()[0]})")
        raise typer.Exit()


@app.callback()
def _options(
    version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                 help="Print kubetrain's version (and torch's) and exit."),
    debug: bool = typer.Option(False, "--debug", help="On an error, show the traceback too (anywhere on the line; "
                               "or KUBETRAIN_DEBUG=1)."),
) -> None:
    # --debug is read by main() from anywhere in the arguments (it never reaches here): listed for --help
    """Train and fine-tune decoder-only language models from one YAML config."""


# Packages of the optional extras (pyproject.toml), for a one-line hint when one is missing.
OPTIONAL_EXTRAS = {
    "transformers": "hf", "peft": "hf", "datasets": "hf", "accelerate": "hf",
    "mlflow": "track", "tensorboard": "track", "prometheus_client": "track",
    "psycopg": "postgres", "psycopg2": "postgres",
    "kubernetes": "k8s", "kubernetes_validate": "k8s", "jsonschema": "k8s",
    "gguf": "export", "tiktoken": "tiktoken",
    "fsspec": "storage", "s3fs": "storage",
}


# OSErrors about a path the user gave (an output folder on a read-only mount, a file where a folder belongs): bad
# input, one line. Raised while training they were already turned into one line by the Trainer (exit 1).
PATH_ERRORS = {errno.ENOENT, errno.EACCES, errno.EPERM, errno.EROFS, errno.EEXIST, errno.EISDIR, errno.ENOTDIR,
               errno.ENAMETOOLONG, errno.ELOOP}


def _register() -> None:
    from kubetrain.cli import (
        config_cmd,
        data_cmd,
        doctor_cmd,
        export_cmd,
        generate_cmd,
        k8s_cmd,
        platform_cmd,
        runs_cmd,
        train_cmd,
    )

    train_cmd.register(app)
    data_cmd.register(app)
    generate_cmd.register(app)
    export_cmd.register(app)
    doctor_cmd.register(app)
    app.add_typer(config_cmd.app, name="config")
    app.add_typer(runs_cmd.app, name="runs")
    k8s_cmd.app.add_typer(platform_cmd.app, name="platform")
    app.add_typer(k8s_cmd.app, name="k8s")


def _click_class(name: str) -> Any:
    """click's exception class `name`, wherever this typer takes click from: typer 0.12-0.2x import click, later ones
    carry their own copy (typer._click); typer.BadParameter is a UsageError of whichever it is."""
    module = sys.modules[typer.BadParameter.__module__]
    found = getattr(module, name, None)
    if found is None:  # NoArgsIsHelpError is click 8.2's: before it a group's help was an Exit
        return next((c for c in typer.BadParameter.__mro__ if c.__name__ == name), _NeverRaised)
    return found


class _NeverRaised(Exception):
    pass


USAGE_ERROR = _click_class("UsageError")
CLICK_EXCEPTION = _click_class("ClickException")
NO_ARGS_IS_HELP = _click_class("NoArgsIsHelpError")


def main(argv: list[str] | None = None) -> None:
    """Entry point: user errors become one line on stderr and an exit code; --debug shows the traceback."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or os.environ.get("KUBETRAIN_DEBUG") == "1"
    args = [a for a in args if a != "--debug"]
    # --json: one JSON object on stdout whatever happens; a failure's is {"error": ..., "exit": N} (a script reads
    # stdout only). Workers under the launcher print none: their launcher speaks for the job.
    as_json = "--json" in args and "LOCAL_RANK" not in os.environ
    if not app.registered_commands:  # main() may run more than once in one process (tests, notebooks)
        _register()
    try:
        # not standalone: click's three-line usage form for a mistyped flag or command becomes our one line
        code = app(args=args, prog_name="kubetrain", standalone_mode=False)
        code = code if isinstance(code, int) else 0
        if as_json and code != 0:  # the launcher's exit: its error line was said on stderr
            _json_line({"error": last_error() or f"exited with code {code}", "exit": code})
        sys.exit(code)
    except NO_ARGS_IS_HELP as e:  # a group with no subcommand: its help, as before
        e.show()
        sys.exit(e.exit_code)
    except USAGE_ERROR as e:
        ctx = getattr(e, "ctx", None)
        where = f" (see '{ctx.command_path} -h')" if ctx is not None else ""
        message = e.format_message().rstrip(".")
        _bad_input(message[:1].lower() + message[1:] + where, as_json)
    except CLICK_EXCEPTION as e:
        print(f"error: {e.format_message()}", file=sys.stderr, flush=True)
        if as_json:
            _json_line({"error": e.format_message(), "exit": e.exit_code})
        sys.exit(e.exit_code)
    except typer.Abort:  # Ctrl-C at a prompt
        print("Aborted!", file=sys.stderr, flush=True)
        sys.exit(1)
    except TrainingStopped as e:  # asked for, and resumable: not an error; global rank 0 says it for the job
        if debug:
            traceback.print_exc()
        if os.environ.get("RANK", "0") == "0":
            print(str(e), file=sys.stderr, flush=True)
        if as_json:
            _json_line({"stopped": str(e), "exit": e.exit_code})
        sys.exit(e.exit_code)
    except KubetrainError as e:
        if debug:
            traceback.print_exc()
        record_worker_error(e)
        _failed(str(e), worker_exit_code(e), as_json)
    except ModuleNotFoundError as e:
        extra = OPTIONAL_EXTRAS.get((e.name or "").split(".")[0])
        if extra is None:
            record_worker_error(e)
            _bug(e, as_json)
            raise
        if debug:
            traceback.print_exc()
        _bad_input(f"this needs the optional package '{e.name}': pip install 'kubetrain[{extra}]'", as_json)
    except OSError as e:
        if e.errno not in PATH_ERRORS or e.filename is None:  # not a path the user named: a bug or the machine
            record_worker_error(e)
            _bug(e, as_json)
            raise
        if debug:
            traceback.print_exc()
        _bad_input(f"{e.strerror}: {e.filename}", as_json)
    except RuntimeError as e:  # torch.distributed's errors are RuntimeErrors
        lost = lost_peer(e)
        if lost is None:  # a bug: keep the traceback, and tell the elastic launcher which rank failed
            record_worker_error(e)
            _bug(e, as_json)
            raise
        if debug:
            traceback.print_exc()
        record_worker_error(TrainingFailed(lost))
        _failed(lost, EXIT_FAILURE, as_json)
    except Exception as e:  # a bug: keep the traceback, and tell the elastic launcher which rank failed
        record_worker_error(e)
        _bug(e, as_json)
        raise


def _failed(message: str, code: int, as_json: bool) -> NoReturn:
    """The one `error:` line (a worker under the launcher leaves it to the launcher), --json's object, the exit."""
    if not _launcher_says_it():
        print(f"error: {message}", file=sys.stderr, flush=True)
    if as_json:
        _json_line({"error": message, "exit": code})
    sys.exit(code)


def _launcher_says_it() -> bool:
    """A worker under the elastic launcher: its error goes to the launcher's error file, and the launcher says the
    first failure's line once for the job (each worker saying it too printed it once per rank, and again)."""
    return "LOCAL_RANK" in os.environ and bool(os.environ.get("TORCHELASTIC_ERROR_FILE"))


def _bad_input(message: str, as_json: bool = False) -> NoReturn:
    """One `error:` line and exit 2; under the elastic launcher, also the line its failure summary repeats."""
    record_worker_error(UserInputError(message))
    if not _launcher_says_it():
        print(f"error: {message}", file=sys.stderr, flush=True)
    if as_json:
        _json_line({"error": message, "exit": EXIT_BAD_INPUT})
    sys.exit(EXIT_BAD_INPUT)


def _bug(e: BaseException, as_json: bool) -> None:
    """A bug's traceback goes to stderr as Python prints it; --json still gets its one object."""
    if as_json:
        _json_line({"error": f"{type(e).__name__}: {e} (a bug in kubetrain: the traceback is on stderr)",
                    "exit": EXIT_FAILURE})


def _json_line(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)
