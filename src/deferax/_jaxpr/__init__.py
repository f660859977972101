"""Everything that reads jaxprs or touches JAX internals lives in this package.

`jax.extend.core` and `jax._src` carry no compatibility promise across JAX releases, so a
JAX upgrade should have to touch this folder only, and mostly its `_internals` module,
which also holds the helpers on JAX values that the whole package shares. The
tested JAX range is pinned in `pyproject.toml`. One file a concern:

- `_internals`: every JAX name used here, from its public home where one exists; the only
  file that imports `jax._src`, and the one that knows how the releases differ; defining a
  primitive and the helpers its rules need; which traces run now; the caller's JAX
  configuration carried to other threads;
- `_program`: tracing a function once; reading, rewriting and interpreting the program;
  rewriting chosen equations into other code (recognised calls);
- `_dependence`: which values depend on which sources, and the user line that made it so;
  what cannot run outside the trace that made it, or must run once;
- `_replay`: a `custom_vjp`'s backward rule run once (traced at its first call, evaluated after);
- `_linearity`: where a program stops being linear in an input;
- `_example_axes`: which axis of a value indexes the examples of a batch;
- `_custom_vjp`: a `jax.custom_vjp` call read as a site, its backward split in two;
- `_loops`: two independent programs evaluated together, a loop of each stepped in one;
- `_work`: how much work a program does, estimated from its equations;
- `_keys`: cache keys equal for programs that compute the same thing.
"""

from ._custom_vjp import Program as Program
from ._custom_vjp import Split as Split
from ._custom_vjp import Unreadable as Unreadable
from ._custom_vjp import program as program
from ._custom_vjp import split_custom_vjp as split_custom_vjp
from ._dependence import Rules as Rules
from ._dependence import check_rules as check_rules
from ._dependence import dependencies as dependencies
from ._dependence import effect_dependencies as effect_dependencies
from ._dependence import escaping as escaping
from ._dependence import first_culprit as first_culprit
from ._dependence import input_marks as input_marks
from ._dependence import is_ref as is_ref
from ._dependence import is_ref_type as is_ref_type
from ._dependence import needed_equations as needed_equations
from ._dependence import once_only as once_only
from ._dependence import opaque_call as opaque_call
from ._dependence import raised_at as raised_at
from ._dependence import uses_refs as uses_refs
from ._example_axes import example_axes as example_axes
from ._internals import apply_config as apply_config
from ._internals import aval_of as aval_of
from ._internals import backward_rule as backward_rule
from ._internals import carry_context as carry_context
from ._internals import custom_vjp_call_primitive as custom_vjp_call_primitive
from ._internals import define_primitive as define_primitive
from ._internals import function_name as function_name
from ._internals import instantiate as instantiate
from ._internals import is_concrete as is_concrete
from ._internals import is_eager as is_eager
from ._internals import is_inexact as is_inexact
from ._internals import is_not_mapped as is_not_mapped
from ._internals import is_primitive as is_primitive
from ._internals import is_zero as is_zero
from ._internals import linear_solve_primitive as linear_solve_primitive
from ._internals import local_config as local_config
from ._internals import manual_axes as manual_axes
from ._internals import move_to_front as move_to_front
from ._internals import rule_functions as rule_functions
from ._internals import setting as setting
from ._internals import shape_text as shape_text
from ._internals import shaped as shaped
from ._internals import stacked as stacked
from ._internals import struct_of as struct_of
from ._internals import structs as structs
from ._internals import to_varying as to_varying
from ._internals import under_differentiation as under_differentiation
from ._internals import unreduced_axes as unreduced_axes
from ._internals import vary as vary
from ._internals import varying_axes as varying_axes
from ._internals import with_varying as with_varying
from ._internals import zero_like as zero_like
from ._internals import zero_tangent as zero_tangent
from ._internals import zeros as zeros
from ._keys import structural_key as structural_key
from ._linearity import frontier_size as frontier_size
from ._linearity import linear_frontier as linear_frontier
from ._linearity import nonlinear_uses as nonlinear_uses
from ._loops import together as together
from ._program import Found as Found
from ._program import Nested as Nested
from ._program import computing as computing
from ._program import contains as contains
from ._program import inline as inline
from ._program import interpret as interpret
from ._program import kind_of as kind_of
from ._program import merge_duplicates as merge_duplicates
from ._program import nested_in as nested_in
from ._program import open_consts as open_consts
from ._program import prune as prune
from ._program import rewrite as rewrite
from ._program import substitute as substitute
from ._program import top_level as top_level
from ._program import trace as trace
from ._work import work as work
