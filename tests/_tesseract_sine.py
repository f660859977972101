"""A Tesseract API module for tests/test_tesseract.py (served in-process with
`Tesseract.from_tesseract_api`): `y = sin(x) * w`, with `apply`, `vector_jacobian_product`,
`jacobian_vector_product` and `abstract_eval`. `CALLS` counts the requests each endpoint got;
`scale` is a non-differentiable input."""

import numpy as np
from pydantic import BaseModel
from tesseract_core.runtime import Array, Differentiable, Float64

CALLS = {"apply": 0, "vector_jacobian_product": 0, "jacobian_vector_product": 0}


class InputSchema(BaseModel):
    x: Differentiable[Array[(None,), Float64]]
    w: Differentiable[Array[(None,), Float64]]
    scale: Array[(), Float64] = 1.0


class OutputSchema(BaseModel):
    y: Differentiable[Array[(None,), Float64]]


def apply(inputs: InputSchema) -> OutputSchema:
    CALLS["apply"] += 1
    return OutputSchema(y=inputs.scale * np.sin(inputs.x) * inputs.w)


def vector_jacobian_product(inputs: InputSchema, vjp_inputs: set[str], vjp_outputs: set[str], cotangent_vector):
    CALLS["vector_jacobian_product"] += 1
    ct = inputs.scale * np.asarray(cotangent_vector["y"])
    out = {}
    if "x" in vjp_inputs:
        out["x"] = ct * np.cos(inputs.x) * inputs.w
    if "w" in vjp_inputs:
        out["w"] = ct * np.sin(inputs.x)
    return out


def jacobian_vector_product(inputs: InputSchema, jvp_inputs: set[str], jvp_outputs: set[str], tangent_vector):
    CALLS["jacobian_vector_product"] += 1
    y = np.zeros_like(inputs.x)
    if "x" in jvp_inputs:
        y = y + np.cos(inputs.x) * inputs.w * tangent_vector["x"]
    if "w" in jvp_inputs:
        y = y + np.sin(inputs.x) * tangent_vector["w"]
    return {"y": inputs.scale * y}


def abstract_eval(abstract_inputs):
    return {"y": {"shape": abstract_inputs.x.shape, "dtype": "float64"}}
