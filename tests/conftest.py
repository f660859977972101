import jax
import pytest

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_dtype_promotion", "strict")


@pytest.fixture
def counter():
    from .helpers import Counter

    return Counter()
