"""The ``meshplan`` command.

Heavy imports (torch, the planner, uvicorn) happen inside the subcommand that
needs them, so ``meshplan --help`` and argument errors are instant.  Every user
mistake ends as one line ``meshplan: error: ...`` on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sqlite3
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

EXIT_USAGE = 2


class UserError(Exception):
    """A mistake the user can fix; printed as one line, exit 2."""


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _out(text: str | None = None) -> None:
    """``print`` to stdout (``None``: flush it); a failed write (``> plan.json`` on a full
    disk) said in one line."""
    try:
        if text is None:
            sys.stdout.flush()
        else:
            print(text)
    except BrokenPipeError:
        raise  # the reader went away: main's handling
    except OSError as e:
        # what stays buffered would fail again in the interpreter's exit flush, with a traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise UserError(f"stdout: cannot write: {e.strerror or e}") from None


def _require(module: str, name: str) -> Any:
    """``module.name``, or a one-line error while that piece of meshplan is missing."""
    import importlib

    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise UserError(f"{module}.{name} is not available yet in this install ({e})") from None


def parse_mesh(text: str) -> dict[str, int]:
    """``dp=8,tp=8`` -> {"dp": 8, "tp": 8}, within the HTTP API's limits (service.limits)."""
    from pydantic import TypeAdapter, ValidationError

    from service.limits import MeshShape

    mesh: dict[str, int] = {}
    for part in text.split(","):
        name, sep, size = part.strip().partition("=")
        if not sep or not name or not size.isdigit():
            raise argparse.ArgumentTypeError(f"{part!r} is not NAME=SIZE (e.g. dp=8,tp=8)")
        if name in mesh:
            raise argparse.ArgumentTypeError(f"dim {name!r} given twice")
        mesh[name] = int(size)
    try:
        return TypeAdapter(MeshShape).validate_python(mesh)
    except ValidationError as e:
        first = e.errors()[0]
        where = first["loc"][0] if first["loc"] else "mesh"
        raise argparse.ArgumentTypeError(f"{where}: {first['msg']} (NAME=SIZE, e.g. dp=8,tp=8)") from None


