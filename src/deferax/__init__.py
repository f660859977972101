"""deferax: expensive functions with hand-written derivatives in JAX and Equinox."""

import importlib.metadata

from ._concurrency._devices import set_devices as set_devices
from ._concurrency._placement import set_concurrency as set_concurrency
from ._host._executor import HostError as HostError
from ._host._host import host as host
from ._implementation._expensive import ExpensiveFn as ExpensiveFn
from ._implementation._fused import Fused as Fused
from ._implementation._fused import fuse as fuse
from ._implementation._trainable import trainable as trainable
from ._jacobian import jacobian as jacobian
from ._plan._cost import Cost as Cost
from ._plan._cost import Estimates as Estimates
from ._plan._cost import forget_timings as forget_timings
from ._plan._plan import Plan as Plan
from ._plan._plan import Recognised as Recognised
from ._plan._plan import Site as Site
from ._recognise._custom_vjp import recognise_custom_vjp as recognise_custom_vjp
from ._recognise._registry import Recognition as Recognition
from ._recognise._registry import register_recognition as register_recognition
from ._recognise._tesseract import recognise_tesseract as recognise_tesseract
from ._record import Call as Call
from ._record import Timeline as Timeline
from ._record import plot_timelines as plot_timelines
from ._record import record as record
from ._sparse._factorisations import factorisation_budget as factorisation_budget
from ._sparse._factorisations import set_factorisation_budget as set_factorisation_budget
from ._sparse._pattern import SparsePattern as SparsePattern
from ._sparse._solve import sparse_solve as sparse_solve
from ._sparse._solver import AbstractSparseSolver as AbstractSparseSolver
from ._sparse._solver import SuperLU as SuperLU
from ._sparse._solvers._auto import AutoSparseSolver as AutoSparseSolver
from ._sparse._solvers._cholmod import Cholmod as Cholmod
from ._sparse._solvers._klu import KLU as KLU
from ._sparse._solvers._pardiso import Pardiso as Pardiso
from ._transform import explain as explain
from ._transform import filter_grad as filter_grad
from ._transform import filter_value_and_grad as filter_value_and_grad
from ._typed import AnnotationError as AnnotationError
from ._typed import TypedModule as TypedModule
from ._typed import set_typechecking as set_typechecking
from ._typed import typechecking as typechecking
from ._typed import typechecking_enabled as typechecking_enabled

__version__ = importlib.metadata.version("deferax")
