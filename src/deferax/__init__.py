"""deferax: expensive functions with hand-written derivatives in JAX and Equinox."""

import importlib.metadata

from ._concurrent import Fused as Fused
from ._concurrent import fuse as fuse
from ._concurrent import set_devices as set_devices
from ._cost import Cost as Cost
from ._cost import Estimates as Estimates
from ._cost import forget_timings as forget_timings
from ._executor import HostError as HostError
from ._executor import set_concurrency as set_concurrency
from ._expensive import ExpensiveFn as ExpensiveFn
from ._expensive import trainable as trainable
from ._host import host as host
from ._jacobian import jacobian as jacobian
from ._plan import Plan as Plan
from ._plan import Site as Site
from ._record import Call as Call
from ._record import Timeline as Timeline
from ._record import plot_timelines as plot_timelines
from ._record import record as record
from ._sparse_solve import SparsePattern as SparsePattern
from ._sparse_solve import sparse_solve as sparse_solve
from ._sparse_solver import AbstractSparseSolver as AbstractSparseSolver
from ._sparse_solver import SuperLU as SuperLU
from ._transform import explain as explain
from ._transform import filter_grad as filter_grad
from ._transform import filter_value_and_grad as filter_value_and_grad
from ._typed import (
    AnnotationError as AnnotationError,
)
from ._typed import (
    TypedModule as TypedModule,
)
from ._typed import (
    set_typechecking as set_typechecking,
)
from ._typed import (
    typechecking as typechecking,
)
from ._typed import (
    typechecking_enabled as typechecking_enabled,
)

__version__ = importlib.metadata.version("deferax")
