"""Command line: ``planner plan``, ``planner compile``, ``planner presets``, ``planner profile``,
``planner compare``, ``planner calibrate``, ``planner colocate`` and the rest: what each command does
(their arguments: ``planner.cli_parser``).

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

from planner.errors import ArgumentError, PlannerError
from planner.outputs import refuse_input_as_output
from planner.cli_output import print_report, report_data, say, say_command, say_json, say_named_lines, status
from planner.cli_parser import build_parser
from planner.colocation import run_colocate
from planner.terminal import inert_line
from planner.terminal_width import terminal_width

EXIT_USAGE = 2
EXIT_INTERNAL = 3


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
    if options.verbose and plan.graph is not None and plan.graph.trace_note:
        say(f"traced: {plan.graph.trace_note}")
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