def _limited(kind_name: str) -> Callable[[str], Any]:
    """An argparse type checking a value against the HTTP API's bound ``kind_name`` in
    service.limits, so the CLI plans nothing the service would refuse."""

    def parse(text: str) -> Any:
        from service import limits

        try:
            return limits.parse_text(getattr(limits, kind_name), text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


WORKERS_PER_CPU = 4


def _workers(text: str) -> int:
    """A worker is a process importing torch (~0.5 GB) that keeps a core busy while it
    solves: past a few per core they only queue on the cores, and 1000 of them took a
    2-core machine down (review)."""
    n, cpus = _positive(text), os.cpu_count() or 1
    if n > WORKERS_PER_CPU * cpus:
        raise argparse.ArgumentTypeError(f"{n} is more than {WORKERS_PER_CPU} per CPU ({WORKERS_PER_CPU * cpus} "
                                         f"on this machine's {cpus}); each worker is a process of ~0.5 GB")
    return n


def _port(text: str) -> int:
    if not text.isdigit() or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (0 to 65535; 0: any free port)")
    return int(text)


def _workload(args: argparse.Namespace) -> tuple[int, int]:
    from planner.search import default_shape

    return default_shape(args.model, args.devices, args.batch_size, args.seq_len)


# -- subcommands -----------------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> None:
    import uvicorn

    from service.app import create_app
    from service.store import default_db_path

    if args.db == "":  # Path("") is the current directory: "--db: . is a directory"
        raise UserError("--db: empty path")
    db = Path(args.db) if args.db is not None else default_db_path()
    if args.db is not None and not db.parent.is_dir():  # a typo would start an empty store elsewhere
        raise UserError(f"--db: directory {db.parent} does not exist")
    _check_listen(args.host, args.port)
    try:
        app = create_app(db, workers=args.workers, default_time_limit_s=args.time_limit)
    except (OSError, sqlite3.Error) as e:  # opened here, before uvicorn starts
        problem = "is a directory" if db.is_dir() else f"cannot be used as an SQLite plan store ({e})"
        raise UserError(f"--db: {db} {problem}") from None
    where = (f"http://{args.host}:{args.port}/" if args.port else
             f"http://{args.host}:<port>/ (port 0: the OS picks one; uvicorn's line below names it)")
    _progress(f"meshplan: plans stored in {db}; viewer at {where}")
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


def _check_listen(host: str, port: int) -> None:
    """A taken port or an unknown host as one line before anything starts, instead of
    uvicorn's log after the workers were spawned.  (Racy by nature: the port can still
    be taken in between, which uvicorn then reports.)"""
    try:
        family, kind, proto, _name, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise UserError(f"--host: cannot resolve {host!r} ({e.strerror})") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as e:
            raise UserError(f"--port: cannot listen on {host}:{port} ({e.strerror})") from None


def _check_profile(args: argparse.Namespace) -> None:
    """``--profile`` read before torch is imported and the model traced (seconds)."""
    _require("cost_model.profile", "load_profile")(args.profile)


def _check_plan(args: argparse.Namespace) -> None:
    _check_profile(args)
    _check_output(args)


def _check_output(args: argparse.Namespace) -> None:
    """``-o``: fail before minutes of work, not after."""
    if args.output is None:
        return
    path = Path(args.output)
    if not args.output:
        raise UserError("-o: empty path")
    if path.is_dir():
        raise UserError(f"-o: {path} is a directory")
    if path.parent.exists() and not path.parent.is_dir():
        raise UserError(f"-o: {path.parent} is not a directory")
    if not path.parent.is_dir():
        raise UserError(f"-o: directory {path.parent} does not exist")
    for name in ("model", "profile"):  # plan X.json -o X.json wrote the plan over the config (audit)
        if not isinstance(value := getattr(args, name, None), str) or not value:
            continue
        given = Path(value) / "config.json" if Path(value).is_dir() else Path(value)  # a model directory's
        if path.is_file() and given.is_file() and path.samefile(given):
            flag = "MODEL" if name == "model" else "--profile"
            raise UserError(f"-o: {path} is the file given as {flag}; writing there would overwrite it")
    # create it: permission bits say nothing for root, or on /proc and read-only mounts
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except FileExistsError:  # a file, or a link: left as it is
        target = path.resolve()
        try:
            if target.is_file():
                with target.open("a"):
                    pass
            elif not os.access(target.parent, os.W_OK):
                raise PermissionError(13, "Permission denied")
        except OSError as e:
            raise UserError(f"-o: cannot write {path}: {e.strerror}") from None
    except OSError as e:
        raise UserError(f"-o: cannot write {path}: {e.strerror}") from None
    else:
        os.close(fd)
        path.unlink()


def cmd_plan(args: argparse.Namespace) -> None:
    plan_fn = _require("planner", "plan")
    batch, seq = _workload(args)
    plan = plan_fn(args.model, devices=args.devices, profile=args.profile, batch_size=batch,
                   seq_len=seq, mesh=args.mesh, time_limit_s=args.time_limit, progress=_progress)
    text = plan.to_json()
    if args.output is not None:
        _write(args.output, text + "\n")
        _progress(f"wrote {args.output}")
    else:
        _out(text)


def cmd_estimate(args: argparse.Namespace) -> None:
    hand_plan = _require("planner", "hand_plan")  # planner.estimate's plan: its stages are shown too
    batch, seq = _workload(args)
    microbatches = args.microbatches or args.pp  # planner.hand_plan's default, shown in the output
    try:
        plan = hand_plan(args.model, args.devices, args.profile, dp=args.dp, tp=args.tp, pp=args.pp,
                         fsdp=args.fsdp, sp=args.sp, microbatches=microbatches,
                         checkpointing=args.checkpointing, schedule=args.schedule,
                         virtual_stages=args.virtual_stages, batch_size=batch, seq_len=seq,
                         require_fit=False,  # a layout that does not fit is reported, fits false
                         progress=_progress)
    except ValueError as e:
        if args.microbatches is None and microbatches > 1 and "microbatches" in str(e):
            raise UserError(f"{e} (--microbatches defaults to --pp={args.pp}; give the count to use)") from None
        raise
    if args.json:
        layout = {"dp": args.dp, "tp": args.tp, "pp": args.pp, "fsdp": args.fsdp, "sp": args.sp,
                  "microbatches": microbatches, "checkpointing": args.checkpointing,
                  "schedule": args.schedule or ("1f1b" if args.pp > 1 else None), "virtual_stages": args.virtual_stages}
        stages = {"stages": plan.pipeline.model_dump(mode="json")["stages"]} if plan.pipeline else {}
        _out(json.dumps({"batch_size": batch, "seq_len": seq, "layout": layout, **estimate_json(plan.prediction),
                         **stages}, indent=2))
    else:
        from service.terminal import render_pipeline, render_prediction

        layout = " x ".join(f"{n}={v}" for n, v in (("pp", args.pp), ("dp", args.dp), ("tp", args.tp)) if v > 1)
        extras = [w for w, on in (("fsdp", args.fsdp), ("sp", args.sp)) if on]
        if args.checkpointing != "none":
            extras.append(f"{args.checkpointing} checkpointing")
        profile = _require("cost_model.profile", "load_profile")(args.profile).name
        schedule = (f", {args.schedule or '1f1b'}"
                    f"{f' ({args.virtual_stages} virtual stages)' if args.virtual_stages > 1 else ''}"
                    if args.pp > 1 else "")
        _out(f"{args.model} on {args.devices} x {profile}: {layout or 'one device'}"
             f"{' ' + '+'.join(extras) if extras else ''}, batch {batch} x seq {seq}, "
             f"{microbatches} micro-batch(es){schedule}")
        _out(render_prediction(plan.prediction))
        if plan.pipeline is not None:
            _out(render_pipeline(plan))


def estimate_json(pred: Any) -> dict[str, Any]:
    """The flat figures SPEC promises, plus the full breakdown."""
    return {
        "step_time_s": pred.time.step_time_s,
        "tokens_per_s_per_device": pred.tokens_per_s_per_device,
        "mfu": pred.mfu,
        "peak_memory_bytes_per_device": pred.memory.total,
        "fits": pred.memory.fits,
        "breakdown": {"time": pred.time.model_dump(), "memory": pred.memory.model_dump()},
    }


def cmd_show(args: argparse.Namespace) -> None:
    from pydantic import ValidationError

    from planner.schema import Plan, plan_data
    from service.terminal import render_plan

    if not args.plan:  # Path("") is the current directory: "cannot read : Is a directory" (audit)
        raise UserError("plan: empty path")
    try:
        text = Path(args.plan).read_text()
    except OSError as e:
        raise UserError(f"plan: cannot read {args.plan}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"plan: {args.plan} is not UTF-8 text (byte {e.object[e.start]:#04x} at "
                        f"position {e.start})") from None
    try:
        data = json.loads(text)
    except ValueError as e:  # not JSON, or a number past Python's int digits limit (its advice cut)
        raise UserError(f"plan: {args.plan} is not JSON: {str(e).split(';')[0]}") from None
    try:
        plan = Plan.model_validate(data := plan_data(data))  # a plan, or a saved service response
    except ValidationError as e:
        from cost_model.profile import problem_lines

        lines = problem_lines(e, data)  # a model validator's message names its field itself
        raise UserError(f"{args.plan}: {lines[0]} ({len(lines)} problem(s))") from None
    # What the schema lets through and apply would refuse (S(9) of a matrix), which the
    # view would index out of range; the plan's fingerprint has the shapes.
    problems = plan.fingerprint_problems()
    if problems:
        raise UserError(f"{args.plan}: {problems[0]} ({len(problems)} problem(s))")
    _out(render_plan(plan))


def cmd_profiles(_args: argparse.Namespace) -> None:
    shipped = _require("cost_model.profile", "shipped_profiles")
    load = _require("cost_model.profile", "load_profile")
    # One line per profile with the figures that decide plans; the provenance is in each
    # profile's `source` (GET /v1/profiles/{name}, or the JSON under profiles/).
    rows = []
    for name in shipped():
        prof = load(name)
        # the peak plans are priced at: fp32 on CPUs, bf16 on GPUs (planner.search._training_dtype)
        dtype = "fp32" if prof.device_type == "cpu" else "bf16"
        if dtype not in prof.peak_flops:
            dtype = max(prof.peak_flops, key=prof.peak_flops.get)
        peak = prof.peak_flops[dtype]
        # a CPU's 0.07 TFLOP/s was a digit wider than a GPU's figure, and pushed its row out of line
        unit, scale = ("TFLOP/s", 1e12) if peak >= 1e12 else ("GFLOP/s", 1e9)
        levels = ", ".join(f"{lv.name} {lv.devices or 'any'} @ {lv.busbw.all_reduce / 1e9:.3g} GB/s"
                           for lv in prof.levels)
        rows.append((name, prof.device_type, f"{prof.memory_bytes / 2**30:.1f} GiB",
                     f"{peak / scale:.4g} {unit} {dtype:4}", levels))
    header = ("name", "device", "memory", "peak", "network (devices @ all-reduce busbw)")
    # widths from the cells: names, sizes and peaks of any length stay in their columns;
    # the figures right-aligned so their units line up
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header) - 1)]
    right = (False, False, True, True)
    for row in (header, *rows):
        cells = [c.rjust(w) if r else c.ljust(w) for c, w, r in zip(row, widths, right, strict=False)]
        _out("  ".join([*cells, row[-1]]))


