"""Command line: ``planner plan``, ``planner compile``, ``planner presets``, ``planner profile``,
``planner compare``, ``planner calibrate``, ``planner colocate``.

Every error caused by the input (flags included) is one line on stderr, ``error: ...``, and
exit status 2; an unexpected failure inside soap-planner is one line too (exit 3), with the
traceback under ``--debug``. Flags and output paths are checked before any tracing, search
or measurement starts, so a typo costs nothing.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import traceback
from typing import Sequence

from planner.arguments import OneLineParser, flag_type, integer_at_least, positive_finite
from planner.errors import ArgumentError, PlannerError
from planner.expert_layouts import MOE_DISPATCHES
from planner.outputs import refuse_input_as_output
from planner.cli_output import print_report, report_data, say, say_command, say_json, say_named_lines, status
from planner.colocation import add_colocate_command, run_colocate
from planner.terminal import inert_line
from planner.terminal_width import terminal_width

EXIT_USAGE = 2
EXIT_INTERNAL = 3


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="planner",
        description="Find, explain and compile the fastest way to train a PyTorch model on a cluster.",
        epilog="example: planner plan examples/gpt.py --cluster cpu:1x2 -o plan.json && "
        "planner compile plan.json -o out && torchrun --nproc_per_node 2 out/launch.py --check",
    )
    parser.add_argument("--debug", action="store_true", help="show the full traceback of unexpected errors")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    plan = commands.add_parser(
        "plan",
        help="plan a model for a cluster and print the report",
        description="Trace SPEC on meta tensors, choose a strategy for CLUSTER, print the report.",
    )
    plan.add_argument("spec", metavar="SPEC", help="path/to/model.py[:factory] (factory defaults to build) or hf:<model_type>")
    plan.add_argument(
        "--cluster",
        default="cpu",
        metavar="CLUSTER",
        help="PRESET, PRESET:NODES, PRESET:NODESxDEVICES (e.g. cpu:1x4, dgx-a100-80g:2) or a .toml/.json "
        "file (default: cpu, one host with 2 processes); see `planner presets`",
    )
    plan.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a factory argument or hf config field; repeatable (ints, floats, true/false parsed)",
    )
    plan.add_argument(
        "--search",
        choices=("auto", "ilp", "mcmc", "dp"),
        default="auto",
        help="auto: CP-SAT per mesh then MCMC refinement (default); ilp: CP-SAT only; mcmc: simulator-scored "
        "Metropolis-Hastings; dp: data parallelism only (DDP, ZeRO-1, ZeRO-2 or FSDP)",
    )
    plan.add_argument(
        "--tp-layouts", choices=("auto", "summa", "1d"), default="auto", dest="tp_layouts",
        help="tensor-parallel layouts of matmul-like ops: auto (1-D and 2-D/2.5-D/3-D SUMMA layouts compete, "
        "default), summa (SUMMA layouts wherever the mesh allows them, on SUMMA meshes only), 1d (1-D splits only)",
    )
    plan.add_argument(
        "--effort", default=1.0, metavar="X", type=flag_type(float, positive_finite, "a positive finite number"),
        help="how much work the search does (default 1; 0.25 quick, 4 thorough); budgets count work, not "
        "seconds, so the same model, cluster, seed and effort give the same plan on any machine",
    )
    plan.add_argument(
        "--time-budget", default=600.0, metavar="SECONDS",
        type=flag_type(float, positive_finite, "a positive finite number of seconds"),
        help="wall-clock safety cap of the whole run, tracing included (default 600); it only decides the plan "
        "if it cuts the search short, and the report then says so",
    )
    plan.add_argument(
        "--seed", default=0, type=flag_type(int, lambda value, name: integer_at_least(value, name, 0), "an integer >= 0"),
        help="seed of the MCMC search, an integer >= 0 (default 0)",
    )
    plan.add_argument(
        "--dp", choices=("ddp", "zero1", "zero2", "fsdp"), default=None,
        help="force data parallelism with this flavour: ddp (all replicated), zero1 (optimizer states sharded), "
        "zero2 (and gradients), fsdp (and weights); implies --search dp (another --search is an error)",
    )
    plan.add_argument(
        "--precision",
        choices=("auto", "fp32", "bf16", "fp16"),
        default="auto",
        help="training precision (default auto: bf16 on GPUs with bf16 tensor cores, else fp32; bf16/fp16: mixed precision with fp32 master weights); bf16 plans compile to "
        "programs that run forward under bf16 autocast, fp16 plans (which need loss scaling) are simulated only",
    )
    plan.add_argument(
        "--routing", default=None, metavar="ROUTING",
        help="routing statistics of the MoE layers, from which each layer's layout is chosen: uniform, zipf:ALPHA "
        "(a few hot experts, e.g. zipf:1.2) or a routing statistics JSON file (planner/routing.py; layers it does "
        "not cover are uniform); default: uniform",
    )
    plan.add_argument(
        "--moe-dispatch", choices=MOE_DISPATCHES, default="compiled", dest="moe_dispatch",
        help="the expert-parallel all-to-alls MoE plans may use: compiled (flat or two-level, what compiled programs "
        "run; default) or deduplicated (DeepEP's as well: each token crosses InfiniBand once per destination node; "
        "for a trainer that runs it, so its plans are simulated only) or overlapped (DeepEP's, and each layer's all-to-alls "
        "under another micro-batch's compute as Megatron-Core's EP overlap and DualPipe run them; simulated only)",
    )
    plan.add_argument(
        "--mesh", action="append", default=[], metavar="AXIS=SIZE",
        help="fix mesh axis sizes, e.g. --mesh tp=8 or --mesh dp=4,tp=2 (axes dp, tp, pp, row, col, dep; an axis "
        "a plan lacks has size 1, so tp=1 rules out tensor parallelism); repeatable",
    )
    plan.add_argument(
        "--max", action="append", default=[], metavar="AXIS=SIZE", dest="max_sizes",
        help="bound mesh axis sizes, e.g. --max pp=4; repeatable",
    )
    plan.add_argument(
        "--family", action="append", default=[], metavar="NAME[,NAME]", dest="families",
        help="only these parallelism families compete (see `planner families`), e.g. --family fsdp,tp,pipeline",
    )
    plan.add_argument(
        "-o", "--output", metavar="PLAN_JSON",
        help="save the plan as JSON (input of `planner compile`); an existing file is replaced only if it is a plan",
    )
    plan.add_argument("--force", action="store_true", help="let -o overwrite a file that is not a plan")
    plan.add_argument(
        "--co-runner", metavar="PLAN_JSON", dest="co_runner",
        help="a job that will share the devices (a plan saved by `planner plan -o` for the same cluster): choose "
        "the plan with the shortest round co-located with it that fits beside it (see `planner colocate`)",
    )
    _add_format(plan)
    _add_html(plan)

    compile_ = commands.add_parser(
        "compile",
        help="write the per-rank program of a plan",
        description="Write model_spmd.py, plan.json and launch.py for torchrun.",
    )
    compile_.add_argument("plan", metavar="PLAN_JSON", nargs="?", help="a plan saved by `planner plan -o`")
    compile_.add_argument(
        "--colocate", nargs=2, metavar=("A_JSON", "B_JSON"), default=None,
        help="instead of one plan: two data-parallel plans whose jobs share the devices, trained in one program "
        "(each job's gradient all-reduces under the other's compute)",
    )
    compile_.add_argument(
        "-o", "--output", required=True, metavar="DIR",
        help="output folder (created if missing); a folder compile wrote before is replaced, another non-empty "
        "folder is refused",
    )
    compile_.add_argument(
        "--force", action="store_true",
        help="write into a non-empty folder compile did not write (its other files are kept)",
    )

    simulate = commands.add_parser(
        "simulate",
        help="simulate a saved plan: step time, MFU, memory, exposed communication",
        description="Re-trace the plan's model on meta tensors and simulate one training step.",
    )
    simulate.add_argument("plan", metavar="PLAN_JSON", help="a plan saved by `planner plan -o`")
    simulate.add_argument("--trace", metavar="TRACE_JSON", help="write the timeline as a Chrome trace (open in ui.perfetto.dev)")
    simulate.add_argument("--force", action="store_true", help="let --trace overwrite a file that is not a Chrome trace")
    _add_format(simulate)

    explain = commands.add_parser(
        "explain",
        help="why an op, module or layer is placed as the plan says: each alternative's cost beside it",
        description="Re-trace the plan's model and cost every placement the search had for the ops named, "
        "with the other ops held where the plan put them.",
    )
    explain.add_argument("plan", metavar="PLAN_JSON", help="a plan saved by `planner plan -o`")
    which = explain.add_mutually_exclusive_group(required=True)
    which.add_argument("--op", metavar="NAME", help="one op by its node name, as --module's table lists them")
    which.add_argument("--module", metavar="PATH", help="the ops of a module and those under it (e.g. layers.0.attention)")
    which.add_argument("--layer", metavar="N", type=flag_type(int, lambda value, name: integer_at_least(value, name, 0), "an integer >= 0"),
                       help="the ops of the N-th repeated block (module paths holding .N.)")

    diff = commands.add_parser(
        "diff",
        help="what differs between two plans and its predicted effect on step time, memory and bytes",
        description="Compare two saved plans: settings, placements per module, expert layouts, and the "
        "predicted step time, memory and bytes per mesh axis.",
    )
    diff.add_argument("first", metavar="A_JSON", help="a plan saved by `planner plan -o`")
    diff.add_argument("second", metavar="B_JSON", help="another plan, usually of the same model")

    report = commands.add_parser(
        "report",
        help="print a saved plan's report again (no tracing, no simulation)",
        description="Print the report of a plan saved by `planner plan -o`, from the figures saved with it.",
    )
    report.add_argument("plan", metavar="PLAN_JSON", help="a plan saved by `planner plan -o`")
    _add_format(report)
    _add_html(report)
    report.add_argument("--measured", metavar="MEASURED_JSON",
                        help="with --html: a launch.py --profile measurement drawn against the prediction")
    report.add_argument("--force", action="store_true", help="let --html overwrite a file that is not a report")

    commands.add_parser("presets", help="list the cluster presets", description="List the built-in cluster presets.")
    commands.add_parser(
        "families", help="list the parallelism families --family chooses among",
        description="List the parallelism families a plan is made of (planner plan --family NAME[,NAME]).",
    )

    profile = commands.add_parser(
        "profile",
        help="measure this machine and write a cluster file",
        description="Measure matmul throughput per dtype, memory bandwidth, per-op overhead and all-reduce "
        "latency/bandwidth on this machine with N worker processes (as torchrun --nproc_per_node N), and "
        "write a cluster file whose numbers the planner uses (see cost_model/profile.py).",
    )
    profile.add_argument(
        "--nproc", default=2, metavar="N",
        type=flag_type(int, lambda value, name: integer_at_least(value, name, 2), "an integer >= 2"),
        help="worker processes on this host, >= 2 (collectives need two; default 2)",
    )
    profile.add_argument("--quick", action="store_true", help="fewer sizes and repetitions: faster, noisier")
    profile.add_argument(
        "--device", choices=("cpu", "cuda"), default=None, help="what to profile (default: cuda when available)"
    )
    profile.add_argument(
        "-o", "--output", required=True, metavar="CLUSTER_FILE",
        help="where to write it (.toml or .json); an existing file is replaced only if soap-planner wrote it",
    )
    profile.add_argument("--force", action="store_true", help="let -o overwrite a file soap-planner did not write")
    profile.add_argument(
        "--cluster", default=None, metavar="CLUSTER_FILE",
        help="with --group: a cluster of several device groups; -o gets it with that group's devices measured here",
    )
    profile.add_argument(
        "--group", default=None, metavar="DEVICE",
        help="with --cluster: the device group this host is one of (its device name in the file); run once on a "
        "node of each group",
    )
    add_measurement_commands(commands)
    add_colocate_command(commands)

    export = commands.add_parser(
        "export-checkpoint",
        help="write a training checkpoint's weights as one plain state_dict file",
        description="Gather the weights of a checkpoint saved by launch.py --checkpoint-dir (any plan, any world "
        "size) into one state_dict that loads into the model built from the spec (torch.load(..., weights_only=True)).",
    )
    export.add_argument("checkpoint", metavar="DIR", help="a step-<N> checkpoint folder, or the --checkpoint-dir (its latest)")
    export.add_argument(
        "-o", "--output", required=True, metavar="FILE",
        help="the state_dict file to write (e.g. model.pt); an existing file is replaced only if export-checkpoint wrote it",
    )
    export.add_argument("--force", action="store_true", help="let -o overwrite a file export-checkpoint did not write")
    return parser


def add_measurement_commands(commands) -> None:
    """``planner compare`` and ``planner calibrate`` (``planner.compare``)."""
    compare = commands.add_parser(
        "compare",
        help="show predicted against measured time per part, per collective and per step",
        description="Simulate PLAN and set its step, compute by op class and collectives beside what "
        "`launch.py --steps N --profile MEASURED` measured, with the error of each.",
    )
    compare.add_argument("plan", metavar="PLAN", help="a plan file (planner plan -o, or a compiled folder's plan.json)")
    compare.add_argument("measured", metavar="MEASURED", help="measured.json from launch.py --profile")
    compare.add_argument("--cluster", default=None, metavar="CLUSTER",
                         help="simulate on this cluster instead of the plan's (e.g. a calibrated.toml)")
    calibrate = commands.add_parser(
        "calibrate",
        help="fit the cost model's efficiencies to measured runs and write a cluster file",
        description="Fit the matmul and memory efficiencies, the per-kernel overhead and the link's latency and "
        "bandwidth of CLUSTER so the simulated step times of the measured plans match their measurements "
        "(see cost_model/calibration.py); write the calibrated cluster file.",
    )
    calibrate.add_argument("measured", metavar="MEASURED", nargs="+", help="measured.json files from launch.py --profile")
    calibrate.add_argument("--cluster", required=True, metavar="CLUSTER",
                           help="the cluster to calibrate: PRESET[:NODESxDEVICES] or a cluster file")
    calibrate.add_argument("-o", "--output", required=True, metavar="CLUSTER_FILE", help="where to write it (.toml or .json)")
    calibrate.add_argument("--force", action="store_true", help="let -o overwrite a file soap-planner did not write")


def _add_html(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--html", metavar="REPORT_HTML",
        help="also write the report as one self-contained page (plots, timeline, strategy tree; works offline)",
    )


def _add_format(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--format", choices=("text", "json"), default="text",
        help="text: the report sized to the terminal (default); json: the same sections as data, for scripts",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``planner`` and ``python -m planner``; returns the exit status."""
    options = argparse.Namespace(debug=False)
    try:
        options = build_parser().parse_args(argv)
        return _run(options)
    except PlannerError as error:
        print(f"error: {inert_line(error)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as error:  # noqa: BLE001 - the last line of defence against tracebacks
        if options.debug:
            traceback.print_exc()
        print(
            f"internal error: {type(error).__name__}: {inert_line(str(error).splitlines()[0]) if str(error) else ''} "
            f"(a bug in soap-planner: please report it; --debug shows the traceback)",
            file=sys.stderr,
        )
        return EXIT_INTERNAL


def _run(options: argparse.Namespace) -> int:
    handlers = {"plan": _plan, "simulate": _simulate, "explain": _explain, "profile": _profile, "compare": _compare,
                "calibrate": _calibrate, "export-checkpoint": _export_checkpoint, "colocate": run_colocate}
    if options.command in handlers:
        return handlers[options.command](options)
    if options.command == "presets":
        from planner.cluster import preset_table

        say_named_lines(preset_table())
        return 0
    if options.command == "families":
        from planner.families import family_table

        say_named_lines(family_table())
        return 0
    if options.command == "diff":
        from planner.plan_diff import render_diff
        from planner.plans import load_plan

        first, second = load_plan(options.first), load_plan(options.second)
        say(render_diff(first, second, (options.first, options.second), terminal_width()))
        return 0
    if options.command == "report":
        from planner.errors import PlanFileError
        from planner.plans import load_plan

        if options.measured is not None and options.html is None:
            raise ArgumentError("--measured is drawn in the HTML page only; add --html report.html")
        html_path = _check_html_output(options)
        plan = load_plan(options.plan)
        if plan.estimate.device_memory_bytes <= 0:  # built by hand or by a script, never simulated
            raise PlanFileError(f"{options.plan} holds no simulated figures to report; run "
                                f"`planner simulate {shlex.quote(options.plan)}` instead")
        print_report(plan, options.format)
        if html_path is not None:
            _write_html(options, plan, html_path)
        return 0
    if options.command == "compile":
        from planner.outputs import check_program_folder

        check_program_folder(options.output, force=options.force)  # before torch loads
        from planner.api import compile as compile_plan
        from planner.launch_command import first_run_command
        from planner.plans import load_plan

        if (options.plan is None) == (options.colocate is None):
            given = "both" if options.plan is not None else "neither"
            raise ArgumentError(f"compile takes one plan (PLAN_JSON) or two with --colocate A.json B.json, got {given}")
        if options.colocate is not None:
            from planner.api import compile_colocated

            out = compile_colocated(options.colocate, options.output, force=options.force)
            say(f"wrote {out}/job_a/, {out}/job_b/ (each job's own program) and {out}/launch.py (both, co-located)")
            from planner.launch_command import torchrun_parts

            parts = torchrun_parts(load_plan(out / "job_a" / "plan.json"), f"{out}/launch.py") + ["--steps", "5", "--check"]
            say_command("next: ", " ".join(parts))
            return 0
        plan = load_plan(options.plan)
        out = compile_plan(plan, options.output, force=options.force)
        say(f"wrote {out}/model_spmd.py, {out}/plan.json, {out}/launch.py")
        say_command("next: ", first_run_command(plan, f"{out}/launch.py"))
        return 0
    raise AssertionError(f"unhandled command {options.command}")


def _export_checkpoint(options: argparse.Namespace) -> int:
    from pathlib import Path

    from codegen.runtime.exported_weights import is_exported_state_dict
    from planner.outputs import check_output_file

    output = check_output_file(options.output, what="state_dict file", is_ours=is_exported_state_dict, force=options.force)
    if Path(options.checkpoint).resolve() in output.resolve().parents:
        raise ArgumentError(f"-o {output} is inside the checkpoint folder {options.checkpoint}; write the state_dict elsewhere")
    if not Path(options.checkpoint).is_dir():
        raise ArgumentError(f"no folder '{options.checkpoint}'; give a checkpoint folder written by launch.py --checkpoint-dir")
    from codegen.runtime.checkpoint import export_checkpoint

    step, count = export_checkpoint(Path(options.checkpoint), output)
    say(f"wrote {count} tensors (the weights after step {step}) to {output}")
    say(f"load them with model.load_state_dict(torch.load({str(output)!r}, weights_only=True))")
    return 0


def _plan(options: argparse.Namespace) -> int:
    from planner.cluster import Cluster
    from planner.outputs import check_output_file

    if options.dp is not None and options.search not in ("auto", "dp"):
        raise ArgumentError(
            f"--dp {options.dp} forces a data-parallel plan, which --search {options.search} does not make; "
            f"drop --search (--dp implies --search dp) or drop --dp"
        )
    # Before the model is traced and searched, so a typo or a bad path is reported at once.
    cluster = Cluster.parse(options.cluster)  # before torch even loads
    from planner.constraints import SearchConstraints

    constraints = SearchConstraints.from_options(options.mesh, options.max_sizes, options.families)
    constraints.check_cluster(cluster)
    from planner.routing import read_routing_option

    routing = read_routing_option(options.routing)
    co_runner = options.co_runner
    if co_runner is not None:  # a bad file or another cluster is said before the model is traced
        from planner.shared_cluster import check_same_cluster, load_co_runner

        # Passed on as its path: the search line names the job by it.
        check_same_cluster([co_runner, f"--cluster {options.cluster}"], [load_co_runner(co_runner).cluster, cluster])
    if options.output is not None:
        from planner.plans import is_plan_file

        if co_runner is not None:
            refuse_input_as_output(options.output, "-o", [co_runner])
        check_output_file(options.output, what="soap-planner plan", is_ours=is_plan_file, force=options.force)
    html_path = _check_html_output(options)
    from planner.api import plan as make_plan
    from planner.model_spec import ModelSpec, parse_overrides

    spec = ModelSpec(options.spec, parse_overrides(options.overrides))
    plan = make_plan(
        spec, cluster, dp_flavour=options.dp, precision=options.precision, search=options.search,
        effort=options.effort, time_budget_s=options.time_budget, seed=options.seed, progress=True, routing=routing,
        tp_layouts=options.tp_layouts, constraints=constraints, moe_dispatch=options.moe_dispatch,
        co_runner=co_runner,
    )
    steps = _next_steps(plan, options)
    if options.output is not None:
        plan.save(options.output, force=options.force)
    if html_path is not None:
        _write_html(options, plan, html_path)
    if options.format == "json":
        say_json({**report_data(plan), "saved": options.output, "next": steps})
        return 0
    say(plan.report(width=terminal_width()))
    if options.output is not None:
        say(f"saved the plan to {options.output}")
    if len(steps) == 1 and steps[0].startswith("not compiled: "):
        say(steps[0])
        return 0
    say("next:")
    for step in steps:
        say_command("  ", step)
    return 0


def _next_steps(plan, options: argparse.Namespace) -> list[str]:
    """The commands that come next, shell-quoted so they can be pasted as they are."""
    from planner.api import compile_blocker
    from planner.launch_command import first_run_command

    blocker = compile_blocker(plan)
    if blocker:
        return [f"not compiled: {blocker}"]  # a one-line explanation, not a command
    steps = []
    saved = options.output
    if not saved:
        saved = "plan.json"
        settings = [part for item in options.overrides for part in ("--set", item)]
        for flag, value, default in (
            ("--dp", options.dp, None), ("--search", options.search, "auto"), ("--precision", options.precision, "auto"),
            ("--effort", options.effort, 1.0), ("--seed", options.seed, 0), ("--routing", options.routing, None),
            ("--tp-layouts", options.tp_layouts, "auto"), ("--moe-dispatch", options.moe_dispatch, "compiled"),
        ):
            if value != default:
                settings += [flag, f"{value:g}" if isinstance(value, float) else value]
        steps.append(_command("python", "-m", "planner", "plan", options.spec, "--cluster", options.cluster, *settings, "-o", saved))
    steps.append(_command("python", "-m", "planner", "compile", saved, "-o", "out"))
    steps.append(first_run_command(plan, "out/launch.py"))
    return steps


def _command(*parts) -> str:
    return shlex.join(str(part) for part in parts)


def _profile(options: argparse.Namespace) -> int:
    from pathlib import Path

    from planner.cluster import is_cluster_file_we_wrote
    from planner.errors import ClusterError
    from planner.outputs import check_output_file

    output = Path(options.output)
    # Check the destination before spending up to a minute measuring.
    if output.suffix.lower() not in (".toml", ".json"):
        raise ClusterError(f"cluster file {output} must end in .toml or .json, got {output.suffix!r}")
    check_output_file(output, what="cluster file", is_ours=is_cluster_file_we_wrote, force=options.force)

    from planner.profile_groups import measured_group, profiled_group

    grouped = profiled_group(options.cluster, options.group)  # checked before spending up to a minute measuring

    from cost_model.profile import measure_machine

    profile = measure_machine(options.nproc, options.device, options.quick)
    measured, notes = profile.cluster, profile.notes()
    rows = profile.table()
    if grouped is not None:
        measured, notes, others = measured_group(grouped, options.group, profile)
        rows.append(("group", f"{options.group} (measured here); {others}"))
    measured.save(output, comment=notes, force=options.force)
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        say(f"{name:<{width}}  {value}")
    say(f"wrote {output}; next: planner plan examples/gpt.py --cluster {output}")
    return 0


def _explain(options: argparse.Namespace) -> int:
    from planner.compare import plan_and_graph
    from planner.explain_text import render_explanations
    from planner.plans import load_plan
    from search.explain import explain_ops, select_ops

    plan = load_plan(options.plan)
    chosen = select_ops(plan, op=options.op, module=options.module, layer=options.layer)  # before tracing
    with status(f"costing the alternatives of {len(chosen)} op(s)"):
        plan, graph = plan_and_graph(plan.to_dict(), options.plan)
        explanations = explain_ops(plan, graph, chosen)
    say(render_explanations(explanations, terminal_width()))
    return 0


def _compare(options: argparse.Namespace) -> int:
    from planner.cluster import Cluster
    from planner.compare import check_measured_plan, compare, format_comparison, load_measured, plan_and_graph
    from planner.plans import load_plan

    cluster = Cluster.parse(options.cluster) if options.cluster else None
    run = load_measured(options.measured)
    plan = load_plan(options.plan)  # relative model sources resolved against the plan's folder
    check_measured_plan(plan, options.plan, run)  # before tracing: a measurement of another plan is refused
    with status(f"simulating {plan.name}"):
        plan, graph = plan_and_graph(plan.to_dict(), options.plan, cluster)
        parts = compare(plan, graph, run)
    say(format_comparison(parts, run, plan.name))
    return 0


def _calibrate(options: argparse.Namespace) -> int:
    from planner.cluster import Cluster
    from planner.compare import (
        calibrate,
        calibration_cases,
        check_cluster_output,
        check_runs_fit_cluster,
        format_fit,
        load_runs,
    )

    cluster = Cluster.parse(options.cluster)
    output = check_cluster_output(options.output, options.force)  # before any work
    refuse_input_as_output(output, "-o", [*options.measured, options.cluster])
    runs = load_runs(options.measured)
    check_runs_fit_cluster(runs, cluster, options.cluster)
    with status(f"fitting {len(runs)} measured run(s)"):
        cases = calibration_cases(runs)
        calibrated, fit = calibrate(runs, cluster, cases)
    calibrated.save(output, comment=f"calibrated by `planner calibrate` on {len(runs)} measured run(s)", force=options.force)
    say(format_fit(fit, cases))
    say(f"wrote {output}; next: planner plan MODEL --cluster {output}")
    return 0


def _simulate(options: argparse.Namespace) -> int:
    import dataclasses

    if options.trace is not None:
        from planner.strategy import check_trace_output

        check_trace_output(options.trace, [options.plan], force=options.force)
    from planner.api import simulate
    from planner.plans import load_plan

    plan = load_plan(options.plan)
    with status(f"simulating {plan.name}"):
        result = simulate(plan)
    print_report(dataclasses.replace(plan, estimate=result), options.format)
    if options.trace is not None:
        result.to_chrome_trace(options.trace, force=options.force)
        say(f"wrote the timeline to {options.trace} (open it in https://ui.perfetto.dev)")
    return 0


def _check_html_output(options: argparse.Namespace):
    """``--html``'s path, checked before any work (``None`` without the flag)."""
    if getattr(options, "html", None) is None:
        return None
    from planner.html_report import is_html_report
    from planner.outputs import check_output_file

    return check_output_file(options.html, what="HTML report", is_ours=is_html_report, force=options.force)


def _write_html(options: argparse.Namespace, plan, path) -> None:
    """The self-contained page: the plan's timeline (simulated again when the plan was loaded
    from a file, which keeps no timeline) and, with ``--measured``, predicted against measured."""
    from planner.api import simulate
    from planner.html_report import html_report
    from planner.outputs import write_text_atomically

    timeline = plan.estimate.timeline
    if not timeline:
        with status(f"simulating {plan.name} for its timeline"):
            timeline = simulate(plan).timeline
    measured = None
    if getattr(options, "measured", None):
        from planner.compare import check_measured_plan, compare, load_measured, plan_and_graph

        run = load_measured(options.measured)
        check_measured_plan(plan, options.plan, run)
        with status("comparing with the measurement"):
            compared, graph = plan_and_graph(plan.to_dict(), options.plan)
            measured = compare(compared, graph, run)
    write_text_atomically(path, html_report(plan, timeline=timeline, measured=measured))
    say(f"wrote the report page to {path} (open it in a browser; it needs no network)")
