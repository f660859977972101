"""deferax: expensive functions with hand-written derivatives in JAX and Equinox."""

import importlib.metadata

from ._concurrent import Fused as Fused, fuse as fuse
from ._expensive import ExpensiveFn as ExpensiveFn
from ._plan import Plan as Plan, Site as Site
from ._transform import explain as explain, filter_grad as filter_grad, filter_value_and_grad as filter_value_and_grad
from ._typed import (
    AnnotationError as AnnotationError,
    set_typechecking as set_typechecking,
    TypedModule as TypedModule,
    typechecking as typechecking,
    typechecking_enabled as typechecking_enabled,
)

__version__ = importlib.metadata.version("deferax")