def cmd_calibrate(args: argparse.Namespace) -> None:
    calibrate = _require("cost_model.calibrate", "calibrate")
    output = Path(args.output)
    try:
        calibrate(output, progress=_progress)
    except OSError as e:
        if e.filename is not None and Path(e.filename) == output:
            raise UserError(f"-o: cannot write {output}: {e.strerror}") from None
        raise UserError(f"calibrate: {e.strerror or e}") from None


def cmd_schema(_args: argparse.Namespace) -> None:
    from planner.schema import plan_json_schema

    _out(json.dumps(plan_json_schema(), indent=2))


def _write(path: str, text: str) -> None:
    try:
        Path(path).write_text(text)
    except OSError as e:
        raise UserError(f"-o: cannot write {path}: {e.strerror}") from None


# -- parser ---------------------------------------------------------------------
def _workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="preset name or path to a Hugging Face config.json")
    p.add_argument("--devices", type=_limited("Devices"), required=True, help="number of devices")
    p.add_argument("--profile", required=True, help="shipped profile name or path to a profile JSON")
    p.add_argument("--batch-size", type=_limited("BatchSize"),
                   help="global batch in sequences (default: one per device)")
    p.add_argument("--seq-len", type=_limited("SeqLen"),
                   help="sequence length (default: the model's max positions, at most 4096)")


