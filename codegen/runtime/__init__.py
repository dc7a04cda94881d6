"""The small runtime that generated programs import (see ``codegen.runtime.program``)."""

from codegen.runtime.program import Program, load_program

__all__ = ["Program", "load_program"]
