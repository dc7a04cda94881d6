"""A program that runs one micro-batch at a time (pipelines, gradient accumulation) is
written from the graph traced at one micro-batch, and dry-run on one: the example batch cut
to its first samples, in the tracer's hands and in the dry run's ``shard_batch``."""

from __future__ import annotations

import textwrap

from codegen.runtime.accumulation import micro_batches


def first_samples(args: tuple, kwargs: dict, batch: int, samples: int) -> tuple[tuple, dict]:
    """The example batch cut to its first ``samples`` samples: the first of the micro-batches
    the compiled program cuts a batch into (``codegen.runtime.accumulation.micro_batches``)."""
    return micro_batches(args, kwargs, batch // samples, batch)[0]


def first_micro_batch_only(micro: int) -> str:
    """Source appended to the program the dry run runs: its ``shard_batch`` keeps the first
    micro-batch of the example batch, the part of a global batch the program runs at once."""
    return textwrap.dedent(
        f'''

        _whole_batch = shard_batch


        def shard_batch(args, kwargs, mesh):
            def cut(value):
                return value[:{micro}] if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == GLOBAL_BATCH else value

            return _whole_batch(tuple(cut(v) for v in args), {{k: cut(v) for k, v in kwargs.items()}}, mesh)
        '''
    )