def _version() -> str:
    """The installed distribution's version; a source tree run without ``pip install``
    has no metadata to read, and says so rather than guess."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"meshplan {version('meshplan')}"
    except PackageNotFoundError:
        return "meshplan (version unknown: not installed; pip install -e . records it)"


class _VersionRequested(Exception):
    """``--version`` given: main prints it as a subcommand's output, with a closed or full
    stdout handled as for any other (argparse's own action runs inside parse_args)."""


class _VersionAction(argparse.Action):
    """The metadata is read only when asked: importlib.metadata and the lookup took ~25 ms
    off every start, ``--help`` included."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        raise _VersionRequested


def cmd_version(_args: argparse.Namespace) -> None:
    _out(_version())


def _no_checks(_args: argparse.Namespace) -> None:
    """Subcommands whose arguments need no check beyond argparse's."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshplan", description="Plan, estimate and view sharding plans for distributed PyTorch "
        "training, and serve them over HTTP.")
    parser.add_argument("--version", action=_VersionAction, help="print meshplan's version and exit")
    parser.set_defaults(check=_no_checks)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("serve", help="run the planner service and plan viewer")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=_port, default=8000, help="TCP port (default: %(default)s)")
    p.add_argument("--db", help="SQLite plan store (default: $XDG_DATA_HOME/meshplan/plans.db)")
    p.add_argument("--workers", type=_workers, default=2,
                   help=f"planner worker processes, at most {WORKERS_PER_CPU} per CPU (default: %(default)s)")
    p.add_argument("--time-limit", type=_limited("TimeLimit"), default=60.0,
                   help="solver time limit in seconds when a request sets none (default: %(default)s)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default: %(default)s)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("plan", help="plan a model on a cluster, print or write the plan JSON")
    _workload_args(p)
    p.add_argument("--mesh", type=parse_mesh, help="force a mesh, e.g. dp=8,tp=8 (default: search)")
    p.add_argument("--time-limit", type=_limited("TimeLimit"),
                   help="seconds for the whole mesh search, tracing aside; meshes left are skipped (default: none)")
    p.add_argument("-o", "--output", help="write the plan here instead of printing it")
    p.set_defaults(func=cmd_plan, check=_check_plan)

    p = sub.add_parser("estimate", help="predict step time and memory of one configuration")
    _workload_args(p)
    p.add_argument("--dp", type=_positive, required=True, help="data-parallel degree")
    p.add_argument("--tp", type=_positive, required=True, help="tensor-parallel degree")
    p.add_argument("--pp", type=_positive, default=1, help="pipeline stages (default: %(default)s)")
    p.add_argument("--fsdp", action="store_true", help="shard parameters and optimizer state over dp")
    p.add_argument("--sp", action="store_true", help="sequence parallel activations over tp")
    p.add_argument("--microbatches", type=_positive,
                   help="micro-batches per step and data-parallel rank (gradient accumulation, or "
                   "pipeline micro-batches; default: pp, the fewest that keep every stage busy)")
    p.add_argument("--checkpointing", choices=["none", "selective", "full"], default="none",
                   help="activation checkpointing (default: %(default)s)")
    p.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved-1f1b"],
                   help="pipeline schedule, with --pp > 1 (default: 1f1b)")
    p.add_argument("--virtual-stages", type=_positive, default=1,
                   help="pipeline stages per rank: 2 or more with --schedule interleaved-1f1b, 1 with the "
                   "others (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_estimate, check=_check_profile)

    p = sub.add_parser("show", help="terminal view of a plan.json")
    p.add_argument("plan", help="path to a plan JSON")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("profiles", help="list shipped hardware profiles")
    p.set_defaults(func=cmd_profiles)

    # the user should know before starting it that it takes minutes and wants the machine
    # to itself (cost_model.calibrate: ~2 minutes on 2 cores; other load skews what it measures)
    p = sub.add_parser(
        "calibrate", help="measure this machine into a profile JSON (takes a few minutes)",
        description="Measure this machine into a profile JSON: GEMMs, memory copies, op dispatch and "
        "gloo collectives in 4 local processes. Takes a few minutes (about 2 on 2 cores) with every "
        "core busy; run it on an otherwise idle machine, as other work changes what it measures.")
    p.add_argument("-o", "--output", required=True, help="profile JSON to write")
    p.set_defaults(func=cmd_calibrate, check=_check_output)

    p = sub.add_parser("schema", help="print the plan JSON Schema")
    p.set_defaults(func=cmd_schema)
    for p in sub.choices.values():
        p.set_defaults(flags=_flags(p))
    return parser


def _flags(p: argparse.ArgumentParser) -> dict[str, str]:
    """The planner's field name -> the flag it came from (``batch_size`` -> ``--batch-size``),
    so an error names what the user typed.  Positional arguments have no flag: ``model:``
    keeps its name, and so do the fields of a config or profile file."""
    flags = {a.dest: a.option_strings[0] for a in p._actions if a.option_strings and a.dest != "help"}
    if "time_limit" in flags:
        flags["time_limit_s"] = flags["time_limit"]  # planner.plan's argument
    return flags


def _one_line(e: Exception, args: argparse.Namespace) -> str:
    """The error as one ``where: problem`` line, ``where`` the flag the value came from
    where the planner names a field the CLI filled from one."""
    from pydantic import ValidationError

    if isinstance(e, ValidationError) and e.title == "Profile":  # the --profile file (or name)
        from cost_model.profile import problem_lines

        lines = problem_lines(e)
        return f"profile {args.profile}: {lines[0]} ({len(lines)} problem(s))"
    # The planner's ConfigError / PlanningError name the field; join any continuation lines.
    line = " ".join(str(e).split())
    field, sep, problem = line.partition(": ")
    flag = getattr(args, "flags", {}).get(field) if sep else None
    return f"{flag}: {problem}" if flag else line


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except _VersionRequested:
        args = argparse.Namespace(check=_no_checks, func=cmd_version)
    check: Callable[[argparse.Namespace], None] = args.check
    func: Callable[[argparse.Namespace], None] = args.func
    try:
        check(args)
        func(args)
        _out()  # flushed: a closed pipe or a full disk shows here, not as a message at exit
    except (UserError, ValueError, FileNotFoundError) as e:
        print(f"meshplan: error: {_one_line(e, args)}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        # The reader went away (`meshplan plan ... | head`): the standard handling from
        # Python's signal docs, so the interpreter's exit flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        print("meshplan: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
