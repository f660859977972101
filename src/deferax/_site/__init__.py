"""Each call of an `ExpensiveFn` as one equation: `Spec` (with whether its `bwd` lets a
`fused` be made), the site primitive, its linear partner and the forward-basis primitive
with their rules, and the unit tangents of an input.

The rest of deferax imports this package (`from .. import _site`) and reads these names."""

from ._forward_basis import forward_basis_p as forward_basis_p
from ._function import AbstractSiteFunction as AbstractSiteFunction
from ._primitive import bind_site as bind_site
from ._primitive import cotangents as cotangents
from ._primitive import declared_outputs_checked as declared_outputs_checked
from ._primitive import lin_p as lin_p
from ._primitive import operand_cotangents as operand_cotangents
from ._primitive import outputs as outputs
from ._primitive import planned as planned
from ._primitive import site_p as site_p
from ._primitive import unbatch as unbatch
from ._spec import FORWARD_BASIS as FORWARD_BASIS
from ._spec import LINEAR as LINEAR
from ._spec import PRIMITIVES as PRIMITIVES
from ._spec import SITE as SITE
from ._spec import Spec as Spec
from ._spec import bwd_decisions as bwd_decisions
from ._spec import spec_of as spec_of
from ._spec import unread_bwd_check as unread_bwd_check
from ._tangents import flatten_tangent as flatten_tangent
from ._tangents import n_inputs as n_inputs
from ._tangents import tangent_struct as tangent_struct
from ._tangents import unit_tangents as unit_tangents
