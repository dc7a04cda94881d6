"""``launch.py`` flags that parse but cannot mean what they say together: refused with one
line before anything starts, rather than silently ignored or silently bent.

Each rule names the flags, why they do not fit, and what to give instead. Flags whose value
alone is wrong (a negative learning rate) are refused by the parser
(``planner.arguments``); rules here need two flags or more.
"""

from __future__ import annotations

import argparse

from planner.errors import LaunchError


def check_flag_combinations(options: argparse.Namespace) -> None:
    """Refuse the first incoherent combination of ``launch.py``'s flags.

    Raises:
        LaunchError: one line naming the flags and the fix.
    """
    training = options.steps > 0 or options.data is not None
    if not training:
        idle = [flag for flag, given in (
            ("--warmup-steps", options.warmup_steps > 0), ("--min-lr-ratio", options.min_lr_ratio > 0),
            ("--clip-grad-norm", options.clip_grad_norm is not None), ("--log-every", options.log_every != 1),
            ("--metrics", options.metrics is not None), ("--profile", options.profile is not None),
            ("--slowdown-from-cluster", getattr(options, "slowdown_from_cluster", 0.0) > 0),
        ) if given]
        if idle:
            one = len(idle) == 1
            raise LaunchError(
                f"{' and '.join(idle)} {'acts' if one else 'act'} on training steps, and this run trains none; add "
                f"--steps N (or --data FILE.py:FUNCTION), or leave {'it' if one else 'them'} out"
            )
    if not options.check and (options.atol is not None or options.rtol is not None):
        raise LaunchError("--atol and --rtol are the tolerances of --check; add --check, or leave them out")
    if options.steps > 0 and options.warmup_steps > options.steps:
        raise LaunchError(
            f"--warmup-steps {options.warmup_steps} is more than --steps {options.steps}: the learning rate would never "
            f"reach --lr; give at most {options.steps} warm-up steps"
        )
    if options.lr_schedule != "constant" and options.steps > 0 and options.warmup_steps >= options.steps:
        raise LaunchError(
            f"--lr-schedule {options.lr_schedule} decays after the --warmup-steps {options.warmup_steps}, and --steps "
            f"{options.steps} leaves no step to decay over; give fewer warm-up steps or more steps"
        )
    if options.min_lr_ratio > 1:
        raise LaunchError(
            f"--min-lr-ratio {options.min_lr_ratio:g} is above 1: the decay would end above --lr; give the final "
            f"learning rate as a fraction of --lr between 0 and 1"
        )
    if options.min_lr_ratio > 0 and options.lr_schedule == "constant":
        raise LaunchError(
            f"--min-lr-ratio {options.min_lr_ratio:g} says where a decay ends, and --lr-schedule is constant; add "
            f"--lr-schedule cosine (or linear), or leave --min-lr-ratio out"
        )
