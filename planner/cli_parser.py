"""The command line's grammar: every ``planner`` command, its arguments and their help
(``build_parser``). What each command does is in ``planner.cli``; flags are checked here as far
as their type allows (``planner.arguments``), before anything is traced or measured."""

from __future__ import annotations

import argparse

from planner.arguments import OneLineParser, flag_type, integer_at_least, positive_finite
from planner.colocation import add_colocate_command
from planner.expert_layouts import MOE_DISPATCHES


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
    plan.add_argument("-v", "--verbose", action="store_true",
                      help="also say how the model was traced (which repeated blocks were copied, or why none were)")
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
